#!/usr/bin/env bash
# One-time (idempotent) set-up of a fresh machine: system packages, a virtual environment, this package.
# Sourced by launch/demo.sh and launch/test.sh; safe to re-run (it skips what is already there).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SIGMANENS_VENV:-$ROOT/.venv}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

# System packages: Fashion-MNIST (the demo's data, shipped by Debian); FFCV's build needs turbojpeg and OpenCV;
# nginx serves shards over HTTP in tests/data/test_remote_shards.py (its own config, started and stopped by the test);
# Java runs the local Spark session of the spark extra (tests/registry/test_registry.py: spark_udf).
APT_PACKAGES=(dataset-fashion-mnist pkg-config libturbojpeg0-dev libopencv-dev nginx openjdk-17-jre-headless)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] apt-get install ${missing[*]}"
    # another apt may hold the dpkg lock: wait for it, at most 5 minutes
    apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null \
      && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] missing system packages: ${missing[*]} (run as root: apt-get install ${missing[*]})" >&2
  fi
fi

# Python environment: torch pinned to the wheels this platform has, then the package with its extras.
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.sigmanens-installed"
# On x86_64 every package is held to launch/constraints.txt, the set the README's numbers were measured with (a newer
# numpy or timm changes the demo's scores); SIGMANENS_CONSTRAINTS=none installs the newest releases instead.
CONSTRAINTS="${SIGMANENS_CONSTRAINTS:-$ROOT/launch/constraints.txt}"
[ "$CONSTRAINTS" = none ] || [ -f "$CONSTRAINTS" ] \
  || { echo "[setup] SIGMANENS_CONSTRAINTS=$CONSTRAINTS: no such file (a pip constraints file, or none)" >&2; exit 2; }
pins_file="$CONSTRAINTS"; [ "$CONSTRAINTS" != none ] || pins_file=/dev/null
want="$(cat "$ROOT/pyproject.toml" "$pins_file" | sha1sum | cut -c1-40)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  PINS=()
  case "$(uname -m)" in
    aarch64|arm64) TORCH=(torch==2.9.1 torchvision==0.24.1) ;;
    *) TORCH=(torch==2.14.1 torchvision==0.29.1)
       [ "$CONSTRAINTS" = none ] || PINS=(-c "$CONSTRAINTS") ;;
  esac
  echo "[setup] installing ${TORCH[*]} and sigmanens-dist[dev,mlflow,ffcv,webdataset,deepspeed,deploy,spark] into $VENV" \
    "(${PINS[1]:+held to }${PINS[1]:-newest releases: no constraints on $(uname -m)}; a few minutes the first time)"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${TORCH[@]}" "${PINS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}" -e "$ROOT[dev,mlflow,ffcv,webdataset,deepspeed,deploy,spark]" \
    2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch, torchvision, timm, ffcv, webdataset, mlflow, deepspeed, onnxruntime, pyarrow, pyspark, sigmanens_dist" \
    || { echo "[setup] install failed: see pip output above (pins that do not resolve here: SIGMANENS_CONSTRAINTS=none)" >&2
         exit 1; }
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
