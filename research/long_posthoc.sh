#!/usr/bin/env bash
# Post-hoc calibration at the long budget (docs/results.md "After temperature scaling"): does σN-Ens still beat one
# network once both are temperature scaled? Trains, per seed, the single model, σN-Ens M=4 (the recipe: τ = 0.5,
# λ = 0.01), the Deep Ensemble M=4 and Packed-Ensembles M=4 α=3, with no end-of-training evaluation: the test set is
# read once, by the second phase. Each finished study's runs are kept in results/posthoc_long/records/<study>.jsonl; an
# evaluated study is not trained again; a recorded one whose checkpoint is not in OUT is trained again and its record
# rewritten (same seed, same recipe; on another machine the floats may differ), and the checkpoints are kept in OUT.
#   bash research/long_posthoc.sh train [OUT] [LANE...]   # lanes: single sigma deep packed3 (default: all, in turn)
#   bash research/long_posthoc.sh eval [OUT]              # each run's best checkpoint (chosen on validation), once
# Two train lanes may run at once on one OUT (they share its MLflow server), e.g. `train OUT sigma single` and
# `train OUT deep packed3`. The eval phase fits the temperature and the conformal thresholds (α = 0.1, 0.05) on the
# validation split and scores the test set clean, under every test corruption (`--corruptions all`, severities 3, 5)
# and against the OOD set; the kept results used the 16 corruptions of the time, and re-running now scores the 14 test
# corruptions (docs/eval.md, "The validation shift"), so its shift means are not comparable to the kept ones to the digit;
# each run's eval.json and eval.md go to results/posthoc_long/evals/<study>/. Then:
#   python research/posthoc_tables.py   # the tables of docs/results.md
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
phase="${1:-}"
[[ $phase == train || $phase == eval ]] || { echo "long_posthoc: give a phase, train or eval (got '$phase')" >&2; exit 2; }
shift
out_arg="${1:-runs/posthoc_long}"
shift $(($# > 0 ? 1 : 0))
RESULTS="$ROOT/results/posthoc_long"
SEED_LIST=(${SEEDS:-0 1 2})

evaluated() { [ -s "$RESULTS/evals/$1/eval.json" ]; }

if [ "$phase" = train ]; then
  read -r -a LANES <<< "${*:-single sigma deep packed3}"
  BUDGET_ARGS=("${LONG_BUDGET[@]}" eval.at_end=false)
  studies_begin "$out_arg" 5083
  RECORDS="$RESULTS/records"
  train_lanes evaluated "${LANES[@]}"
  [ ! -e "$OUT/.failed" ]
  exit
fi

OUT="$(cd "$out_arg" && pwd)"
export OMP_NUM_THREADS=1
failed=0
for seed in "${SEED_LIST[@]}"; do
  for lane in single sigma deep packed3; do
    name="${lane}_s$seed" dest="$RESULTS/evals/${lane}_s$seed"
    if evaluated "$name"; then echo "[$(date +%T)] $name: evaluated before, skipped"; continue; fi
    runs=("$OUT/$name"/*/final_metrics.json)
    if [ ! -e "${runs[0]}" ]; then echo "[$(date +%T)] $name: not trained (no $OUT/$name/*/final_metrics.json)"; failed=1; continue; fi
    run="$(dirname "${runs[0]}")"
    echo "[$(date +%T)] $name: sigmanens eval --checkpoint $run"
    if publish_eval "$dest" "$OUT/$name.eval" "$OUT/$name.eval.log" --checkpoint "$run" --calibration temperature \
        --conformal 0.1,0.05 --corruptions all --severities 3,5 --ood digits --no-sub-ensembles --no-mlflow; then
      echo "[$(date +%T)] $name: kept in $dest"
    else
      echo "[$(date +%T)] $name: eval FAILED: $OUT/$name.eval.log"
      failed=1
    fi
  done
done
exit "$failed"
