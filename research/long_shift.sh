#!/usr/bin/env bash
# σN-Ens under shift at the long budget (docs/results.md "Under shift", issue 45): the checkpoints the diagnosis and
# the levers are measured on. Trains, per seed, the single model and σN-Ens M=4 at three temperatures (τ = 0.25, 0.5,
# the recipe, and 1), with no end-of-training evaluation: every choice is made later on the validation split and the
# validation corruptions, and the test set is read once, at the end. A finished study's runs are kept in
# results/shift_long/records/<study>.jsonl (a recorded study is not trained again); the checkpoints stay in OUT.
#   bash research/long_shift.sh train [OUT] [LANE...]   # lanes: single sigma sigma_t025 sigma_t1 (default: all, in turn)
#   SEEDS="0 1 2 3 4" bash research/long_shift.sh train runs/shift_long sigma single
# Two lanes may run at once on one OUT (they share its MLflow server).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
source "$ROOT/launch/studies.sh"
phase="${1:-}"
[[ $phase == train ]] || { echo "long_shift: give a phase: train (got '$phase')" >&2; exit 2; }
shift
out_arg="${1:-runs/shift_long}"
shift $(($# > 0 ? 1 : 0))
SEED_LIST=(${SEEDS:-0 1 2 3 4})
declare -A LANE_ARGS=(
  [single]="--methods single"
  [sigma]="--methods sigma --members 4"
  [sigma_t025]="--methods sigma --members 4 reg.tau=0.25"
  [sigma_t1]="--methods sigma --members 4 reg.tau=1.0"
)
read -r -a LANES <<< "${*:-single sigma sigma_t025 sigma_t1}"
for lane in "${LANES[@]}"; do
  [ -n "${LANE_ARGS[$lane]:-}" ] || { echo "long_shift: unknown lane $lane (${!LANE_ARGS[*]})" >&2; exit 2; }
done
BUDGET_ARGS=("${LONG_BUDGET[@]}" eval.at_end=false)
studies_begin "$out_arg" 5091
RECORDS="$ROOT/results/shift_long/records"
for seed in "${SEED_LIST[@]}"; do
  for lane in "${LANES[@]}"; do
    # shellcheck disable=SC2086  # LANE_ARGS holds several words
    study "${lane}_s$seed" methods ${LANE_ARGS[$lane]} --seeds "$seed"
  done
done
[ ! -e "$OUT/.failed" ]
