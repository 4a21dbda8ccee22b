#!/usr/bin/env bash
# M-scaling: one σN-Ens training per ensemble size M, as a Slurm job array (element i trains M = the i-th entry of
# SIGMANENS_MEMBERS), each element preemptible and requeueable like slurm/cifar100_wrn.sh.
#   bash slurm/m_scaling.sh [sbatch options --] [key=value overrides...]     # recommended
#   SIGMANENS_MEMBERS="1 2 4" bash slurm/m_scaling.sh --time=4:00:00 -- reg.tau=0.25
# Run with bash (not sbatch), it creates the MLflow store and the experiment once, then submits itself as an array
# with --array=0-<number of sizes - 1> (array elements creating one store at the same time race each other).
# `sbatch --array=0-4 slurm/m_scaling.sh …` also works, but leaves the store to the elements.
# Arguments are config overrides for every element. Element i writes <runs root>/<name>-M<M>-<array job id>_<i> and
# its own MLflow run (run name <name>-M<M>) in experiment $SIGMANENS_EXPERIMENT.
#
# Environment variables: those of slurm/imagenet_vit.sh (SIGMANENS_CONFIG defaults to configs/cifar100_wrn.yaml,
# SIGMANENS_RUN_NAME to m_scaling), plus
#   SIGMANENS_MEMBERS         the ensemble sizes, space separated (default "1 2 4 8 16")
#   SIGMANENS_EXPERIMENT      MLflow experiment (default m_scaling)
#   MLFLOW_TRACKING_URI       set it to an MLflow server: array elements write at the same time, and one sqlite file
#                             on a shared file system is unsafe under concurrent writers (the script warns)
# This is a plain array over M calling the trainer: no parent MLflow run and no comparison job (yet).
#SBATCH --job-name=sigmanens-m-scaling
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%A_%a.out

# First thing: on a requeued run the warning can arrive at once. The handlers only record the signal.
trap 'SIGMANENS_GOT_USR1=1' USR1
trap 'SIGMANENS_GOT_TERM=1' TERM
set -uo pipefail
# shellcheck source=common.sh
source "${SIGMANENS_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}/slurm/common.sh" \
  || exit 2

read -r -a members <<< "${SIGMANENS_MEMBERS:-1 2 4 8 16}"
experiment="${SIGMANENS_EXPERIMENT:-m_scaling}"

if [ -z "${SLURM_JOB_ID:-}" ]; then  # submit mode: create the store and experiment once, then the array
  sbatch_args=()
  if [[ " $* " == *" -- "* ]]; then
    while [ "$1" != "--" ]; do sbatch_args+=("$1"); shift; done
    shift
  fi
  export SIGMANENS_ROOT="${SIGMANENS_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
  runs_root="$(realpath -m "$(_sm_runs_root)")"
  mkdir -p "$runs_root"
  uri="${MLFLOW_TRACKING_URI:-sqlite:///$runs_root/mlflow.db}"
  if ! "${SIGMANENS_PYTHON:-python}" -c 'import sys, mlflow; mlflow.set_tracking_uri(sys.argv[1])
mlflow.set_experiment(sys.argv[2])' "$uri" "$experiment"; then
    echo "m_scaling: cannot create MLflow experiment $experiment at $uri" >&2
    exit 1
  fi
  echo "m_scaling: MLflow experiment '$experiment' ready at $uri; submitting M = ${members[*]}" >&2
  exec sbatch --parsable --array="0-$((${#members[@]} - 1))" "${sbatch_args[@]}" "${BASH_SOURCE[0]}" "$@"
fi

task="${SLURM_ARRAY_TASK_ID:?submit this as an array: bash slurm/m_scaling.sh, or sbatch --array=0-$((${#members[@]} - 1))}"
if [ "$task" -ge "${#members[@]}" ]; then
  _sm_log "array index $task has no entry in SIGMANENS_MEMBERS=(${members[*]}); use --array=0-$((${#members[@]} - 1))"
  exit 2
fi
m="${members[$task]}"
case "${MLFLOW_TRACKING_URI:-sqlite}" in
  sqlite*) _sm_log "warning: MLflow writes to a sqlite file; array elements running at once may corrupt or lock" \
                   "it on a shared file system: export MLFLOW_TRACKING_URI=<an MLflow server> for studies" ;;
esac
export SIGMANENS_RUN_NAME="${SIGMANENS_RUN_NAME:-m_scaling}-M$m"
sigmanens_slurm_main configs/cifar100_wrn.yaml "tracking.experiment=$experiment" "model.num_members=$m" \
  "tracking.run_name=$SIGMANENS_RUN_NAME" "$@"
