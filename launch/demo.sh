#!/usr/bin/env bash
# The embedded demo: set up (if needed), then train a single model and σN-Ens (M=4) on Fashion-MNIST under
# 2-process torchrun DDP on CPU as a small study, and compare them from its MLflow store (`sigmanens compare`'s table
# and plots, reliability diagrams). Extra args go to the demo, e.g. `bash launch/demo.sh --seeds 0,1,2` or
# `bash launch/demo.sh --out runs/demo_short train.max_steps=100`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
exec sigmanens demo "$@"
