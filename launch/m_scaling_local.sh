#!/usr/bin/env bash
# slurm/m_scaling.sh without Slurm: the same M-scaling study (same variables), its children one after the other on
# this machine (under torchrun with SIGMANENS_NPROC_PER_NODE > 1), then `sigmanens compare` on it.
#   SIGMANENS_MEMBERS="1 2 4" SIGMANENS_SEEDS="0 1 2" bash launch/m_scaling_local.sh [key=value overrides...]
# Variables: SIGMANENS_CONFIG (default configs/cifar100_wrn.yaml), SIGMANENS_MEMBERS (default "1 2 4 8 16"),
# SIGMANENS_SEEDS (default "0"), SIGMANENS_TAUS, SIGMANENS_METHODS (default: the recipe's), SIGMANENS_STUDY_DIR
# (default runs/m_scaling), SIGMANENS_NPROC_PER_NODE (default 1), MLFLOW_TRACKING_URI (default: sqlite in the study
# folder). Run it again to continue: finished children are skipped, interrupted ones resume.
set -euo pipefail
PY="${SIGMANENS_PYTHON:-python}"
study_dir="${SIGMANENS_STUDY_DIR:-runs/m_scaling}"
args=(m-scaling --config "${SIGMANENS_CONFIG:-configs/cifar100_wrn.yaml}" --out "$study_dir"
      --members "$(echo ${SIGMANENS_MEMBERS:-1 2 4 8 16} | tr ' ' ,)" --seeds "$(echo ${SIGMANENS_SEEDS:-0} | tr ' ' ,)"
      --nproc "${SIGMANENS_NPROC_PER_NODE:-1}")
[ -z "${SIGMANENS_TAUS:-}" ] || args+=(--taus "$(echo $SIGMANENS_TAUS | tr ' ' ,)")
[ -z "${SIGMANENS_METHODS:-}" ] || args+=(--methods "$(echo $SIGMANENS_METHODS | tr ' ' ,)")
[ -z "${MLFLOW_TRACKING_URI:-}" ] || args+=("tracking.uri=$MLFLOW_TRACKING_URI")
rc=0
"$PY" -m sigmanens_dist.study "${args[@]}" "$@" || rc=$?
[ "$rc" = 2 ] && exit 2  # the grid was refused: nothing ran
read -r parent uri < <("$PY" -c 'import sys, yaml
t = yaml.safe_load(open(sys.argv[1]))["tracking"]
print(t["parent_run_id"] or "-", t["uri"] or "-")' "$study_dir/study.yaml")
if [ "$parent" != "-" ]; then
  "$PY" -m sigmanens_dist.compare --parent "$parent" --uri "$uri" --out "$study_dir/compare" || rc=$?
fi
exit "$rc"
