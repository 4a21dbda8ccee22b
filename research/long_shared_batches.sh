#!/usr/bin/env bash
# Issue 18 at the long budget (docs/results.md "Long budget"): σN-Ens with every member on the same batch
# (model.member_batches=shared, the paper's batched pass) instead of its own, at τ = 0.5 (the default) and τ = 0.25.
# Under independent batches the shared backbone sees M× the distinct images of a single model per step, and the
# single model trained 4× longer is worse calibrated under shift than at 1×; this asks whether σN-Ens's calibration
# under shift is that effect. Beside `launch/reproduce.sh OUT long` (same OUT and MLflow store); resumable.
#   bash research/long_shared_batches.sh [OUT] [SEEDS] [TAUS]   # defaults: runs/repro_long, "0 1 2 3 4", "0.5 0.25"
# GAMMA0="1 1" starts γ ~ N(1, 1) instead of the default N(2, 0.1) (the fine-tune's best start; studies *_g1_*).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET_ARGS=("${LONG_BUDGET[@]}")
studies_begin "${1:-runs/repro_long}" 5077  # or reuse the server of a reproduction on the same OUT
read -r gmean gstd <<<"${GAMMA0:-2 0.1}"
tag=$([ "$gmean" = 2 ] && [ "$gstd" = 0.1 ] || echo "_g${gmean/./}")
for tau in ${3:-0.5 0.25}; do
  for seed in ${2:-0 1 2 3 4}; do
    study "tau${tau/./}_shared${tag}_s$seed" tau-sweep --taus "$tau" --lambdas 0.01 --seeds "$seed" \
      "model.gamma_init_mean=$gmean" "model.gamma_init_std=$gstd" model.member_batches=shared
  done
done
