#!/usr/bin/env bash
# Issue 21 at the long budget (docs/results.md "Long budget"): the baselines as their authors train them, beside the runs of
# `launch/reproduce.sh OUT long` (same OUT, same MLflow store, so `sigmanens compare` pairs them by seed with the
# single model). Resumable: run it again and finished children are skipped, interrupted ones resume.
#   bash research/long_baselines.sh [OUT]        # OUT defaults to runs/repro_long; one process, niced
# (1) Packed-Ensembles at M = 8 (α = 2) and at the paper's wider α = 3 (M = 4, 8): where it collapses, with its
#     parameter count; (2) BatchEnsemble with the authors' fast-weight rate (edward2's ResNet-32x4 recipe: 0.5).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET_ARGS=("${LONG_BUDGET[@]}")
studies_begin "${1:-runs/repro_long}" 5077  # or reuse the server of a reproduction on the same OUT

for seed in 0 1 2; do  # the authors' fast-weight rate first: BatchEnsemble is the slowest of these runs
  study "batch_fastlr05_s$seed" methods --methods batch --members 4 --seeds "$seed" optim.fast_weight_lr_scale=0.5
  study "packed_m8_s$seed" methods --methods packed --members 8 --seeds "$seed"
  study "packed_a3_s$seed" methods --methods packed --members 4,8 --seeds "$seed" model.packed_alpha=3
done
