#!/usr/bin/env bash
# The test command: set up (if needed), then run the whole suite, slow end-to-end tests included.
#   bash launch/test.sh                 # everything
#   bash launch/test.sh -m "not slow"   # quick subset; any pytest arguments pass through
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh" || exit 1
cd "$ROOT"
ruff check . || exit 1
python -m pytest -q --timeout=900 "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests (exit 5): nothing was checked" >&2
  exit 1
fi
exit "$rc"
