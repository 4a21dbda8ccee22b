#!/usr/bin/env bash
# The README's reproduction of the paper's claims at CPU scale (README "Reproduction"; docs/studies.md): six
# studies on configs/fmnist_small.yaml, 3 paired seeds each, in two lanes of one process each, tracked by one local
# MLflow server, then `sigmanens compare` at equal epochs and at equal training compute.
#   bash launch/reproduce.sh [OUT]        # OUT defaults to runs/repro; run it again to continue where it stopped
# The tables, plots and per-run CSVs go to OUT/compare{,_compute,_vs_deep}/ (the README's copies: results/repro/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/setup.sh"
cd "$ROOT"
OUT="$(mkdir -p "${1:-runs/repro}" && cd "${1:-runs/repro}" && pwd)"
PORT="${SIGMANENS_REPRO_PORT:-5055}"
CFG=configs/fmnist_small.yaml
URI="http://127.0.0.1:$PORT"
export OMP_NUM_THREADS=1 MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false

# One tracking server for both lanes (two processes writing one sqlite file directly would lock it).
python -m mlflow server --host 127.0.0.1 --port "$PORT" --workers 1 --backend-store-uri "sqlite:///$OUT/mlflow.db" \
  --artifacts-destination "$OUT/mlartifacts" >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "$URI/health" >/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "mlflow server failed to start: $OUT/server.log" >&2; exit 1; }
  sleep 1
done

study() {  # name, then the study's arguments; logs to OUT/<name>.log with its wall-clock time
  local name=$1 begin=$SECONDS
  shift
  echo "[$(date +%T)] study $name: sigmanens study $*"
  if sigmanens study "$@" --config "$CFG" --out "$OUT/$name" "tracking.uri=$URI" >"$OUT/$name.log" 2>&1; then
    echo "[$(date +%T)] study $name finished in $((SECONDS - begin)) s"
  else  # the lane goes on; the study's log names the failed children, and running this again retries them
    echo "[$(date +%T)] study $name FAILED (exit $?) after $((SECONDS - begin)) s: $OUT/$name.log"
    touch "$OUT/.failed"
  fi
}

# Two lanes of about equal length (one core each). (a) every method at M = 4 (the headline table) and the
# single model; with its end-of-training evaluation this also gives (c) ECE under corruption and (d) OOD AUROC.
# (b) τ sweep at M = 4, λ = 0.01 and (e) λ sweep at M = 4, τ = 0.25 (λ = 0 is the recipe's, in the headline study);
# then BatchEnsemble and the FiLM ablation at M = 2 and 8. (M = 1 of every method is one network: the single model.)
NOSHIFT="eval.corruptions=[]"
lane1() {
  study methods methods --methods sigma,single,deep,batch,packed,film --members 4
  study tau tau-sweep --taus 0.1,0.5,1,2 --lambdas 0.01 "$NOSHIFT"
  study lambda lambda-sweep --lambdas 0.001,0.01,0.1 "$NOSHIFT"
  study scaling2 methods --methods batch,film --members 2,8
}
# The single model at 4× the steps (equal training compute with M = 4); (a) M-scaling of σN-Ens, the Deep Ensemble
# and Packed-Ensembles at M = 2 and 8, and σN-Ens at M = 16.
lane2() {
  study compute methods --methods single --budgets 4 "$NOSHIFT"
  study scaling methods --methods sigma,deep,packed --members 2,8
  study m16 m-scaling --methods sigma --members 16
}
start=$SECONDS
rm -f "$OUT/.failed"
lane1 &
lane2 &
wait
rc=0
[ -e "$OUT/.failed" ] && rc=1
echo "[$(date +%T)] all studies done in $((SECONDS - start)) s (rc=$rc)"

experiment=$(python -c "from sigmanens_dist.config import load_config; print(load_config('$CFG', []).tracking.experiment)")
sigmanens compare --experiment "$experiment" --uri "$URI" --out "$OUT/compare" --pair epochs
sigmanens compare --experiment "$experiment" --uri "$URI" --out "$OUT/compare_compute" --pair compute
sigmanens compare --experiment "$experiment" --uri "$URI" --out "$OUT/compare_vs_deep" --reference deep
exit "$rc"
