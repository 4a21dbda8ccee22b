#!/usr/bin/env bash
# On a CUDA machine, what CI (CPU only) cannot check: every method trains and evaluates on the GPU in bf16; DDP and
# FSDP2 run through torchrun with nccl; a run preempted by SIGTERM resumes on the GPU; and the train-step benchmark
# on the GPU (ratios against the plain backbone measured in the same run).
#   bash bench/gpu_check.sh [OUT] [FASHION_MNIST_ROOT]     # OUT defaults to runs/gpu_check; ~5 min on one GPU
# Writes OUT/summary.md (and every run's log beside it); exits 1 if any check failed.
set -uo pipefail
OUT="${1:-runs/gpu_check}"
ROOT_ARG=()
[ -n "${2:-}" ] && ROOT_ARG=("data.root=$2")
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
  echo "# GPU check ($(date -u +%FT%TZ))"
  echo
  echo '```'
  nvidia-smi -L
  "$PY" -c "import torch, timm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'timm', timm.__version__)"
  echo '```'
  echo
  echo "| check | result | wall |"
  echo "|---|---|---|"
} >"$SUMMARY"

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

# 4. The train-step benchmark on the GPU, fp32 and bf16.
check bench_step_fp32 0 "$PY" bench/bench_core.py --only step --device cuda --model resnet18 --batch 128 --img 32
check bench_step_bf16 0 "$PY" bench/bench_core.py --only step --device cuda --amp bf16 --model resnet18 --batch 128 \
  --img 32

# What the runs measured: accuracy after 300 steps and training throughput per method; the resumed run's losses
# against the uninterrupted one's.
"$PY" - "$OUT" >>"$SUMMARY" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("\n| method (300 steps, bf16) | val acc | val NLL | train img/s |\n|---|---:|---:|---:|")
for d in sorted(out.glob("train_*")):
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
for f in "$OUT"/bench_step_*.log; do { echo; echo '```'; tail -6 "$f"; echo '```'; } >>"$SUMMARY"; done
cat "$SUMMARY"
exit "$FAILED"
