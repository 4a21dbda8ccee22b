#!/usr/bin/env bash
# The wheels a GPU run takes along: the GPU image (Python 3.12, x86-64, torch 2.11; its packages are
# bench/gpu_image_packages.txt) has no pydantic, and nothing can be fetched there. Downloads the pins of
# bench/gpu_wheels.txt, binary only and without dependencies (the file names each one), into DEST, which
# bench/gpu_check.sh installs first (--wheels DEST; default gpu_wheels, ignored by git; about 3 MB).
#   bash bench/gpu_wheels.sh [DEST] [--python-version 3.12]
# --python-version 3.11 fetches the same pins for this machine's Python: the wheel folder of a dry run here
# (docs/benchmarks.md "On a GPU").
set -euo pipefail
DEST=gpu_wheels
PYVER=3.12
while (($#)); do
  case "$1" in
    --python-version) PYVER=$2; shift 2 ;;
    -*) echo "unknown option $1 (bash bench/gpu_wheels.sh [DEST] [--python-version 3.12])" >&2; exit 2 ;;
    *) DEST=$1; shift ;;
  esac
done
PY="${PYTHON:-python3}"
REQS="$(dirname "$0")/gpu_wheels.txt"
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two would stop the install there
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" -r "$REQS"
ls -1 "$DEST"
echo "$(du -sh "$DEST" | cut -f1) in $DEST for Python $PYVER: name it in the GPU call's carry"
