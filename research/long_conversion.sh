#!/usr/bin/env bash
# Issue 27 at the long budget (docs/results.md "Converting a trained network"): the true conversion against the perturbed
# start, 5 paired seeds. Seed s: the single model (6,250 steps, the long budget), then from it, 625 steps (10 %) at
# lr 0.005: the source continued (the reference), and σN-Ens M=4 at the fine-tune recipe (τ = 0.5, λ = 0.01,
# γ ~ N(1.5, 1)) started two ways: model.affine_init=divide (every member equals the source at step 0) and
# model.affine_init=perturb (member m is the source with every feature scaled by σ(γ_m) at every norm).
# Resumable (a finished study is skipped, a half-finished one continues); niced; one process.
#   bash research/long_conversion.sh [OUT] [SEEDS]   # defaults: runs/conversion, "0 1 2 3 4"
# Then: sigmanens compare --experiment sigmanens-fmnist-conversion --uri http://127.0.0.1:5078 --split val|test
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET_ARGS=()  # each study sets its whole budget
FINETUNE=("${FINETUNE_BUDGET[@]}" reg.tau=0.5 model.gamma_init_mean=1.5 model.gamma_init_std=1
          tracking.experiment=sigmanens-fmnist-conversion)
studies_begin "${1:-runs/conversion}" 5078
for seed in ${2:-0 1 2 3 4}; do
  study "source_s$seed" methods --methods single --seeds "$seed" "${LONG_BUDGET[@]}"
  src="model.init_from=$OUT/source_s$seed/single-s$seed"
  study "continued_s$seed" methods --methods single --seeds "$seed" "${FINETUNE[@]}" "$src"
  for start in divide perturb; do
    study "${start}_s$seed" methods --methods sigma --members 4 --seeds "$seed" "${FINETUNE[@]}" "$src" \
      "model.affine_init=$start"
  done
done
[ ! -e "$OUT/.failed" ]
