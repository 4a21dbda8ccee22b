#!/usr/bin/env bash
# Sourced by launch/reproduce.sh and the research/ scripts that run studies: one MLflow server for a folder of studies,
# and `study`, which runs one `sigmanens study` into OUT/<name> with its log in OUT/<name>.log.
# The caller sets OUT (absolute), PORT and CFG, and BUDGET_ARGS (overrides every study gets; may be empty), or calls
# studies_begin.

# What every such script starts with: the repository root (ROOT), the venv (launch/setup.sh, which also sets -euo
# pipefail) and ROOT as the working folder.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"

# The long budget (issue 18): 6,250 steps of 32 on the 10,000 training images (~20 epochs), the full test set.
LONG_BUDGET=(train.max_steps=6250 data.test_subset=10000 schedule.warmup_steps=100 train.eval_every_steps=250
             checkpoint.every_steps=1250)

# The short fine-tune of a pretrained single model into σN-Ens (docs/results.md "Conversion"): 625 steps at a tenth of
# the learning rate; each study adds its τ, γ start and experiment. Its studies set their whole budget (BUDGET_ARGS=()).
FINETUNE_BUDGET=(data.test_subset=10000 train.max_steps=625 optim.lr=0.005 schedule.warmup_steps=20
                 train.eval_every_steps=125 checkpoint.every_steps=625 reg.lambda=0.01)

# The methods every shift study compares, at the recipe's M = 4 (`sigmanens study methods` arguments by lane name); a
# script adds its own lanes (LANE_ARGS[name]=...) and trains them with train_lanes.
declare -A LANE_ARGS=(
  [single]="--methods single"
  [sigma]="--methods sigma --members 4"
  # The Deep Ensemble: four networks (4× the parameters and the compute), the reference σN-Ens is measured against
  [deep]="--methods deep --members 4"
  # and Packed-Ensembles M=4 at α=3 (2.2× the parameters), the earlier runs' best under shift
  [packed3]="--methods packed --members 4 model.packed_alpha=3"
)

# studies_begin OUT PORT: the bench scripts' set-up: OUT created and made absolute, the small recipe, niced studies,
# the tracking server started (or reused) and stopped on exit.
studies_begin() {
  OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
  PORT="${SIGMANENS_REPRO_PORT:-$2}"
  CFG=configs/fmnist_small.yaml
  export SIGMANENS_REPRO_NICE="${SIGMANENS_REPRO_NICE:-19}"
  start_tracking
  trap stop_tracking EXIT
}

# Start a tracking server on OUT/mlflow.db unless one already answers on PORT, and register this lane as one of its
# users (OUT/.tracking_lanes: one PID per line). Several lanes (bench scripts, reproduce.sh) may share one server;
# the caller's EXIT trap should call stop_tracking, and the last lane to leave stops the server.
start_tracking() {
  URI="http://127.0.0.1:$PORT"
  export OMP_NUM_THREADS=1 MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
  exec 9>"$OUT/.tracking.lock"
  flock 9  # two lanes starting at once must not both start a server
  echo "$BASHPID" >>"$OUT/.tracking_lanes"
  if curl -sf "$URI/health" >/dev/null; then flock -u 9; return 0; fi
  python -m mlflow server --host 127.0.0.1 --port "$PORT" --workers 1 --backend-store-uri "sqlite:///$OUT/mlflow.db" \
    --artifacts-destination "$OUT/mlartifacts" >"$OUT/server.log" 2>&1 9>&- &
  local server=$!
  echo "$server" >"$OUT/server.pid"
  for _ in $(seq 120); do
    if curl -sf "$URI/health" >/dev/null; then flock -u 9; return 0; fi
    kill -0 "$server" 2>/dev/null || { echo "mlflow server failed to start: $OUT/server.log" >&2; flock -u 9; return 1; }
    sleep 1
  done
  echo "mlflow server not answering after 120 s: $OUT/server.log" >&2
  flock -u 9
  return 1
}

# Unregister this lane; when no other registered lane is alive, stop the server a lane started (OUT/server.pid; a
# server someone else started is left alone).
stop_tracking() {
  flock 9
  local pid others=()
  while read -r pid; do
    if [ "$pid" != "$BASHPID" ] && kill -0 "$pid" 2>/dev/null; then others+=("$pid"); fi
  done <"$OUT/.tracking_lanes"
  printf '%s\n' "${others[@]}" | grep . >"$OUT/.tracking_lanes" || true
  if [ "${#others[@]}" -eq 0 ] && [ -s "$OUT/server.pid" ]; then
    pid=$(cat "$OUT/server.pid")
    if grep -qa mlflow "/proc/$pid/cmdline" 2>/dev/null; then
      kill "$pid"
      while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
    fi
    rm -f "$OUT/server.pid"
  fi
  flock -u 9
}

# study NAME [--own-budget] ARGS...: a folder that already holds a study continues it as it was defined (its saved
# definition and base config; the recipe may have changed since), else the study starts with ARGS, --config CFG and
# BUDGET_ARGS (--own-budget: ARGS set the whole budget). A failure is reported and touches OUT/.failed; the lane goes on.
# With RECORDS set (a folder, e.g. in the repository), a finished study's runs are saved there as NAME.jsonl (compare's
# records file), and a study whose NAME.jsonl is there is done: runs outlive a store that is not kept.
study() {
  local name=$1 begin=$SECONDS
  shift
  local budget=("${BUDGET_ARGS[@]}")
  if [ "$1" = --own-budget ]; then budget=(); shift; fi
  if [ -n "${RECORDS:-}" ] && [ -s "$RECORDS/$name.jsonl" ]; then
    echo "[$(date +%T)] study $name: recorded before ($RECORDS/$name.jsonl), skipped"
    return 0
  fi
  if [ -e "$OUT/$name/.finished" ]; then  # a finished study stays finished: skip its ~7 s resume check
    echo "[$(date +%T)] study $name: finished before, skipped"
    [ -z "${RECORDS:-}" ] || record_study "$name"
    return 0
  fi
  local cmd=(sigmanens study "$@" --config "$CFG" --out "$OUT/$name" "tracking.uri=$URI" "${budget[@]}")
  [ -e "$OUT/$name/study.yaml" ] && cmd=(sigmanens study resume "$OUT/$name")
  echo "[$(date +%T)] study $name: ${cmd[*]}"
  if nice -n "${SIGMANENS_REPRO_NICE:-0}" "${cmd[@]}" >>"$OUT/$name.log" 2>&1; then
    touch "$OUT/$name/.finished"  # `sigmanens study` exits 0 only when every child finished
    echo "[$(date +%T)] study $name finished in $((SECONDS - begin)) s"
    [ -z "${RECORDS:-}" ] || record_study "$name"
  else  # the study's log names the failed children, and running this again retries them
    local rc=$?  # before $(date) below resets it
    echo "[$(date +%T)] study $name FAILED (exit $rc) after $((SECONDS - begin)) s: $OUT/$name.log"
    touch "$OUT/.failed"
  fi
}

# record_study NAME: compare the finished study's runs (OUT/NAME/compare) and keep its records file as RECORDS/NAME.jsonl.
record_study() {
  local name=$1 parent
  parent=$(python -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["tracking"]["parent_run_id"])' \
    "$OUT/$name/study.yaml")
  if sigmanens compare --parent "$parent" --uri "$URI" --out "$OUT/$name/compare" >>"$OUT/$name.log" 2>&1; then
    keep_records "$OUT/$name/compare/records.jsonl" "$name"
    echo "[$(date +%T)] study $name recorded: $RECORDS/$name.jsonl"
  else
    echo "[$(date +%T)] study $name: its compare failed, not recorded: $OUT/$name.log"
    touch "$OUT/.failed"
  fi
}

# keep_records FILE NAME: publish a comparison's records file as RECORDS/NAME.jsonl whole or not at all (a file there
# means "done": a half-copied one must never appear).
keep_records() {
  mkdir -p "$RECORDS"
  cp "$1" "$RECORDS/$2.jsonl.tmp" && mv "$RECORDS/$2.jsonl.tmp" "$RECORDS/$2.jsonl"
}

# train_lanes SCORED LANE...: each seed of SEED_LIST × each LANE as the study <lane>_s<seed> with LANE_ARGS[lane] (an
# associative array the caller declares, as RECORDS and OUT). SCORED NAME (a command) says whether that study was
# evaluated already: a recorded study whose checkpoint is not in OUT (a fresh clone) and which was not evaluated is
# trained again, so that its evaluation reads the checkpoint its record describes.
train_lanes() {
  local scored=$1 seed lane name
  shift
  for lane in "$@"; do
    [ -n "${LANE_ARGS[$lane]:-}" ] || { echo "unknown lane $lane (${!LANE_ARGS[*]})" >&2; return 2; }
  done
  for seed in "${SEED_LIST[@]}"; do
    for lane in "$@"; do
      name="${lane}_s$seed"
      [ -e "$OUT/$name/.finished" ] || "$scored" "$name" || rm -f "$RECORDS/$name.jsonl"
      # shellcheck disable=SC2086  # LANE_ARGS holds several words
      study "$name" methods ${LANE_ARGS[$lane]} --seeds "$seed"
    done
  done
}

# publish_eval DEST WORK LOG ARGS...: `sigmanens eval ARGS --out WORK`, niced, its output in LOG; its eval.json and
# eval.md published as DEST whole or not at all (a DEST there means "evaluated"). The exit status is eval's.
publish_eval() {
  local dest=$1 work=$2 log=$3
  shift 3
  rm -rf "$work"
  nice -n 19 sigmanens eval "$@" --out "$work" </dev/null >"$log" 2>&1 || return
  mkdir -p "$dest.tmp"
  cp "$work/eval.json" "$work/eval.md" "$dest.tmp/"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}
