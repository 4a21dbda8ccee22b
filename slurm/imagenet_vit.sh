#!/usr/bin/env bash
# σN-Ens ViT on ImageNet, multi-node: one torchrun agent per node, one process per GPU, checkpoint + requeue on
# Slurm's time-limit/preemption warning. Submit from the repository checkout (on a file system all nodes share):
#   bash slurm/imagenet_vit.sh [sbatch options --] [key=value overrides...]   validates, then submits (prints the job id)
#   sbatch slurm/imagenet_vit.sh [key=value overrides...]                     also works; a bad config fails the job once
#   sbatch --nodes=4 --time=12:00:00 slurm/imagenet_vit.sh data.root=/data/imagenet_ffcv model.num_members=8
# Command-line sbatch options override the #SBATCH lines below. Arguments are config overrides for the trainer
# (python -m sigmanens_dist.train), e.g. strategy.name=fsdp, train.batch_size=64, tracking.experiment=vit.
#
# Environment variables (export before sbatch; all optional; details in docs/slurm.md):
#   SIGMANENS_CONFIG          recipe (default configs/imagenet_vit.yaml; the data path is data.root in it or an
#                             override)
#   SIGMANENS_ROOT            repository checkout (default: the directory you ran sbatch in)
#   SIGMANENS_PYTHON          python with sigmanens_dist installed (default: python on PATH)
#   SIGMANENS_RUNS_ROOT       parent of run directories (default $SIGMANENS_ROOT/runs); SIGMANENS_RUN_DIR exact one
#   SIGMANENS_RUN_NAME        run name (default imagenet_vit); the run directory is <runs root>/<name>-<job id>
#   SIGMANENS_NPROC_PER_NODE  processes per node (default: the GPUs Slurm gave the node, else 1)
#   SIGMANENS_SHUTDOWN_TIMEOUT  seconds to wait for a checkpoint after a signal (default 300)
#   SIGMANENS_MAX_RETRIES     requeues after crashes without checkpoint progress (default 3)
#   MLFLOW_TRACKING_URI       MLflow server (default sqlite:///<runs root>/mlflow.db)
# The warning margin (--signal=B:USR1@300 below) must cover Slurm's signal resolution (up to 60 s) + the
# trainer's check interval (one step) + the checkpoint time + the MLflow flush; see docs/slurm.md.
#SBATCH --job-name=sigmanens-imagenet-vit
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

# First thing: on a requeued run the warning can arrive at once. The handlers only record the signal.
trap 'SIGMANENS_GOT_USR1=1' USR1
trap 'SIGMANENS_GOT_TERM=1' TERM
set -uo pipefail
# shellcheck source=common.sh
source "${SIGMANENS_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/slurm/common.sh" \
  || exit 2
if [ -z "${SLURM_JOB_ID:-}" ]; then  # run with bash: validate, then queue this script (nothing queued if invalid)
  sigmanens_submit "${BASH_SOURCE[0]}" configs/imagenet_vit.yaml "$@"
  exit $?
fi
sigmanens_slurm_main configs/imagenet_vit.yaml "$@"
