#!/usr/bin/env bash
# The checks against torch-uncertainty in their own environment: create (or reuse) a venv outside the repository,
# install torch-uncertainty 0.13.0 there, run pytest over checks/. Any pytest arguments pass through.
#   bash checks/run.sh                          # venv in /tmp/sigmanens-tu-venv
#   SIGMANENS_TU_VENV=DIR bash checks/run.sh -k packed
# torch-uncertainty's package __init__ imports lightning, which the project's venv does not have (nor CI's run).
# The venv is made with --system-site-packages and a .pth naming the project venv's site-packages, so torch, timm and
# pytest are reused, not downloaded again: from a venv's python, --system-site-packages exposes only the *base*
# interpreter's site-packages. Exits non-zero if torch-uncertainty cannot be installed or imported (pytest alone would
# skip every test).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PARENT="${SIGMANENS_VENV:-$ROOT/.venv}"       # the project's venv (launch/setup.sh makes it)
VENV="${SIGMANENS_TU_VENV:-/tmp/sigmanens-tu-venv}"  # not in the repository: only .venv/ is git-ignored there
TU="torch-uncertainty[cpu]==0.13.0"            # [cpu]: brings lightning; torch, torchvision, timm come from $PARENT
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's sigmanens_dist, whatever $PARENT has installed

[ -x "$PARENT/bin/python" ] || { echo "[checks] no project venv at $PARENT (set SIGMANENS_VENV)" >&2; exit 1; }
probe=(-c "import torch_uncertainty.layers, torch_uncertainty.models.classification, importlib.metadata as m
assert m.version('torch_uncertainty') == '0.13.0', m.version('torch_uncertainty')")
start=$SECONDS
[ -x "$VENV/bin/python" ] || "$PARENT/bin/python" -m venv --system-site-packages "$VENV"
site="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
"$PARENT/bin/python" -c "import sysconfig; print(*dict.fromkeys(sysconfig.get_paths()[k] for k in ('purelib', 'platlib')), sep='\n')" \
  > "$site/_sigmanens_parent_env.pth"
"$VENV/bin/python" -c "import torch, timm, pytest" \
  || { echo "[checks] torch, timm or pytest not importable from $PARENT" >&2; exit 1; }
if "$VENV/bin/python" "${probe[@]}" 2>/dev/null; then
  echo "[checks] reusing $VENV"
else
  echo "[checks] pip install $TU into $VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TU" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" "${probe[@]}" || { echo "[checks] torch-uncertainty 0.13.0 not importable from $VENV" >&2; exit 1; }
fi
echo "[checks] environment ready in $((SECONDS - start)) s"
cd "$ROOT"
start=$SECONDS
rc=0
"$VENV/bin/python" -m pytest checks/ -q --tb=short "$@" || rc=$?
echo "[checks] pytest exit $rc in $((SECONDS - start)) s"
exit "$rc"
