#!/usr/bin/env bash
# On a CUDA machine, what CI (CPU only) cannot check, in two parts:
#   perf    the issue-26 table: bench_core's train step in bf16, eager and compiled, NCHW and channels_last, σN-Ens /
#           plain at equal FLOPs and member loop / σN-Ens, with peak memory, for resnet18 32² (B=128 per member),
#           resnet50 224² (B=64), vit_tiny/vit_small 224² (B=128; the ImageNet recipe's models), M = 4 and 16; then
#           the whole loop (bench/bench_trainer.py): the trainer's σN-Ens M=4 against its single model at 4× batch,
#           and against a bare PyTorch loop (sized for a short GPU slot; not yet timed on a GPU);
#   checks  every method trains and evaluates on the GPU in bf16; DDP and FSDP2 run through torchrun with nccl; a run
#           preempted by SIGTERM resumes on the GPU (~5 min).
#   bash bench/gpu_check.sh [OUT] [FASHION_MNIST_ROOT] [--part perf|checks|all] [--device cuda|cpu]
# --device cpu runs the same rows at smoke sizes (tiny batches and images, a shallow ViT, fewer repeats): the way to
# test this script before a GPU is at hand (tests/test_bench.py). OUT defaults to runs/gpu_check; writes
# OUT/summary.md (every row's log beside it); exits 1 if any row failed (an out-of-memory row says so and the rest go on).
set -uo pipefail
PART=all
DEVICE=cuda
POSITIONAL=()
while (($#)); do
  case "$1" in
    --part) PART=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    *) POSITIONAL+=("$1"); shift ;;
  esac
done
case "$PART" in perf|checks|all) ;; *) echo "--part $PART: choose perf, checks or all" >&2; exit 2 ;; esac
case "$DEVICE" in cuda|cpu) ;; *) echo "--device $DEVICE: choose cuda or cpu" >&2; exit 2 ;; esac
OUT="${POSITIONAL[0]:-runs/gpu_check}"
ROOT_ARG=()
[ -n "${POSITIONAL[1]:-}" ] && ROOT_ARG=("data.root=${POSITIONAL[1]}")
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # bench/*.py import the package
SUMMARY="$OUT/summary.md"
FAILED=0
# the small recipe, shortened; MLflow off (the check is the trainer, not the store)
COMMON=(--config configs/fmnist_small.yaml train.amp=bf16 tracking.enabled=false train.eval_every_steps=100
        "${ROOT_ARG[@]}")

check() {  # name, expected exit status, then the command; records pass/fail in the summary
  local name=$1 want=$2 begin=$SECONDS
  shift 2
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local verdict=pass
  [ "$rc" = "$want" ] || { verdict="FAIL (exit $rc, expected $want; $OUT/$name.log)"; FAILED=1; }
  echo "| $name | $verdict | $((SECONDS - begin)) s |" >>"$SUMMARY"
}

{
  echo "# GPU check ($(date -u +%FT%TZ), --part $PART --device $DEVICE)"
  echo
  echo '```'
  if [ "$DEVICE" = cuda ]; then nvidia-smi -L; else echo "CPU: $(nproc --all) cores"; fi
  "$PY" -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  echo '```'
  echo
  echo "| check | result | wall |"
  echo "|---|---|---|"
} >"$SUMMARY"

# The perf part: one row per (model, M, format, compile); smoke sizes on the CPU.
perf() {
  local rows repeats=6 trainer=(--device cuda --amp bf16 --model vit_tiny_patch16_224 --kwargs --img 224 --batch 128
                                --workers 8 --steps 60)
  # model img batch(per member) kwargs…; channels_last is measured for the convolutional ones
  rows=("resnet18 32 128" "resnet50 224 64" "vit_tiny_patch16_224 224 128" "vit_small_patch16_224 224 128")
  local amp=(--amp bf16) compiled=("resnet50 224 64" "vit_tiny_patch16_224 224 128")
  if [ "$DEVICE" = cpu ]; then
    repeats=1 amp=()
    rows=("resnet18 32 2" "resnet50 64 1" "vit_tiny_patch16_224 32 2 img_size=32 patch_size=8 depth=2"
          "vit_small_patch16_224 32 1 img_size=32 patch_size=8 depth=2")
    compiled=("resnet18 32 2")
    trainer=(--device cpu --steps 30 --window 5)
  fi
  local row model img batch kw m fmt
  for row in "${rows[@]}"; do
    read -r model img batch kw <<<"$row"
    for m in 4 16; do
      for fmt in nchw channels_last; do
        [ "$fmt" = channels_last ] && [[ "$model" == vit* ]] && continue  # one convolution: nothing to gain
        check "step_${model}_M${m}_$fmt" 0 "$PY" bench/bench_core.py --only step --device "$DEVICE" "${amp[@]}" \
          --model "$model" --img "$img" --batch "$batch" --members "$m" --repeats "$repeats" \
          $([ "$fmt" = channels_last ] && echo --channels-last) --kwargs $kw
      done
    done
  done
  for row in "${compiled[@]}"; do
    read -r model img batch kw <<<"$row"
    check "step_${model}_M4_compiled" 0 "$PY" bench/bench_core.py --only step --device "$DEVICE" "${amp[@]}" \
      --model "$model" --img "$img" --batch "$batch" --members 4 --repeats "$repeats" --compile --kwargs $kw
  done
  check trainer 0 "$PY" bench/bench_trainer.py "${trainer[@]}"
}

checks() {
# 1. Every method, 300 steps in bf16 with the end-of-training evaluation (shift and OOD), side by side on one GPU.
pids=()
for method in sigma single deep batch packed film; do
  check "train_$method" 0 "$PY" -m sigmanens_dist.train "${COMMON[@]}" "model.method=$method" train.max_steps=300 \
    "run_dir=$OUT/train_$method" &
  pids+=($!)
done
wait "${pids[@]}"

# 2. The distributed strategies through torchrun with nccl (one process: the GPU path of wrapping and sync).
for strategy in ddp fsdp; do
  check "torchrun_$strategy" 0 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m sigmanens_dist.train \
    "${COMMON[@]}" "strategy.name=$strategy" train.max_steps=100 eval.at_end=false "run_dir=$OUT/torchrun_$strategy"
done

# 3. Preemption on the GPU: SIGTERM after the step-100 checkpoint exits 75; the resumed run finishes the 200 steps.
RESUME=("${COMMON[@]}" train.max_steps=200 checkpoint.every_steps=100 eval.at_end=false)
check resume_straight 0 "$PY" -m sigmanens_dist.train "${RESUME[@]}" "run_dir=$OUT/resume_straight"
preempt() {
  "$PY" -m sigmanens_dist.train "${RESUME[@]}" "run_dir=$OUT/resume_cut" &
  local pid=$!
  until [ -e "$OUT/resume_cut/checkpoints/step_00000100.pt" ] || ! kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  kill -TERM "$pid" 2>/dev/null
  wait "$pid"
}
check resume_preempted 75 preempt
check resume_continued 0 "$PY" -m sigmanens_dist.train "${RESUME[@]}" "run_dir=$OUT/resume_cut" checkpoint.resume=auto
}

case "$PART" in
  perf) perf ;;
  checks) checks ;;
  all) perf; checks ;;
esac

# What the runs measured: accuracy after 300 steps and training throughput per method; the resumed run's losses
# against the uninterrupted one's.
"$PY" - "$OUT" >>"$SUMMARY" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = sorted(out.glob("train_*"))
if runs:  # the checks part ran
    print("\n| method (300 steps, bf16) | val acc | val NLL | train img/s |\n|---|---:|---:|---:|")
for d in runs:
    f = d / "final_metrics.json"
    if f.is_file():
        m = json.loads(f.read_text())
        print(f"| {d.name[6:]} | {m.get('acc', float('nan')):.4f} | {m.get('nll', float('nan')):.4f} | "
              f"{m.get('train_img_per_s', float('nan')):.0f} |")


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


a, b = out / "resume_straight", out / "resume_cut"
if (a / "metrics.jsonl").is_file() and (b / "metrics.jsonl").is_file():
    la, lb = losses(a), losses(b)
    common = sorted(k for k in la.keys() & lb.keys() if k > 100)
    diff = max((abs(la[k] - lb[k]) for k in common), default=float("nan"))
    print(f"\nresume: {len(common)} logged steps after the preemption; max |loss difference| vs the uninterrupted "
          f"run {diff:.3g} (0 means bit-identical; GPU kernels may be non-deterministic)")
EOF
for f in "$OUT"/step_*.log "$OUT"/trainer.log; do
  [ -e "$f" ] && { echo; echo '```'; tail -7 "$f"; echo '```'; } >>"$SUMMARY"
done
cat "$SUMMARY"
exit "$FAILED"
