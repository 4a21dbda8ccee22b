#!/usr/bin/env bash
# σN-Ens wide ResNet on CIFAR-100 on one node (one process per GPU), checkpoint + requeue on Slurm's warning.
#   bash slurm/cifar100_wrn.sh [sbatch options --] [key=value overrides...]   validates, then submits (prints the job id)
#   sbatch slurm/cifar100_wrn.sh [key=value overrides...]                     also works; a bad config fails the job once
#   sbatch --gpus-per-node=1 slurm/cifar100_wrn.sh data.root=/data/cifar100 model.num_members=8
# Arguments are config overrides for the trainer. Environment variables are those of slurm/imagenet_vit.sh
# (SIGMANENS_CONFIG defaults to configs/cifar100_wrn.yaml here); see docs/slurm.md.
#SBATCH --job-name=sigmanens-cifar100-wrn
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=B:USR1@180
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
  sigmanens_submit "${BASH_SOURCE[0]}" configs/cifar100_wrn.yaml "$@"
  exit $?
fi
sigmanens_slurm_main configs/cifar100_wrn.yaml "$@"
