#!/usr/bin/env bash
# σN-Ens under shift (docs/results.md "Under shift", issue 45): the checkpoints the diagnosis and the levers are
# measured on, and the choice of the levers on the validation shift. Trains, per seed, the single model and σN-Ens M=4
# at three temperatures (τ = 0.25, 0.5 — the recipe — and 1) with no end-of-training evaluation; then every run is
# scored on the validation split under the validation corruptions (never a test corruption, never the test split),
# with each member's training BatchNorm statistics and with the prediction batch's (`--norm-stats batch`), temperature
# scaled on the calibration split at the long budget (no temperature at the small one). The test
# set is read once, later, for the choices made here. A finished study's runs are kept in
# results/shift_<budget>/records/<study>.jsonl (a recorded study whose checkpoint is gone and which was not scored yet is
# trained again: same seed and recipe, another machine's floats may differ), each validation evaluation in
# results/shift_<budget>/val/<run>/eval.json; the checkpoints stay in OUT.
#   bash research/long_shift.sh train [OUT] [LANE...]   # lanes: single sigma sigma_t025 sigma_t1 sigma_l0001 sigma_l01
#                                                       #   wide deep packed3
#                                                       #   single_augmix sigma_augmix sigma_augmix_spread (default: all)
#   bash research/long_shift.sh choose [OUT] [STUDY...] # the validation-shift evaluations of every trained run (or of
#                                                       #   the studies named, e.g. sigma_s3: two may run at once)
#   python research/shift_tables.py choose --write      # their table, and the choice (results/shift_<budget>/choice.json)
#   bash research/long_shift.sh test [OUT] [FAMILY:NORM...]  # the chosen configurations (or those given), every seed,
#                                                       # scored once on the test set: results/shift_<budget>/test/
#   python research/shift_tables.py test                # their tables
#   bash research/long_shift.sh member_t [OUT] [STUDY...]  # one temperature on the averaged ensemble against one per
#                                                       # member, on the validation split and shift, each model at its
#                                                       # chosen statistics: results/shift_<budget>/val_member_t/
#   python research/shift_tables.py member-t            # their paired table
#   SEEDS="0 1 2 3 4" bash research/long_shift.sh train runs/shift_long sigma single   # two lanes may share OUT
# The mixed-batch round (issue 52; SHIFT_RESULTS=results/shift_mixed): the shift scored as one stream mixing every
# corruption × severity with the clean images (`sigmanens eval --shift-batches mixed`), at the batch sizes a deployment
# has (1, 8, 32) and the statistics it may use (training; each batch's mixed with the training ones by a prior N):
#   bash research/long_shift.sh mixed_choose [OUT] [STUDY...]  # every configuration of MIXED_GRID on the validation
#                                                       #   split and shift: results/shift_mixed/val/<study>_<config>
#   python research/mixed_tables.py choose --write      # per model and batch size, the configuration of lowest
#                                                       #   validation-shift NLL (results/shift_mixed/choice.json)
#   bash research/long_shift.sh mixed_test [OUT] [FAMILY:CONFIG...]  # those, the training statistics and the
#                                                       #   per-corruption protocol's batch statistics, once on the
#                                                       #   test set (or the configurations given)
#   python research/mixed_tables.py test                # their tables (docs/results.md "Under mixed batches")
# SHIFT_BUDGET=small uses the recipe's own 200 steps (a preview; OUT default runs/shift_small) instead of the long
# budget (6,250 steps).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/studies.sh"  # ROOT, the venv, cd ROOT, the study helpers
phase="${1:-}"
[[ $phase =~ ^(train|choose|test|member_t|mixed_choose|mixed_test)$ ]] ||
  { echo "long_shift: give a phase, train, choose, test, member_t, mixed_choose or mixed_test (got '$phase')" >&2
    exit 2; }
shift
budget="${SHIFT_BUDGET:-long}"
# At the long budget a calibration split of 2,000 images is carved beside the validation split (the pool grows by as
# much, so the model still trains on 10,000): the temperature is fitted on data nothing was selected on. The split is
# drawn from the pool's size, so these runs' validation and training images are not those of the 12,000-image pool of
# the other long runs: compare these runs with each other, not with results/posthoc_long.
case "$budget" in
  long) BUDGET_ARGS=("${LONG_BUDGET[@]}" eval.at_end=false data.train_subset=14000 data.calib_split=2000)
        CALIBRATION=(--calibration temperature) CONFORMAL=(--conformal 0.1,0.05) ;;
  small) BUDGET_ARGS=(eval.at_end=false) CALIBRATION=() CONFORMAL=() ;;
  *) echo "long_shift: SHIFT_BUDGET=$budget: long or small" >&2; exit 2 ;;
esac
out_arg="${1:-runs/shift_$budget}"
shift $(($# > 0 ? 1 : 0))
# SHIFT_RESULTS (a folder under the repository) keeps another round's records and evaluations apart, e.g. the mixed-batch
# round of issue 52 (results/shift_mixed), whose checkpoints are trained again from the same recipe and seeds.
RESULTS="$ROOT/${SHIFT_RESULTS:-results/shift_$budget}"
SEED_LIST=(${SEEDS:-0 1 2 3 4})
# the lanes beside launch/studies.sh's single, sigma, deep and packed3
LANE_ARGS+=(
  [sigma_t025]="--methods sigma --members 4 reg.tau=0.25"
  [sigma_t1]="--methods sigma --members 4 reg.tau=1.0"
  # λ a tenth and ten times the recipe's 0.01 (lever c of issue 52: λ had never been chosen under shift)
  [sigma_l0001]="--methods sigma --members 4 reg.lambda=0.001"
  [sigma_l01]="--methods sigma --members 4 reg.lambda=0.1"
  # One network at σN-Ens M=4's inference compute: test_resnet at twice the width (stem and every stage), 26.5 MFLOPs
  # an image against 4 × 6.65 (and 1.49M parameters, 3.98× one network's).
  [wide]="--methods single model.kwargs.channels=[64,96,96,192] model.kwargs.stem_width=32"
  # AugMix (train.augmix: torchvision's, its operations disjoint from every test and validation corruption), for both
  [single_augmix]="--methods single train.augmix=true"
  [sigma_augmix]="--methods sigma --members 4 train.augmix=true"
  # and σN-Ens with a spread of AugMix strengths over its members (member diversity from data)
  [sigma_augmix_spread]="--methods sigma --members 4 train.augmix.member_severity=[1,3,5,7]"
)

scored() { [ -s "$RESULTS/val/${1}_train/eval.json" ]; }

if [ "$phase" = train ]; then
  read -r -a LANES <<< "${*:-single sigma sigma_t025 sigma_t1 wide deep packed3 single_augmix sigma_augmix sigma_augmix_spread}"
  studies_begin "$out_arg" 5091
  RECORDS="$RESULTS/records"
  train_lanes scored "${LANES[@]}"
  [ ! -e "$OUT/.failed" ]
  exit
fi

OUT="$(cd "$out_arg" && pwd)"
export OMP_NUM_THREADS=1
failed=0

# score KIND NAME RUN EVAL_ARGS...: one evaluation of RUN (a run folder; empty: not trained) into OUT/KIND/NAME, its
# eval.json and eval.md published whole or not at all in results/shift_<budget>/KIND/NAME; skipped where they are there.
score() {
  local kind=$1 name=$2 run=$3
  shift 3
  local dest="$RESULTS/$kind/$name" work="$OUT/$kind/$name" log="$OUT/${kind}_$name.log"
  if [ -s "$dest/eval.json" ]; then echo "[$(date +%T)] $name: evaluated before, skipped"; return; fi
  if [ -z "$run" ]; then echo "[$(date +%T)] $name: not trained (no run in $OUT)"; failed=1; return; fi
  echo "[$(date +%T)] $name: scoring ($kind)"
  if publish_eval "$dest" "$work" "$log" --checkpoint "$run" "$@" --corruptions all --severities 3,5 \
      --no-sub-ensembles --no-mlflow; then
    echo "[$(date +%T)] $name: kept in $dest"
  else
    echo "[$(date +%T)] $name: eval FAILED: $log"
    failed=1
  fi
}

# trained_runs PATTERN...: the run folder of every trained study in OUT matching a pattern, one a line (none: exit 1).
trained_runs() {
  local pattern runs
  for pattern in "$@"; do
    for runs in "$OUT"/$pattern/*/final_metrics.json; do
      [ -e "$runs" ] || { echo "long_shift: no trained run in $OUT ($pattern/*/final_metrics.json)" >&2; return 1; }
      dirname "$runs"
    done
  done
}

if [ "$phase" = test ]; then
  # The test set, once, for what the validation shift chose: each seed's run of each chosen FAMILY:NORM (or of those
  # given: a configuration that was not chosen is labelled by its name in the tables, never as the choice).
  read -r -a CONFIGS <<< "${*:-}"
  if [ "${#CONFIGS[@]}" -eq 0 ]; then
    choice="$RESULTS/choice.json"
    [ -s "$choice" ] || { echo "long_shift: no $choice: python research/shift_tables.py choose --write" >&2; exit 2; }
    read -r -a CONFIGS <<< "$(python - "$choice" <<'PY'
import json, sys
print(" ".join(f"{c['family']}:{c['norm']}" for c in json.load(open(sys.argv[1])).values()))
PY
)"
  fi
  for config in "${CONFIGS[@]}"; do
    family="${config%%:*}" norm="${config#*:}"
    [[ -n "${LANE_ARGS[$family]:-}" && ($norm == train || $norm == batch) ]] ||
      { echo "long_shift: $config: FAMILY:NORM with FAMILY one of ${!LANE_ARGS[*]}, NORM train or batch" >&2; exit 2; }
  done
  for config in "${CONFIGS[@]}"; do
    family="${config%%:*}" norm="${config#*:}"
    for seed in "${SEED_LIST[@]}"; do
      runs=("$OUT/${family}_s$seed"/*/final_metrics.json)
      run="$(dirname "${runs[0]}")"
      [ -e "${runs[0]}" ] || run=""
      score test "${family}_s${seed}_$norm" "$run" --norm-stats "$norm" "${CALIBRATION[@]}" "${CONFORMAL[@]}"
    done
  done
  exit "$failed"
fi

# config_args CONFIG: the eval options of one mixed-round configuration: train (the training statistics: one stream at
# batch 32 answers for every batch size), b<B>p<N> (batches of B mixed, each batch's statistics with prior N) or
# h<B>p<N> (the per-corruption protocol's batches of B, each batch's statistics with prior N)
# MIXED_B8="b8p0 b8p16": batches of 8 too. MIXED_GRID (words) replaces the grid, e.g. for the reference models, which
# were chosen over "train b32p16 b32p64 b1p16 b1p64" on one seed (priors 0 and 4 were the worst for σN-Ens and the
# single model at every batch size; docs/results.md "Under mixed batches")
read -r -a MIXED_GRID <<< "${MIXED_GRID:-train b32p0 b32p4 b32p16 b32p64 b1p4 b1p16 b1p64 ${MIXED_B8:-}}"
# the mixed test stream: the first 2,000 test images (58,000 with their 28 corrupted copies; all 10,000 would take
# 25 min a configuration here)
MIXED_TEST=(--data test_subset=2000)
config_args() {
  case "$1" in
    train) echo "--shift-batches mixed --batch-size 32 --norm-stats train" ;;
    b*p*) local b="${1#b}"; echo "--shift-batches mixed --batch-size ${b%p*} --norm-stats batch --norm-stats-prior ${b#*p}" ;;
    h*p*) local b="${1#h}"; echo "--batch-size ${b%p*} --norm-stats batch --norm-stats-prior ${b#*p}" ;;
    *) echo "long_shift: unknown configuration $1 (train, b<B>p<N>, h<B>p<N>)" >&2; return 2 ;;
  esac
}

if [ "$phase" = mixed_test ]; then
  # The test set, once, for each family's choice at each batch size (choice.json), and beside it the training
  # statistics and the per-corruption protocol at batch 32 with the batch's statistics (what the earlier round chose);
  # or the FAMILY:CONFIG given (e.g. sigma:train single:h32p0, which every choice tests: they may start before it).
  choice="$RESULTS/choice.json"
  if [ $# -gt 0 ]; then
    plan="$(for given in "$@"; do echo "${given%%:*} ${given#*:}"; done)"
  else
    [ -s "$choice" ] || { echo "long_shift: no $choice: python research/mixed_tables.py choose --write" >&2; exit 2; }
    plan="$(python - "$choice" <<'PY'
import json, sys
for family, by_batch in json.load(open(sys.argv[1])).items():
    chosen = [by_batch[b]["config"] for b in ("32", "1") if b in by_batch]  # what the test tables compare
    print(family, " ".join(dict.fromkeys(["train", "h32p0", *chosen])))
PY
)"
  fi
  while read -r family configs; do
    [[ -n "${LANE_ARGS[$family]:-}" ]] || { echo "long_shift: unknown family $family" >&2; exit 2; }
    for seed in "${SEED_LIST[@]}"; do
      runs=("$OUT/${family}_s$seed"/*/final_metrics.json)
      run="$(dirname "${runs[0]}")"
      [ -e "${runs[0]}" ] || run=""
      for config in $configs; do
        # shellcheck disable=SC2046  # config_args prints several words
        score test "${family}_s${seed}_$config" "$run" $(config_args "$config") "${MIXED_TEST[@]}" \
          "${CALIBRATION[@]}" "${CONFORMAL[@]}"
      done
    done
  done <<< "$plan"
  exit "$failed"
fi

read -r -a STUDIES <<< "${*:-*_s*}"
RUNS="$(trained_runs "${STUDIES[@]}")" || exit 1
if [ "$phase" = mixed_choose ]; then
  while read -r run; do
    study="$(basename "$(dirname "$run")")"
    for config in "${MIXED_GRID[@]}"; do
      # shellcheck disable=SC2046  # config_args prints several words
      score val "${study}_$config" "$run" --split val --shift-split val $(config_args "$config") "${CALIBRATION[@]}"
    done
  done <<< "$RUNS"
  exit "$failed"
fi
if [ "$phase" = member_t ]; then
  # One evaluation per ensemble run gives both calibrations (`--calibration member-temperature` reports the ensemble's
  # one T beside the members' own), on the validation split and shift, at the statistics choice.json chose for it.
  choice="$RESULTS/choice.json"
  [ -s "$choice" ] || { echo "long_shift: no $choice: python research/shift_tables.py choose --write" >&2; exit 2; }
  while read -r run; do
    study="$(basename "$(dirname "$run")")"
    norm="$(python - "$choice" "${study%_s*}" <<'PY'
import json, sys
print(next((c["norm"] for c in json.load(open(sys.argv[1])).values() if c["family"] == sys.argv[2]), ""))
PY
)"
    [ -n "$norm" ] || { echo "long_shift: ${study%_s*} was not chosen for ($choice)" >&2; failed=1; continue; }
    score val_member_t "${study}_$norm" "$run" --split val --shift-split val --norm-stats "$norm" \
      --calibration member-temperature
  done <<< "$RUNS"
  exit "$failed"
fi

while read -r run; do
  study="$(basename "$(dirname "$run")")"
  for norm in train batch; do
    score val "${study}_$norm" "$run" --split val --shift-split val --norm-stats "$norm" "${CALIBRATION[@]}"
  done
done <<< "$RUNS"
exit "$failed"
