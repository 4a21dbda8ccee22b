#!/usr/bin/env bash
# Issue 27, part 2 (docs/results.md "Choices on the validation split"): the default τ re-chosen where a choice
# belongs, on the validation split. At the long budget, per seed: the single model, then σN-Ens M=4 on the τ-active
# start (γ ~ N(2, 0.1), λ = 0.01) at τ = 0.5, 0.25, 1, 0.1 (seed-major, so that a partial run already pairs whole
# seeds). Its own MLflow store (the earlier sweep's store was not kept); resumable; niced; one process. Each finished
# study's runs are kept in results/choices_val/records/<study>.jsonl (RECORDS), so the work outlives OUT: a study
# recorded there is not run again.
#   bash research/long_choices_val.sh [OUT] [SEEDS] [TAUS]   # defaults: runs/choices_val, "0 1 2", "0.5 0.25 1 0.1"
# Then: sigmanens compare --records results/choices_val/records/*.jsonl --split val --out results/choices_val/val,
# and once for the chosen τ and the single model (their records files only): --split test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
source "$ROOT/launch/studies.sh"
BUDGET_ARGS=("${LONG_BUDGET[@]}")
TAU_ACTIVE=(model.gamma_init_mean=2 model.gamma_init_std=0.1)
studies_begin "${1:-runs/choices_val}" 5079
RECORDS="${RECORDS:-$ROOT/results/choices_val/records}"
for seed in ${2:-0 1 2}; do
  study "single_s$seed" methods --methods single --seeds "$seed"
  for tau in ${3:-0.5 0.25 1 0.1}; do
    study "tau${tau/./}_s$seed" tau-sweep --taus "$tau" --lambdas 0.01 --seeds "$seed" "${TAU_ACTIVE[@]}"
  done
done
[ ! -e "$OUT/.failed" ]
