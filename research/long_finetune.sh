#!/usr/bin/env bash
# Issue 18 at the long budget (docs/results.md "Long budget"): the fine-tuned conversion on 5 paired seeds, and with the σ
# store at the from-scratch rate. Beside `launch/reproduce.sh OUT long` (same OUT and MLflow store); resumable.
#   bash research/long_finetune.sh [OUT]         # OUT defaults to runs/repro_long; one process, niced
# Seeds 3 and 4 get their source (the single model, 6,250 steps) and the fine-tunes reproduce.sh runs on seeds 0-2:
# the source continued and the τ = 1, γ ~ N(0, 1) conversion (finetune_s*), the τ = 0.5, γ ~ N(2, 0.1) conversion
# (finetune05_s*). Then on all five seeds the τ = 0.5 conversion with the σ store (γ, member affines) at 40 × the
# fine-tune's rate, 0.2: the rate it has when trained from scratch (0.05 × M), so that γ can move within 625 steps.
# Last, on all five seeds the τ = 0.5 conversion with every member on the same batch (model.member_batches=shared):
# the backbone then sees the continued source's images, not M× as many (research/long_shared_batches.sh from scratch).
# Then the middle start between the two, γ ~ N(1, 1) at τ = 0.5 (a sixth of the gates below 0.5), with independent
# and with shared batches, on seeds 0-2 (MIDDLE_SEEDS="0 1 2 3 4" for all five; MIDDLE_BATCHES, MIDDLE_GAMMA="m s").
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET_ARGS=()  # each study sets its whole budget
FINETUNE=("${FINETUNE_BUDGET[@]}" reg.tau=1 model.gamma_init_mean=0 model.gamma_init_std=1
          tracking.experiment=sigmanens-fmnist-finetune
          model.affine_init=perturb)  # the start these fine-tunes were measured with (0.1's recipes pinned plain)
TAU_ACTIVE=(model.gamma_init_mean=2 model.gamma_init_std=0.1)
studies_begin "${1:-runs/repro_long}" 5077  # or reuse the server of a reproduction on the same OUT

sigmalr() {  # the τ = 0.5 conversion with the σ store at the from-scratch rate
  study "finetune05_sigmalr_s$1" methods --methods sigma --members 4 --seeds "$1" "${FINETUNE[@]}" reg.tau=0.5 \
    "${TAU_ACTIVE[@]}" optim.sigma_lr_scale=40 "model.init_from=$OUT/methods_s$1/single-s$1"
}
for seed in 0 1 2; do sigmalr "$seed"; done  # the sources of seeds 0-2 exist (reproduce.sh)
for seed in 3 4; do
  study "methods_s$seed" methods --methods single --seeds "$seed" "${LONG_BUDGET[@]}"
  study "finetune_s$seed" methods --methods single,sigma --members 4 --seeds "$seed" "${FINETUNE[@]}" \
    "model.init_from=$OUT/methods_s$seed/single-s$seed"
  study "finetune05_s$seed" methods --methods sigma --members 4 --seeds "$seed" "${FINETUNE[@]}" reg.tau=0.5 \
    "${TAU_ACTIVE[@]}" "model.init_from=$OUT/methods_s$seed/single-s$seed"
  sigmalr "$seed"
done
for seed in 0 1 2 3 4; do
  study "finetune05_shared_s$seed" methods --methods sigma --members 4 --seeds "$seed" "${FINETUNE[@]}" reg.tau=0.5 \
    "${TAU_ACTIVE[@]}" model.member_batches=shared "model.init_from=$OUT/methods_s$seed/single-s$seed"
done
read -r gmean gstd <<<"${MIDDLE_GAMMA:-1 1}"  # MIDDLE_GAMMA="1.5 1": another start (studies *_g15_*)
tag=$([ "$gmean" = 1 ] && [ "$gstd" = 1 ] || echo "_g${gmean/./}")
for seed in ${MIDDLE_SEEDS:-0 1 2}; do
  for batches in ${MIDDLE_BATCHES:-independent shared}; do
    study "finetune05_middle${tag}_${batches}_s$seed" methods --methods sigma --members 4 --seeds "$seed" \
      "${FINETUNE[@]}" reg.tau=0.5 "model.gamma_init_mean=$gmean" "model.gamma_init_std=$gstd" \
      "model.member_batches=$batches" "model.init_from=$OUT/methods_s$seed/single-s$seed"
  done
done
