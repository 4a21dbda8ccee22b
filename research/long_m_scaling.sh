#!/usr/bin/env bash
# Issue 27, part 3 (docs/results.md "M-scaling at convergence"): the paper's scaling claim at the long budget, run the
# way a user runs it: slurm/m_scaling.sh on the local two-node Slurm cluster (launch/slurm_local.sh), each study with
# its MLflow parent and the comparison job that writes its table, metric_vs_members.png and records.jsonl.
#   bash research/long_m_scaling.sh [OUT] [LANE...]   # default OUT runs/m_scaling_long; lanes below
# Lanes (method and the ensemble sizes it is measured at):
#   sigma     σN-Ens at M = 1, 2, 4, 8, 16 (the recipe's τ and γ start)
#   packed2   Packed-Ensembles α = 2 at M = 2, 4, 8, 16
#   packed3   Packed-Ensembles α = 3 at M = 2, 4, 8, 16
#   batch     BatchEnsemble at M = 2, 4, 8
#   deep      the Deep Ensemble at M = 2, 4, 8
# The work is cut into units, one study per lane, M and seed (OUT/<lane>-M<m>-s<seed>), seed-major (seeds 0 1 2) and
# M ascending, so that what has finished already pairs whole seeds. A finished unit's runs are kept as
# RECORDS/<unit>.jsonl (default results/m_scaling_long/records: the work outlives a machine that is not kept) and
# a recorded unit is not run again; the table over all of them:
#   sigmanens compare --records results/m_scaling_long/records/*.jsonl --reference sigma --out runs/m_scaling_long/all
# Resumable: the same command again starts the cluster afresh; an interrupted unit resumes from its checkpoint when
# OUT is still there. One array element at a time (SIGMANENS_ARRAY_LIMIT=1, one thread), every job's process group
# niced to 19 while it runs. Needs root (the daemons).
# MEMBERS (default "1 2 4 8 16") keeps only those ensemble sizes, e.g. MEMBERS="8 16" for the claim's end first.
# Two cores, two drivers: SEEDS (default "0 1 2") picks the seeds a driver runs; give each driver its own OUT,
# SIGMANENS_REPRO_PORT (MLflow) and SLURM_LOCAL_PORT (its cluster), e.g.
#   SEEDS=1 SIGMANENS_REPRO_PORT=5082 SLURM_LOCAL_PORT=16927 bash research/long_m_scaling.sh runs/m_scaling_long_b sigma
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
out_arg="${1:-runs/m_scaling_long}"
shift $(($# > 0 ? 1 : 0))
read -r -a LANES <<< "${*:-sigma packed2 packed3 batch deep}"

declare -A METHOD=([sigma]=sigma [packed2]=packed [packed3]=packed [batch]=batch [deep]=deep)
declare -A LANE_MEMBERS=([sigma]="1 2 4 8 16" [packed2]="2 4 8 16" [packed3]="2 4 8 16" [batch]="2 4 8" [deep]="2 4 8")
declare -A KNOBS=([packed2]="model.packed_alpha=2" [packed3]="model.packed_alpha=3")
for lane in "${LANES[@]}"; do
  [ -n "${METHOD[$lane]:-}" ] || { echo "long_m_scaling: unknown lane $lane (sigma packed2 packed3 batch deep)" >&2; exit 2; }
done
read -r -a SEED_LIST <<< "${SEEDS:-0 1 2}"
for seed in "${SEED_LIST[@]}"; do
  [[ $seed =~ ^[0-9]+$ ]] || { echo "long_m_scaling: SEEDS holds '$seed'; seeds are non-negative integers, e.g. SEEDS=\"0 1\"" >&2; exit 2; }
done
read -r -a M_LIST <<< "${MEMBERS:-1 2 4 8 16}"
for m in "${M_LIST[@]}"; do
  [[ " 1 2 4 8 16 " == *" $m "* ]] || { echo "long_m_scaling: MEMBERS holds '$m'; the grid's sizes are 1 2 4 8 16" >&2; exit 2; }
done
studies_begin "$out_arg" 5081

export SLURM_LOCAL_DIR="$OUT/slurm" SLURM_LOCAL_PORT="${SLURM_LOCAL_PORT:-16917}"
export SLURM_CONF="$SLURM_LOCAL_DIR/slurm.conf"
bash launch/slurm_local.sh up "$SLURM_LOCAL_DIR"
trap 'bash launch/slurm_local.sh down "$SLURM_LOCAL_DIR"; stop_tracking' EXIT

# This cluster's daemons and jobs (every process whose command line names OUT: slurmctld and slurmd by their
# slurm.conf, the trainers by their run folder; never another cluster's, e.g. the test suite's): a job's tasks run in
# sessions of their own, so niceness alone would not yield to interactive work; their autogroups are niced as well.
nice_jobs() {
  local pid
  for pid in $(pgrep -f -- "$OUT/"); do
    renice -n 19 -p "$pid" >/dev/null 2>&1 || true
    echo 19 2>/dev/null > "/proc/$pid/autogroup" || true
  done
}

RECORDS="${RECORDS:-$ROOT/results/m_scaling_long/records}"
for seed in "${SEED_LIST[@]}"; do
  for m in "${M_LIST[@]}"; do
    for lane in "${LANES[@]}"; do
      [[ " ${LANE_MEMBERS[$lane]} " == *" $m "* ]] || continue
      unit="$lane-M$m-s$seed" dir="$OUT/$lane-M$m-s$seed"
      if [ -s "$RECORDS/$unit.jsonl" ]; then echo "[$(date +%T)] $unit: recorded before, skipped"; continue; fi
      echo "[$(date +%T)] $unit: submitting"
      # shellcheck disable=SC2086  # KNOBS holds zero or one override
      array=$(SIGMANENS_CONFIG="$CFG" SIGMANENS_METHODS="${METHOD[$lane]}" SIGMANENS_MEMBERS="$m" \
        SIGMANENS_SEEDS="$seed" SIGMANENS_STUDY_DIR="$dir" SIGMANENS_EXPERIMENT="m_scaling_long" \
        SIGMANENS_ARRAY_LIMIT=1 SIGMANENS_RUNS_ROOT="$OUT" MLFLOW_TRACKING_URI="$URI" OMP_NUM_THREADS=1 \
        bash slurm/m_scaling.sh --gpus-per-node=0 --cpus-per-task=1 --time=24:00:00 --output="$dir/slurm-%A_%a.out" \
        -- "${LONG_BUDGET[@]}" ${KNOBS[$lane]:-} 2>>"$OUT/$unit.log")
      while squeue -h -o %i | grep -q .; do  # the array, then its comparison job
        nice_jobs
        sleep 30
      done
      left=$(python - "$dir/study.yaml" <<'PY'
import pathlib, sys, yaml
d = yaml.safe_load(open(sys.argv[1]))
print(sum(not (pathlib.Path(d["out"]) / c["name"] / "final_metrics.json").exists() for c in d["children"]))
PY
)
      if [ "$left" = 0 ] && [ -s "$dir/compare/records.jsonl" ]; then
        keep_records "$dir/compare/records.jsonl" "$unit"
        echo "[$(date +%T)] $unit: finished (array $array), recorded: $RECORDS/$unit.jsonl"
      else
        echo "[$(date +%T)] $unit: array $array ended unfinished or without a table; see $dir/slurm-*.out, $OUT/$unit.log"
        touch "$OUT/.failed"
      fi
    done
  done
done
[ ! -e "$OUT/.failed" ]
