#!/usr/bin/env bash
# The Slurm scripts' training without Slurm: one machine, torchrun --standalone, the same recipe and overrides.
#   bash launch/train_local.sh [key=value overrides...]
#   SIGMANENS_CONFIG=configs/imagenet_vit.yaml SIGMANENS_NPROC_PER_NODE=8 bash launch/train_local.sh data.root=/data
# Environment variables (as in slurm/common.sh): SIGMANENS_CONFIG (default configs/cifar100_wrn.yaml),
# SIGMANENS_NPROC_PER_NODE (default: the GPUs torch sees, else 1), SIGMANENS_RUN_DIR (default runs/<recipe name>),
# OMP_NUM_THREADS (default: cores / processes). Resumes the run directory's newest checkpoint (--resume auto); a
# signal (SIGUSR1/SIGTERM) to torchrun reaches the workers, which checkpoint and exit 75.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SIGMANENS_PYTHON:-python}"
config="${SIGMANENS_CONFIG:-configs/cifar100_wrn.yaml}"
[ "${config#/}" != "$config" ] || [ -f "$config" ] || config="$ROOT/$config"
procs="${SIGMANENS_NPROC_PER_NODE:-$("$PY" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}"
cores="$(nproc)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / procs > 0 ? cores / procs : 1 ))}"
run_dir="${SIGMANENS_RUN_DIR:-runs/$(basename "$config" .yaml)}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node="$procs" \
  --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
  -m sigmanens_dist.train --config "$config" --resume auto "run_dir=$run_dir" "$@"
