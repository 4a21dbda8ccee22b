#!/usr/bin/env bash
# The test command: set up (if needed), then run the whole suite, slow end-to-end tests included, in two pytest-xdist
# workers (most tests wait on subprocesses: torchrun, Slurm, an MLflow server). A module's tests stay on one worker
# (--dist loadscope), so module fixtures (a trained run, the Slurm cluster) are built once.
#   bash launch/test.sh                 # everything
#   bash launch/test.sh -m "not slow"   # quick subset; any pytest arguments pass through (-n 0: one process)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh" || exit 1
cd "$ROOT"
ruff check . || exit 1
python -m pytest -q --timeout=900 -n 2 --dist loadscope --durations=15 "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests (exit 5): nothing was checked" >&2
  exit 1
fi
exit "$rc"
