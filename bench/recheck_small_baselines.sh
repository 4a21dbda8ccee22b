#!/usr/bin/env bash
# Issue 21: the 0.64-epoch reproduction's BatchEnsemble and Packed-Ensembles rows (README "Reproduction"), re-run with
# the layers checked against torch-uncertainty (bench/check_vs_torch_uncertainty.py), with the single model they pair
# with: the recipe as written (configs/fmnist_small.yaml, 200 steps), M = 4, seeds 0, 1, 2; then `sigmanens compare`.
#   bash bench/recheck_small_baselines.sh [OUT]      # OUT defaults to runs/repro_recheck; ~20 min on one core
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
OUT="$(mkdir -p "${1:-runs/repro_recheck}" && cd "${1:-runs/repro_recheck}" && pwd)"
PORT="${SIGMANENS_REPRO_PORT:-5078}"
CFG=configs/fmnist_small.yaml
BUDGET_ARGS=()
export SIGMANENS_REPRO_NICE="${SIGMANENS_REPRO_NICE:-19}"
source "$ROOT/launch/studies.sh"
start_tracking
trap stop_tracking EXIT

study baselines methods --methods single,batch,packed --members 4
sigmanens compare --experiment sigmanens-fmnist-small --uri "$URI" --out "$OUT/compare" --pair epochs
