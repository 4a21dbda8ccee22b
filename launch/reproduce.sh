#!/usr/bin/env bash
# The reproduction of the paper's claims at CPU scale (docs/results.md "Reproduction"; docs/studies.md): six
# studies on configs/fmnist_small.yaml, 3 paired seeds each, in two lanes of one process each, tracked by one local
# MLflow server, then `sigmanens compare` at equal epochs and at equal training compute.
#   bash launch/reproduce.sh [OUT] [small|long]   # OUT defaults to runs/repro[_long]; run it again to continue
# The tables, plots and per-run CSVs go to OUT/compare{,_compute,_vs_deep}/ (the README's copies: results/repro*/).
# small: the recipe as written (200 steps, 0.64 epoch, 2,000 test images). long: where models converge (issue 18):
# 6,250 steps of 32 on the 10,000 training images (20 epochs), scored on the full 10,000-image test set.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
BUDGET="${2:-small}"
case "$BUDGET" in
  small) BUDGET_ARGS=() ; DEFAULT_OUT=runs/repro ;;
  long) BUDGET_ARGS=("${LONG_BUDGET[@]}") ; DEFAULT_OUT=runs/repro_long ;;
  *) echo "budget must be small or long, got '$BUDGET'" >&2; exit 2 ;;
esac
OUT="$(mkdir -p "${1:-$DEFAULT_OUT}" && cd "${1:-$DEFAULT_OUT}" && pwd)"
PORT="${SIGMANENS_REPRO_PORT:-5055}"
CFG=configs/fmnist_small.yaml

# One tracking server for both lanes (two processes writing one sqlite file directly would lock it).
start_tracking
trap stop_tracking EXIT

# Two lanes of about equal length (one core each). (a) every method at M = 4 (the headline table) and the
# single model; with its end-of-training evaluation this also gives (c) ECE under corruption and (d) OOD AUROC.
# (b) τ sweep at M = 4, λ = 0.01 and (e) λ sweep at M = 4, τ = 0.25 (λ = 0 is the recipe's, in the headline study);
# then BatchEnsemble and the FiLM ablation at M = 2 and 8. (M = 1 of every method is one network: the single model.)
NOSHIFT="eval.corruptions=[]"
# σN-Ens as v0.1 shipped it (λ = 0, τ = 0.25, γ ~ N(3, 0.1)): what these studies measured, and the "v0.1 default"
# rows of the long budget; the recipe's own defaults are now λ = 0.01, τ = 0.5, γ ~ N(2, 0.1) (docs/results.md "Long budget").
V01=(model.gamma_init_mean=3 reg.lambda=0 reg.tau=0.25)
small_lane1() {
  study methods methods --methods sigma,single,deep,batch,packed,film --members 4 "${V01[@]}"
  study tau tau-sweep --taus 0.1,0.5,1,2 --lambdas 0.01 "$NOSHIFT" model.gamma_init_mean=3
  study lambda lambda-sweep --lambdas 0.001,0.01,0.1 "$NOSHIFT" model.gamma_init_mean=3 reg.tau=0.25
  study scaling2 methods --methods batch,film --members 2,8
}
# The single model at 4× the steps (equal training compute with M = 4); (a) M-scaling of σN-Ens, the Deep Ensemble
# and Packed-Ensembles at M = 2 and 8, and σN-Ens at M = 16.
small_lane2() {
  study compute methods --methods single --budgets 4 "$NOSHIFT"
  study scaling methods --methods sigma,deep,packed --members 2,8 "${V01[@]}"
  study m16 m-scaling --methods sigma --members 16 "${V01[@]}"
}
# The long budget (issue 18), one seed per study so a partial run is still paired. (b) The τ sweep on the τ-active
# recipe (docs/quality.md: γ starts on but below saturation, λ = 0.01); its best point on every seed first. (a) The methods at M = 4 (σN-Ens as
# v0.1 shipped it, V01); (f) the fine-tune: seed s's single model converted to σN-Ens M=4 by 625 steps (10 %) at a tenth
# of the rate, against the same single model continued for those steps (its own experiment, so compare pairs them);
# then the single model at 4× the steps and the other baselines for the later seeds.
TAU_ACTIVE=(model.gamma_init_mean=2 model.gamma_init_std=0.1)
FINETUNE=(data.test_subset=10000 train.max_steps=625 optim.lr=0.005 schedule.warmup_steps=20 train.eval_every_steps=125
          checkpoint.every_steps=625 reg.lambda=0.01 reg.tau=1 model.gamma_init_mean=0 model.gamma_init_std=1
          tracking.experiment=sigmanens-fmnist-finetune
          model.affine_init=perturb)  # the start these fine-tunes were measured with (0.1's recipes pinned plain)
long_lane1() {  # the τ sweep on seed 0, then its best ECE point (τ = 0.25 on seed 0) on the other seeds
  study tau_s0 tau-sweep --taus 0.05,0.1,0.25,0.5,1,2 --lambdas 0.01 --seeds 0 "${TAU_ACTIVE[@]}"
  for seed in 1 2; do
    study "tau025_s$seed" tau-sweep --taus 0.25 --lambdas 0.01 --seeds "$seed" "${TAU_ACTIVE[@]}"
  done
  # the rest of the sweep on seeds 1 and 2 (τ = 0.25 is done above), its other promising point (τ = 0.5) first
  for seed in 1 2; do
    study "tau_s$seed" tau-sweep --taus 0.5,0.1,0.05,1,2 --lambdas 0.01 --seeds "$seed" "${TAU_ACTIVE[@]}"
  done
}
long_lane2() {  # what the issue's targets need first (single, σN-Ens v0.1, Deep Ensemble, fine-tune per seed)
  study finetune_s0 --own-budget methods --methods single,sigma --members 4 --seeds 0 "${FINETUNE[@]}" \
    "model.init_from=$OUT/methods_s0/single-s0"
  for seed in 1 2; do
    study "methods_s$seed" methods --methods single,sigma,deep --members 4 --seeds "$seed" "${V01[@]}"
    study "finetune_s$seed" --own-budget methods --methods single,sigma --members 4 --seeds "$seed" "${FINETUNE[@]}" \
      "model.init_from=$OUT/methods_s$seed/single-s$seed"
  done
  study methods_s0 methods --methods single,sigma,deep,film,batch,packed --members 4 --seeds 0 "${V01[@]}"
  for seed in 0 1 2; do study "compute_s$seed" methods --methods single --budgets 4 --seeds "$seed"; done
  for seed in 1 2; do study "baselines_s$seed" methods --methods film,batch,packed --members 4 --seeds "$seed"; done
  # (f2) the fine-tune on the τ-active recipe (γ ~ N(2, 0.1), τ = 0.5): σN-Ens only, against the continued sources
  for seed in 0 1 2; do
    study "finetune05_s$seed" --own-budget methods --methods sigma --members 4 --seeds "$seed" "${FINETUNE[@]}" \
      reg.tau=0.5 "${TAU_ACTIVE[@]}" "model.init_from=$OUT/methods_s$seed/single-s$seed"
  done
}
start=$SECONDS
rm -f "$OUT/.failed"
"${BUDGET}_lane1" &
"${BUDGET}_lane2" &
wait
rc=0
[ -e "$OUT/.failed" ] && rc=1
echo "[$(date +%T)] all studies done in $((SECONDS - start)) s (rc=$rc)"

experiment=$(python -c "from sigmanens_dist.config import load_config; print(load_config('$CFG', []).tracking.experiment)")
sigmanens compare --experiment "$experiment" --uri "$URI" --out "$OUT/compare" --pair epochs
sigmanens compare --experiment "$experiment" --uri "$URI" --out "$OUT/compare_compute" --pair compute
sigmanens compare --experiment "$experiment" --uri "$URI" --out "$OUT/compare_vs_deep" --reference deep
if [ "$BUDGET" = long ]; then
  sigmanens compare --experiment sigmanens-fmnist-finetune --uri "$URI" --out "$OUT/compare_finetune" --pair epochs
fi
exit "$rc"
