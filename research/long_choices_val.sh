#!/usr/bin/env bash
# Issue 27, part 2 (docs/results.md "Choices on the validation split"): the default τ re-chosen where a choice
# belongs, on the validation split. At the long budget, per seed: the single model, then σN-Ens M=4 on the τ-active
# start (γ ~ N(2, 0.1), λ = 0.01) at τ = 0.5, 0.25, 1, 0.1 (seed-major, so that a partial run already pairs whole
# seeds). Its own MLflow store (the earlier sweep's store was not kept); resumable; niced; one process. Each finished
# study's runs are kept in results/choices_val/records/<study>.jsonl (RECORDS), so the work outlives OUT: a study
# recorded there is not run again.
#   bash research/long_choices_val.sh [OUT] [SEEDS] [TAUS]   # defaults: runs/choices_val, "0 1 2", "0.5 0.25 1 0.1"
# GAMMA0="MEAN STD" replaces the τ-active start (the from-scratch γ start, chosen on validation the same way): its
# studies are named tau<τ>_g<MEAN>-<STD>_s<seed> and the single model is not run again, e.g.
#   GAMMA0="1 1" bash research/long_choices_val.sh runs/choices_val "0 1 2" 0.5
# Then: sigmanens compare --records results/choices_val/records/*.jsonl --split val --out results/choices_val/val,
# and once for the chosen τ and the single model (their records files only): --split test.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET_ARGS=("${LONG_BUDGET[@]}")
START=(model.gamma_init_mean=2 model.gamma_init_std=0.1) start_tag=""
if [ -n "${GAMMA0:-}" ]; then
  read -r mean std extra <<< "$GAMMA0"
  [[ -n "$std" && -z "${extra:-}" ]] || { echo "long_choices_val: GAMMA0='$GAMMA0'; give a mean and a std, e.g. GAMMA0=\"1 1\"" >&2; exit 2; }
  START=("model.gamma_init_mean=$mean" "model.gamma_init_std=$std") start_tag="_g$mean-$std"
fi
studies_begin "${1:-runs/choices_val}" 5079
RECORDS="${RECORDS:-$ROOT/results/choices_val/records}"
for seed in ${2:-0 1 2}; do
  [ -n "$start_tag" ] || study "single_s$seed" methods --methods single --seeds "$seed"
  for tau in ${3:-0.5 0.25 1 0.1}; do
    study "tau${tau/./}${start_tag}_s$seed" tau-sweep --taus "$tau" --lambdas 0.01 --seeds "$seed" "${START[@]}"
  done
done
[ ! -e "$OUT/.failed" ]
