#!/usr/bin/env bash
# M-scaling as a `sigmanens study` on Slurm: one MLflow parent run, one array element per grid point (ensemble size M
# × seed), each preemptible and requeueable like slurm/cifar100_wrn.sh, and a comparison job that runs
# `sigmanens compare` on the parent when the array has ended (afterany: also after failures, listing them).
#   bash slurm/m_scaling.sh [sbatch options --] [key=value overrides...]
#   SIGMANENS_MEMBERS="1 2 4" SIGMANENS_SEEDS="0 1 2" bash slurm/m_scaling.sh --time=4:00:00 -- reg.tau=0.25
# Run with bash (not sbatch): it writes the study definition and opens the parent run once (`sigmanens study
# m-scaling --prepare`), then submits the array over the definition's children and the comparison job, and prints
# the array job id. The same command again reuses the study folder: finished children are skipped, interrupted ones
# resume from their checkpoints (a different grid in the same folder is refused).
# Arguments are config overrides for every child. Child i trains in <study folder>/<child name> (e.g.
# sigma-M4-tau0.5-lam0-s0) and logs its own MLflow run of that name, nested under the parent.
#
# Environment variables: those of slurm/imagenet_vit.sh (SIGMANENS_CONFIG defaults to configs/cifar100_wrn.yaml),
# plus
#   SIGMANENS_MEMBERS         the ensemble sizes, space separated (default "1 2 4 8 16")
#   SIGMANENS_SEEDS           seeds, space separated (default "0"); the same seed pairs runs across M
#   SIGMANENS_TAUS            τ values, space separated (default: the recipe's τ only)
#   SIGMANENS_METHODS         methods, space separated, e.g. "sigma deep packed" (default: the recipe's method)
#   SIGMANENS_EXPERIMENT      MLflow experiment (default m_scaling)
#   SIGMANENS_STUDY_DIR       the study folder (default <runs root>/m_scaling)
#   SIGMANENS_ARRAY_LIMIT     at most this many array elements run at once (sbatch --array=…%N; default: no limit)
#   SIGMANENS_MAX_BACKBONE_BATCH  most images (batch × M) in one backbone pass (`sigmanens study
#                             --max-backbone-batch`): a child above it gets a smaller train.batch_size and more
#                             train.grad_accum steps, the same global batch (default: no split; values in docs/slurm.md)
#   MLFLOW_TRACKING_URI       set it to an MLflow server: array elements write at the same time, and one sqlite file
#                             on a shared file system is unsafe under concurrent writers (the script warns)
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
python="${SIGMANENS_PYTHON:-python}"

if [ -z "${SLURM_JOB_ID:-}" ]; then  # submit mode: the study definition and parent run once, then the jobs
  sbatch_args=()
  if [[ " $* " == *" -- "* ]]; then
    while [ "$1" != "--" ]; do sbatch_args+=("$1"); shift; done
    shift
  fi
  split="${SIGMANENS_MAX_BACKBONE_BATCH:-}"
  if [ -n "$split" ] && ! [[ "$split" =~ ^[1-9][0-9]*$ ]]; then
    echo "m_scaling: SIGMANENS_MAX_BACKBONE_BATCH=$split: give a whole number ≥ 1 (images per backbone pass)" >&2
    exit 2
  fi
  export SIGMANENS_ROOT="${SIGMANENS_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
  runs_root="$(realpath -m "$(_sm_runs_root)")"
  study_dir="$(realpath -m "${SIGMANENS_STUDY_DIR:-$runs_root/m_scaling}")"
  mkdir -p "$runs_root"
  uri="${MLFLOW_TRACKING_URI:-sqlite:///$runs_root/mlflow.db}"
  config="${SIGMANENS_CONFIG:-configs/cifar100_wrn.yaml}"
  [ "${config#/}" != "$config" ] || config="$SIGMANENS_ROOT/$config"
  mapfile -t axes < <(sigmanens_study_axes)
  # The trainers run under torchrun here, not under the study's own launcher: its --nproc stays 1.
  "$python" -m sigmanens_dist.cli study m-scaling --config "$config" "${axes[@]}" --out "$study_dir" --prepare \
    "tracking.uri=$uri" "tracking.experiment=${SIGMANENS_EXPERIMENT:-m_scaling}" "$@" >&2 || exit 2
  read -r count parent _ < <(sigmanens_study_info "$study_dir/study.yaml") || exit 2
  limit="${SIGMANENS_ARRAY_LIMIT:-}"
  if [ -n "$limit" ] && ! [[ "$limit" =~ ^[1-9][0-9]*$ ]]; then
    echo "m_scaling: SIGMANENS_ARRAY_LIMIT=$limit: give a whole number ≥ 1 (array elements at once)" >&2
    exit 2
  fi
  array=$(sbatch --parsable --array="0-$((count - 1))${limit:+%$limit}" --export="ALL,SIGMANENS_DEFINITION=$study_dir/study.yaml" \
    "${sbatch_args[@]}" "${BASH_SOURCE[0]}") || exit 1
  array="${array%%;*}"
  echo "m_scaling: array job $array submitted" >&2  # before anything else can fail
  # The user's accounting options (a cluster may require an account) reach the comparison job too; its shape
  # (one CPU, 20 minutes, no GPU request) is its own.
  account_args=()
  for ((i = 0; i < ${#sbatch_args[@]}; i++)); do
    case "${sbatch_args[i]}" in
      --account=*|--partition=*|--qos=*|--nice=*|--reservation=*|--clusters=*|--wckey=*|--comment=*|--mail-*)
        account_args+=("${sbatch_args[i]}") ;;
      -A|-p|-q|-M|--account|--partition|--qos|--reservation|--clusters|--wckey|--comment)
        account_args+=("${sbatch_args[i]}" "${sbatch_args[i + 1]}"); ((i++)) ;;
      --nice) account_args+=("--nice") ;;
    esac
  done
  if [ "$parent" != - ]; then
    compare=$(sbatch --parsable --dependency="afterany:$array" --job-name=sigmanens-m-scaling-compare \
      "${account_args[@]}" --output="$study_dir/slurm-compare-%j.out" --ntasks=1 --cpus-per-task=1 --time=20 \
      --wrap="$(printf '%q ' "$python" -m sigmanens_dist.cli compare --parent "$parent" --uri "$uri" \
        --out "$study_dir/compare")") || exit 1
    echo "m_scaling: study $study_dir ($count children), array job $array, comparison job $compare (afterany)" >&2
  fi
  echo "$array"
  exit 0
fi

definition="${SIGMANENS_DEFINITION:?submit with bash slurm/m_scaling.sh (it sets SIGMANENS_DEFINITION)}"
task="${SLURM_ARRAY_TASK_ID:?submit with bash slurm/m_scaling.sh: this is an array element}"
mapfile -t args < <("$python" -m sigmanens_dist.cli study run-one --definition "$definition" --index "$task" --print-args)
if [ "${#args[@]}" -lt 2 ] || [ "${args[0]}" != "--config" ]; then
  _sm_log "no trainer arguments for element $task of $definition"
  exit 2
fi
config="${args[1]}"  # the study's copy of the recipe: editing the original later does not change the study
overrides=("${args[@]:2}")
unset SIGMANENS_CONFIG
uri=""
for kv in "${overrides[@]}"; do  # the last tracking.uri wins, as in the trainer (the study may repeat it)
  case "$kv" in
    run_dir=*) export SIGMANENS_RUN_DIR="${kv#run_dir=}" ;;
    tracking.uri=*) uri="${kv#tracking.uri=}" ;;
  esac
done
if [[ "$uri" == sqlite* ]]; then
  _sm_log "warning: MLflow writes to a sqlite file; array elements running at once may corrupt or lock it on a" \
          "shared file system: export MLFLOW_TRACKING_URI=<an MLflow server> for studies"
fi
if [ -s "${SIGMANENS_RUN_DIR:?}/final_metrics.json" ]; then
  _sm_log "$SIGMANENS_RUN_DIR has finished already: skipped"
  exit 0
fi
sigmanens_slurm_main "$config" "${overrides[@]}"
