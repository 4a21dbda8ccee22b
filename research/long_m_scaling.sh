#!/usr/bin/env bash
# Issue 27, part 3 (docs/results.md "M-scaling at convergence"): the paper's scaling claim at the long budget, run the
# way a user runs it: slurm/m_scaling.sh on the local two-node Slurm cluster (launch/slurm_local.sh), one study per
# lane with its MLflow parent, and the comparison job that writes the table and metric_vs_members.png.
#   bash research/long_m_scaling.sh [OUT] [LANE...]   # default OUT runs/m_scaling_long; lanes below, in this order
# Lanes (each its own study folder OUT/<lane>, seeds 0 1 2, children M-major so that a partial study pairs seeds):
#   sigma     σN-Ens at M = 1, 2, 4, 8, 16 (the recipe's τ and γ start)
#   packed2   Packed-Ensembles α = 2 at M = 2, 4, 8, 16
#   packed3   Packed-Ensembles α = 3 at M = 2, 4, 8, 16
#   batch     BatchEnsemble at M = 2, 4, 8
#   deep      the Deep Ensemble at M = 2, 4, 8
# Resumable: the same command again starts the cluster afresh and resubmits each unfinished lane; a finished child is
# skipped by its array element, an interrupted one resumes from its checkpoint. One array element at a time
# (SIGMANENS_ARRAY_LIMIT=1, one thread), every job's process group niced to 19 while it runs. Needs root (the daemons).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
source "$ROOT/launch/studies.sh"
studies_begin "${1:-runs/m_scaling_long}" 5081
shift $(($# > 0 ? 1 : 0))
read -r -a LANES <<< "${*:-sigma packed2 packed3 batch deep}"

declare -A METHOD=([sigma]=sigma [packed2]=packed [packed3]=packed [batch]=batch [deep]=deep)
declare -A MEMBERS=([sigma]="1 2 4 8 16" [packed2]="2 4 8 16" [packed3]="2 4 8 16" [batch]="2 4 8" [deep]="2 4 8")
declare -A KNOBS=([packed2]="model.packed_alpha=2" [packed3]="model.packed_alpha=3")
for lane in "${LANES[@]}"; do
  [ -n "${METHOD[$lane]:-}" ] || { echo "long_m_scaling: unknown lane $lane (sigma packed2 packed3 batch deep)" >&2; exit 2; }
done

export SLURM_LOCAL_DIR="$OUT/slurm" SLURM_LOCAL_PORT="${SLURM_LOCAL_PORT:-16917}"
export SLURM_CONF="$SLURM_LOCAL_DIR/slurm.conf"
bash launch/slurm_local.sh up "$SLURM_LOCAL_DIR"
trap 'bash launch/slurm_local.sh down "$SLURM_LOCAL_DIR"; stop_tracking' EXIT

# The cluster's daemons and jobs (slurmstepd, and every process whose command line names OUT: the trainers): a job's
# tasks run in sessions of their own, so niceness alone would not yield to interactive work; their autogroups are
# niced as well.
nice_jobs() {
  local pid
  for pid in $(pgrep -f -- "$OUT/") $(pgrep -x slurmstepd) $(pgrep -x slurmd) $(pgrep -x slurmctld); do
    renice -n 19 -p "$pid" >/dev/null 2>&1 || true
    echo 19 2>/dev/null > "/proc/$pid/autogroup" || true
  done
}

for lane in "${LANES[@]}"; do
  dir="$OUT/$lane"
  if [ -e "$dir/.finished" ]; then echo "[$(date +%T)] $lane: finished before, skipped"; continue; fi
  echo "[$(date +%T)] $lane: submitting (M = ${MEMBERS[$lane]})"
  # shellcheck disable=SC2086  # KNOBS holds zero or one override
  array=$(SIGMANENS_CONFIG="$CFG" SIGMANENS_METHODS="${METHOD[$lane]}" SIGMANENS_MEMBERS="${MEMBERS[$lane]}" \
    SIGMANENS_SEEDS="0 1 2" SIGMANENS_STUDY_DIR="$dir" SIGMANENS_EXPERIMENT="m_scaling_long" \
    SIGMANENS_ARRAY_LIMIT=1 SIGMANENS_RUNS_ROOT="$OUT" MLFLOW_TRACKING_URI="$URI" OMP_NUM_THREADS=1 \
    bash slurm/m_scaling.sh --gpus-per-node=0 --cpus-per-task=1 --time=24:00:00 --output="$dir/slurm-%A_%a.out" -- \
    "${LONG_BUDGET[@]}" ${KNOBS[$lane]:-} 2>>"$OUT/$lane.log")
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
  if [ "$left" = 0 ]; then
    touch "$dir/.finished"
    echo "[$(date +%T)] $lane: finished (array $array); table: $dir/compare/table.md"
  else
    echo "[$(date +%T)] $lane: array $array ended with $left unfinished children; see $dir/slurm-*.out"
    touch "$OUT/.failed"
  fi
done
[ ! -e "$OUT/.failed" ]
