#!/usr/bin/env bash
# Issue 21: the 0.64-epoch reproduction's BatchEnsemble and Packed-Ensembles rows (docs/results.md "Reproduction"), re-run with
# the layers checked against torch-uncertainty (checks/test_vs_torch_uncertainty.py), with the single model they pair
# with: the recipe as written (configs/fmnist_small.yaml, 200 steps), M = 4, seeds 0, 1, 2; then `sigmanens compare`.
#   bash research/recheck_small_baselines.sh [OUT]      # OUT defaults to runs/repro_recheck; ~20 min on one core
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET_ARGS=()
studies_begin "${1:-runs/repro_recheck}" 5078  # or reuse the server of a reproduction on the same OUT

study baselines methods --methods single,batch,packed --members 4
sigmanens compare --experiment sigmanens-fmnist-small --uri "$URI" --out "$OUT/compare" --pair epochs
