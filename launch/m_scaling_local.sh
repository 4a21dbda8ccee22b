#!/usr/bin/env bash
# slurm/m_scaling.sh without Slurm: the same M-scaling study (same variables), its children one after the other on
# this machine (under torchrun with SIGMANENS_NPROC_PER_NODE > 1), then `sigmanens compare` on it.
#   SIGMANENS_MEMBERS="1 2 4" SIGMANENS_SEEDS="0 1 2" bash launch/m_scaling_local.sh [key=value overrides...]
# Variables: SIGMANENS_CONFIG (default configs/cifar100_wrn.yaml), SIGMANENS_MEMBERS (default "1 2 4 8 16"),
# SIGMANENS_SEEDS (default "0"), SIGMANENS_TAUS, SIGMANENS_METHODS (default: the recipe's), SIGMANENS_STUDY_DIR
# (default runs/m_scaling), SIGMANENS_NPROC_PER_NODE (default 1), MLFLOW_TRACKING_URI (default: sqlite in the study
# folder). Run it again to continue: finished children are skipped, interrupted ones resume.
set -euo pipefail
# shellcheck source=../slurm/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/slurm/common.sh"  # the grid's variables, as on Slurm
PY="${SIGMANENS_PYTHON:-python}"
study_dir="${SIGMANENS_STUDY_DIR:-runs/m_scaling}"
mapfile -t axes < <(sigmanens_study_axes)
args=(m-scaling --config "${SIGMANENS_CONFIG:-configs/cifar100_wrn.yaml}" --out "$study_dir" "${axes[@]}"
      --nproc "${SIGMANENS_NPROC_PER_NODE:-1}")
[ -z "${MLFLOW_TRACKING_URI:-}" ] || args+=("tracking.uri=$MLFLOW_TRACKING_URI")
rc=0
"$PY" -m sigmanens_dist.cli study "${args[@]}" "$@" || rc=$?
[ "$rc" = 2 ] && exit 2  # the grid was refused: nothing ran
read -r _ parent uri < <(sigmanens_study_info "$study_dir/study.yaml")
if [ "$parent" != "-" ]; then
  "$PY" -m sigmanens_dist.cli compare --parent "$parent" --uri "$uri" --out "$study_dir/compare" || rc=$?
fi
exit "$rc"
