# shellcheck shell=bash
# Shared by the batch scripts in slurm/ (sourced, not run): launch one torchrun agent per node, turn Slurm's warning
# signal into a checkpoint and a requeue, retry crashes a bounded number of times. See docs/slurm.md.
#
# The batch script must, as its first command, install the flag-only traps
#     trap 'SIGMANENS_GOT_USR1=1' USR1; trap 'SIGMANENS_GOT_TERM=1' TERM
# (on a requeued run the warning can arrive at once), then source this file and call
#     sigmanens_slurm_main CONFIG [key=value overrides...]
#
# Environment variables (all optional):
#   SIGMANENS_ROOT            repository checkout on the shared file system (default: the sbatch submit directory)
#   SIGMANENS_PYTHON          python with sigmanens_dist installed (default: python on PATH)
#   SIGMANENS_CONFIG          recipe, overriding the script's default
#   SIGMANENS_RUN_NAME        run name (default: the recipe's file name without .yaml)
#   SIGMANENS_RUNS_ROOT       where run directories go (default: $SIGMANENS_ROOT/runs); must be shared by all nodes
#   SIGMANENS_RUN_DIR         the exact run directory (default: $SIGMANENS_RUNS_ROOT/<name>-<job id>, array
#                             elements <name>-<array job id>_<task id>): a requeued job finds its checkpoints here
#   SIGMANENS_NPROC_PER_NODE  processes per node (default: $SLURM_GPUS_ON_NODE, else 1)
#   SIGMANENS_RDZV_PORT       rendezvous port (default: the first port from 10000 + job id mod 22000 on that nothing
#                             listens on at the head, below Linux's ephemeral range 32768-60999 where outgoing
#                             connections take ports); one given and taken fails the attempt
#   SIGMANENS_SHUTDOWN_TIMEOUT seconds torchrun waits for workers after forwarding a signal before SIGKILL
#                             (default 300; must exceed the checkpoint time the trainer logs)
#   SIGMANENS_MAX_RETRIES     requeues after failures that made no checkpoint progress (default 3)
#   MLFLOW_TRACKING_URI       tracking server (default: sqlite beside the run directories; use a server for arrays)
#   OMP_NUM_THREADS           default: cpus per task / processes per node

SIGMANENS_SIGNALS="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SIGMANENS_EXIT_PREEMPTED=75
SIGMANENS_EXIT_USAGE=2  # a mistake in the recipe or overrides: reported once, never requeued
SIGMANENS_USAGE_MARKER=usage_error.txt  # written by the trainer when it refuses the run (sigmanens_dist.train)
# What each node's task of the step runs: torchrun, noting in <run_dir>/.step_signal.<host> any signal Slurm sends the
# step (the time-limit warning, a preemption), so that one that came before the trainer could answer it (torchrun or
# Python still starting) is told from a crash. A trap is not inherited: torchrun gets the signal as before.
SIGMANENS_STEP='d=$1; shift
trap "echo SIGUSR1 > \"$d/.step_signal.$(hostname)\"" USR1
trap "echo SIGTERM > \"$d/.step_signal.$(hostname)\"" TERM
"$@" & p=$!
while :; do wait "$p"; rc=$?; kill -0 "$p" 2>/dev/null || break; done
exit "$rc"'

# The M-scaling grid from SIGMANENS_MEMBERS, SIGMANENS_SEEDS, SIGMANENS_TAUS, SIGMANENS_METHODS (space separated), and
# the micro-batch split SIGMANENS_MAX_BACKBONE_BATCH, as `sigmanens study m-scaling` arguments, one per line:
# slurm/m_scaling.sh and launch/m_scaling_local.sh share it.
sigmanens_study_axes() {
  _sm_csv() { local -a v; read -r -a v <<< "$1"; (IFS=,; echo "${v[*]}"); }
  printf '%s\n' --members "$(_sm_csv "${SIGMANENS_MEMBERS:-1 2 4 8 16}")" --seeds "$(_sm_csv "${SIGMANENS_SEEDS:-0}")"
  [ -z "${SIGMANENS_TAUS:-}" ] || printf '%s\n' --taus "$(_sm_csv "$SIGMANENS_TAUS")"
  [ -z "${SIGMANENS_METHODS:-}" ] || printf '%s\n' --methods "$(_sm_csv "$SIGMANENS_METHODS")"
  # The study turns it into each child's train.batch_size / train.grad_accum (the global batch stays the same)
  [ -z "${SIGMANENS_MAX_BACKBONE_BATCH:-}" ] || printf '%s\n' --max-backbone-batch "$SIGMANENS_MAX_BACKBONE_BATCH"
}

# "<children> <parent run id or -> <tracking URI or ->" of the study definition $1.
sigmanens_study_info() {
  "${SIGMANENS_PYTHON:-python}" -c 'import sys, yaml
d = yaml.safe_load(open(sys.argv[1]))
print(len(d["children"]), d["tracking"]["parent_run_id"] or "-", d["tracking"]["uri"] or "-")' "$1"
}

_sm_log() { echo "[sigmanens-slurm $(date +%H:%M:%S) job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}] $*"; }

# Newest checkpoint step in $1 (0 when there is none): a file step_<N>.pt (DDP) or a folder step_<N> (FSDP2,
# DeepSpeed); temporary ones start with a dot and do not match.
_sm_ckpt_step() {
  local newest
  newest="$(find "$1/checkpoints" -maxdepth 1 -regextype posix-extended -regex '.*/step_[0-9]+(\.pt)?' \
    -printf '%f\n' 2>/dev/null | sed 's/^step_//; s/\.pt$//' | sort -n | tail -n 1)"
  echo "$((10#${newest:-0}))"
}

# How many of the latest attempts in the attempts log $1 failed without checkpoint progress, back to the last one
# that progressed (or the last give-up: a run directory submitted again starts a fresh count).
_sm_failures_without_progress() {
  [ -s "$1" ] || { echo 0; return; }
  awk '{ if ($5 == "failed" && $3 == $4) n++; else n = 0 } END { print n + 0 }' "$1"
}

# Requeue after a failure unless more than $2 attempts in a row made no checkpoint progress; then exit $3.
_sm_retry_or_stop() {
  local stuck
  stuck="$(_sm_failures_without_progress "$1")"
  if [ "$stuck" -gt "$2" ]; then
    _sm_log "$4; $stuck attempts in a row without checkpoint progress (SIGMANENS_MAX_RETRIES=$2): giving up"
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID - - gave-up" >> "$1"
    # a trainer killed before it could report leaves its MLflow run RUNNING: the script knows the outcome
    "${SIGMANENS_PYTHON:-python}" -m sigmanens_dist.cli.tracking set-status "$(dirname "$1")" FAILED \
      || _sm_log "could not mark the MLflow run FAILED"
    exit "$3"
  fi
  if [ "$stuck" = 0 ]; then
    _sm_requeue "$4 (the attempt made checkpoint progress)"
  fi
  _sm_requeue "$4 ($stuck attempt(s) in a row without checkpoint progress; giving up after $(($2 + 1)))"
}

# Whether something on host $1 accepts connections on port $2.
_sm_listening() { timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null; }

# The rendezvous port on the head $1 (printed), checked from the batch step, which runs on the head: a port another
# job's rendezvous holds (two jobs whose ids agree mod 22000, or two clusters on one host) would take this job's
# agents into a rendezvous of the other job, where they wait until the time limit. SIGMANENS_RDZV_PORT is used as
# given (an error if taken); else the first free port from 10000 + job id mod 22000 on, 64 tries.
_sm_rdzv_port() {
  local port try
  if [ -n "${SIGMANENS_RDZV_PORT:-}" ]; then
    if _sm_listening "$1" "$SIGMANENS_RDZV_PORT"; then
      _sm_log "SIGMANENS_RDZV_PORT=$SIGMANENS_RDZV_PORT is taken on $1 (another job's rendezvous?)" >&2
      return 1
    fi
    echo "$SIGMANENS_RDZV_PORT"
    return 0
  fi
  for try in $(seq 0 63); do
    port=$((10000 + (SLURM_JOB_ID + try) % 22000))
    _sm_listening "$1" "$port" || { echo "$port"; return 0; }
  done
  _sm_log "no free rendezvous port on $1 from $((10000 + SLURM_JOB_ID % 22000)) on (64 tried); set SIGMANENS_RDZV_PORT" >&2
  return 1
}

# Address of the first node of the allocation: node names need not resolve, NodeAddr is what slurmd listens on.
_sm_head_addr() {
  local first addr
  first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  addr="$(scontrol show node "$first" | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2)"
  echo "${addr:-$first}"
}

_sm_requeue() {
  _sm_log "requeueing: $*"
  if scontrol requeue "$SLURM_JOB_ID"; then
    exit 0
  fi
  _sm_log "scontrol requeue $SLURM_JOB_ID failed (was the job submitted with --requeue?); exiting"
  exit "$SIGMANENS_EXIT_PREEMPTED"
}

_sm_root() { echo "${SIGMANENS_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"; }

# The trainer's own validation of the recipe $1 with the overrides after it: nothing on success, its problems (one
# line each) on stderr and status 2 otherwise. Cheap: no data, model or process group is built.
_sm_validate() {
  "${SIGMANENS_PYTHON:-python}" -m sigmanens_dist.cli train --check --config "$@" >/dev/null  # imports no torch
}

# Submit mode of a batch script run with bash instead of sbatch: `bash SCRIPT [sbatch options --] [overrides]`
# validates the recipe and overrides first and queues nothing when they are wrong (exit 2), then submits the
# script itself with sbatch and prints the job id. $1: the script, $2: its default recipe.
sigmanens_submit() {
  local script="$1" config="${SIGMANENS_CONFIG:-$2}"
  shift 2
  local sbatch_args=()
  if [[ " $* " == *" -- "* ]]; then
    while [ "$1" != "--" ]; do sbatch_args+=("$1"); shift; done
    shift
  fi
  export SIGMANENS_ROOT="${SIGMANENS_ROOT:-$(cd "$(dirname "$script")/.." && pwd)}"
  [ "${config#/}" != "$config" ] || config="$SIGMANENS_ROOT/$config"
  _sm_validate "$config" "$@" || exit "$SIGMANENS_EXIT_USAGE"
  sbatch --parsable "${sbatch_args[@]}" "$script" "$@"
}
_sm_runs_root() { echo "${SIGMANENS_RUNS_ROOT:-$(_sm_root)/runs}"; }

sigmanens_slurm_main() {
  local config="${SIGMANENS_CONFIG:-$1}"
  shift
  : "${SLURM_JOB_ID:?run this through sbatch (SLURM_JOB_ID is not set)}"
  local root
  root="$(_sm_root)"
  local python="${SIGMANENS_PYTHON:-python}"
  [ "${config#/}" != "$config" ] || config="$root/$config"
  [ -f "$config" ] || { _sm_log "SIGMANENS_CONFIG=$config: no such file"; exit 2; }
  local name="${SIGMANENS_RUN_NAME:-$(basename "$config" .yaml)}"
  local key="$SLURM_JOB_ID"
  [ -z "${SLURM_ARRAY_JOB_ID:-}" ] || key="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
  local run_dir="${SIGMANENS_RUN_DIR:-$(_sm_runs_root)/$name-$key}"
  local marker="$run_dir/preempted.json" attempts="$run_dir/slurm_attempts.log"
  local max_retries="${SIGMANENS_MAX_RETRIES:-3}"
  mkdir -p "$run_dir"

  local nproc="${SIGMANENS_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-0}}"
  [ "$nproc" -ge 1 ] 2>/dev/null || nproc=1
  local nnodes="${SLURM_NNODES:-1}" cpus="${SLURM_CPUS_PER_TASK:-1}"
  export SRUN_CPUS_PER_TASK="$cpus"  # 22.05's srun does not inherit the job's --cpus-per-task
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((cpus / nproc > 0 ? cpus / nproc : 1))}"
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # a dead peer ends the job
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export PYTHONUNBUFFERED=1
  local head port
  head="$(_sm_head_addr)"
  local start_step
  start_step="$(_sm_ckpt_step "$run_dir")"
  if ! port="$(_sm_rdzv_port "$head")"; then
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $start_step failed" >> "$attempts"
    _sm_retry_or_stop "$attempts" "$max_retries" 1 "no rendezvous port on $head"
  fi
  _sm_log "run_dir=$run_dir nodes=$nnodes (${SLURM_JOB_NODELIST:-?}) nproc_per_node=$nproc head=$head:$port resume_from_step=$start_step"

  if [ -n "${SIGMANENS_GOT_USR1:-}" ]; then  # the warning came before training started: no time left to train
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $start_step signalled-before-start" >> "$attempts"
    _sm_retry_or_stop "$attempts" "$max_retries" "$SIGMANENS_EXIT_PREEMPTED" "SIGUSR1 arrived before training started"
  fi
  rm -f "$marker" "$run_dir/$SIGMANENS_USAGE_MARKER" "$run_dir"/.step_signal.*  # only this attempt may write them
  # A mistake in the recipe or the overrides fails here, once, in one line: retrying cannot fix it.
  if ! _sm_validate "$config" "run_dir=$run_dir" "$@"; then
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $start_step usage-error" >> "$attempts"
    _sm_log "the recipe $config or its overrides are invalid (above): not starting, not requeueing"
    exit "$SIGMANENS_EXIT_USAGE"
  fi

  # srun in its own session: a signal to the batch step's process group must not reach it, so each signal reaches
  # torchrun exactly once (a second one makes torchrun abandon workers that are still checkpointing).
  setsid srun --ntasks="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=0 \
    bash -c "$SIGMANENS_STEP" _ "$run_dir" "$python" -m torch.distributed.run --nnodes="$nnodes" --nproc-per-node="$nproc" \
    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" --max-restarts=0 \
    --signals-to-handle="$SIGMANENS_SIGNALS" --shutdown-timeout="${SIGMANENS_SHUTDOWN_TIMEOUT:-300}" \
    -m sigmanens_dist.train --config "$config" --resume auto "run_dir=$run_dir" "$@" &
  local srun_pid=$! forwarded="" rc
  # bash runs a trap only between commands, and `wait` returns early (status > 128) when one fires: loop.
  while :; do
    if [ -n "${SIGMANENS_GOT_USR1:-}" ] && [ -z "$forwarded" ]; then
      _sm_log "SIGUSR1: asking the trainer to checkpoint and stop"
      kill -USR1 "$srun_pid" 2>/dev/null || true  # srun forwards it to torchrun on every node
      forwarded=1
    fi
    wait "$srun_pid"
    rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break
  done
  local end_step
  end_step="$(_sm_ckpt_step "$run_dir")"
  _sm_log "srun exited with status $rc; checkpoint step $start_step -> $end_step"

  # A signal that reached the step before the trainer could answer it (torchrun or Python starting; the task itself
  # ends as 128 + its number): nothing was trained since the last checkpoint, so it is a preemption, not a crash.
  if [ ! -s "$marker" ] && [ ! -s "$run_dir/final_metrics.json" ]; then
    local sig
    sig="$(cat "$run_dir"/.step_signal.* 2>/dev/null | head -n 1)"
    [ -n "$sig" ] || case "$rc" in 138) sig=SIGUSR1 ;; 143) sig=SIGTERM ;; esac
    [ -z "$sig" ] || echo "{\"step\": null, \"signal\": \"$sig\", \"when\": \"before the trainer could answer\"}" \
      > "$marker"
  fi
  if [ -s "$marker" ]; then
    _sm_log "trainer checkpointed after a signal: $(cat "$marker")"
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $end_step preempted" >> "$attempts"
    if [ -n "${SIGMANENS_GOT_TERM:-}" ] || grep -q '"SIGTERM"' "$marker"; then
      # SIGTERM: a user's scancel (no requeue) or Slurm's own preemption (Slurm requeues by itself).
      _sm_log "stopped by SIGTERM: not requeueing"
      exit "$SIGMANENS_EXIT_PREEMPTED"
    fi
    _sm_requeue "the time-limit/preemption warning was answered with a checkpoint at step $end_step"
  fi
  if [ -s "$run_dir/$SIGMANENS_USAGE_MARKER" ]; then
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $end_step usage-error" >> "$attempts"
    _sm_log "the trainer refused the run (not requeueing): $(head -c 2000 "$run_dir/$SIGMANENS_USAGE_MARKER")"
    exit "$SIGMANENS_EXIT_USAGE"
  fi
  if [ "$rc" = 0 ] || [ -s "$run_dir/final_metrics.json" ]; then
    echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $end_step finished" >> "$attempts"
    _sm_log "training finished"
    exit 0
  fi
  echo "${SLURM_RESTART_COUNT:-0} $SLURM_JOB_ID $start_step $end_step failed" >> "$attempts"
  if [ -n "${SIGMANENS_GOT_TERM:-}" ]; then
    _sm_log "failed after SIGTERM: not requeueing"
    exit "$rc"
  fi
  _sm_retry_or_stop "$attempts" "$max_retries" "$rc" "training failed with status $rc"
}
