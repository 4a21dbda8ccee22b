#!/usr/bin/env bash
# On a CUDA machine, what CI (CPU only) cannot check, in three parts, one call each (each sized to under 5 minutes on
# an H100, an estimate: docs/benchmarks.md "On a GPU"):
#   eager     bench/gpu_table.py's eager bf16 train step of σN-Ens / plain at equal rows and a member loop, resnet18 32²,
#             resnet50, ViT-Ti and ViT-S 224² at M = 4 and 16, NCHW and channels_last (convolutional ones), peak memory
#             per candidate, σN-Ens and plain each in its fastest format, top-10 kernels of ResNet-50 and ViT-Ti at
#             M=4; then bench/bench_trainer.py: the trainer's σN-Ens M=4 against its single model at 4× the batch and
#             against a bare PyTorch loop (ViT-Ti 224², 64 images per member, 8 persistent workers per stream);
#   compiled  the same step under torch.compile for ResNet-50 and ViT-Ti at M=4, with each compilation's seconds;
#   checks    every method trains and evaluates in bf16, DDP and FSDP2 through torchrun with nccl, a run preempted by
#             SIGTERM resumes (synthetic data: the GPU machine has no datasets; the runs side by side on the GPU).
#   bash bench/gpu_check.sh [OUT] --part eager|compiled|checks [--device cuda|cpu] [--wheels DIR] [--models a,b]
# First the wheel folder (default gpu_wheels, made by bench/gpu_wheels.sh) is installed into an empty temporary
# --target put first on PYTHONPATH (the GPU image lacks pydantic and can fetch nothing); a folder without wheels
# installs nothing. Then every import the part needs is checked and the versions of Python, torch, CUDA and the GPU
# printed: the part runs with the interpreter's torch (the image's, not the project's pin). --device cpu runs the same
# rows at smoke sizes (tests/test_bench.py). --models runs only those models' rows (a rerun). OUT (default
# runs/gpu_check) receives two files: summary_<part>.md (every row, printed as it comes) and logs_<part>.tar.gz (every
# log; checkpoints left out). A row that runs out of memory is an OOM row and the rest go on; each stage has a time
# limit on a GPU, so that a slow one cannot take the summary down with it. Exit status 1 if a stage failed.
set -uo pipefail
PART=
DEVICE=cuda
WHEELS=gpu_wheels
MODELS=()
POSITIONAL=()
while (($#)); do
  case "$1" in
    --part) PART=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --models) MODELS=(--models "$2"); shift 2 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) POSITIONAL+=("$1"); shift ;;
  esac
done
case "$PART" in eager|compiled|checks) ;; *) echo "--part eager, compiled or checks (one call each)" >&2; exit 2 ;; esac
case "$DEVICE" in cuda|cpu) ;; *) echo "--device $DEVICE: choose cuda or cpu" >&2; exit 2 ;; esac
OUT="${POSITIONAL[0]:-runs/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary_$PART.md"
SITE=$(mktemp -d)  # the wheels' --target
WORK=$(mktemp -d)  # logs and run folders, tarred into OUT at the end
trap 'rm -rf "$SITE" "$WORK"' EXIT
FAILED=0
BEGIN=$SECONDS
: >"$SUMMARY"
say() { echo "$@" | tee -a "$SUMMARY"; }

# -- what the GPU image lacks, from the carried wheels; then every import the part needs -----------------------------
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$WHEELS"/*.whl || { echo "installing $WHEELS/*.whl into $SITE failed" >&2; exit 2; }
  INSTALLED="$(cd "$WHEELS" && ls -1 ./*.whl | sed 's|^\./||' | tr '\n' ' ')"
else
  INSTALLED="nothing (no wheels in $WHEELS; make them with bash bench/gpu_wheels.sh)"
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
say "# GPU check, --part $PART --device $DEVICE ($(date -u +%FT%TZ))"
say
say '```'
say "installed into $SITE: $INSTALLED"
"$PY" - "$DEVICE" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib, os, platform, sys

sys.path.insert(0, "bench")
missing = []
for name in ("sigmanens_dist.trainer", "sigmanens_dist.cli.train", "sigmanens_dist.evaluation.run", "bench_core",
             "bench_trainer", "gpu_table", "pydantic", "yaml", "timm", "torchmetrics", "matplotlib", "sklearn"):
    try:
        importlib.import_module(name)
    except Exception as err:  # every missing piece named at once
        missing.append(f"{name}: {type(err).__name__}: {err}")
import torch

print(f"Python {platform.python_version()}; torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}) from {os.path.dirname(os.path.dirname(torch.__file__))}")
for name in ("timm", "pydantic", "typing_extensions"):  # the folder each comes from: the image's, or the wheels'
    if name in sys.modules:
        mod = sys.modules[name]
        where = os.path.dirname(mod.__file__)
        where = os.path.dirname(where) if mod.__file__.endswith("__init__.py") else where
        print(f"{name} {getattr(mod, '__version__', '')} from {where}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        missing.append("torch.cuda.is_available() is False")
    else:
        p = torch.cuda.get_device_properties(0)
        print(f"GPU {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
for line in missing:
    print("MISSING", line)
sys.exit(1 if missing else 0)
EOF
(( PIPESTATUS[0] == 0 )) || { say '```'; say "imports failed: nothing was run"; exit 2; }
say '```'

# -- the stages --------------------------------------------------------------------------------------------------------
stage() {  # name, expected exit status, time limit in seconds on a GPU (none on the CPU), then the command
  local name=$1 want=$2 limit=$3 begin=$SECONDS rc
  shift 3
  [ "$DEVICE" = cpu ] && limit=0
  if [ "$PART" = checks ]; then  # side by side: logs only
    timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
  else  # one at a time: printed as it comes
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  local verdict=pass
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then verdict="FAIL (stopped at its limit of $limit s)"
  elif [ "$rc" != "$want" ]; then verdict="FAIL (exit $rc, expected $want; $name.log)"; fi
  echo "| $name | $verdict | $((SECONDS - begin)) s |" | tee -a "$WORK/stages.md"
}

case "$PART" in
  eager|compiled)
    say
    stage table 0 "$([ "$PART" = eager ] && echo 330 || echo 520)" \
      "$PY" bench/gpu_table.py --part "$PART" --device "$DEVICE" --summary "$SUMMARY" "${MODELS[@]}"
    if [ "$PART" = eager ] && { [ ${#MODELS[@]} = 0 ] || [[ "${MODELS[1]}" == *vit_tiny_patch16_224* ]]; }; then
      args=(--device cuda --amp bf16 --model vit_tiny_patch16_224 --kwargs --img 224 --batch 64 --members 4
            --workers 8 --steps 60 --window 10)
      [ "$DEVICE" = cpu ] && args=(--kwargs img_size=16 patch_size=8 depth=1 --img 16 --batch 4 --members 4
                                   --workers 1 --epoch-steps 4 --steps 15 --window 5)
      stage trainer 0 200 "$PY" bench/bench_trainer.py "${args[@]}"
      { echo; echo '```'; echo "python bench/bench_trainer.py ${args[*]}"; tail -5 "$WORK/trainer.log"; echo '```'; } \
        >>"$SUMMARY"
    fi
    ;;
  checks)
    # synthetic images (no dataset there); the small recipe shortened; MLflow off (the check is the trainer)
    COMMON=(--config configs/fmnist_small.yaml train.amp=bf16 tracking.enabled=false data.dataset=synthetic
            "eval.corruptions=[]" eval.ood=null train.eval_every_steps=100)
    steps=(300 100 200 100)  # per method, per torchrun strategy, the resumed run, its preemption point
    [ "$DEVICE" = cpu ] && steps=(20 10 20 10) COMMON+=(data.train_subset=600 data.val_split=100 data.test_subset=100)
    RESUME=("${COMMON[@]}" "train.max_steps=${steps[2]}" "checkpoint.every_steps=${steps[3]}" eval.at_end=false)
    CUT="$WORK/resume_cut/checkpoints/step_$(printf %08d "${steps[3]}").pt"
    # every run side by side on the one GPU: each is small, and start-up is most of its time
    for method in sigma single deep batch packed film; do
      stage "train_$method" 0 400 "$PY" -m sigmanens_dist.train "${COMMON[@]}" "model.method=$method" \
        "train.max_steps=${steps[0]}" "run_dir=$WORK/train_$method" &
    done
    for strategy in ddp fsdp; do
      stage "torchrun_$strategy" 0 400 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
        -m sigmanens_dist.train "${COMMON[@]}" "strategy.name=$strategy" "train.max_steps=${steps[1]}" \
        eval.at_end=false "run_dir=$WORK/torchrun_$strategy" &
    done
    stage resume_straight 0 400 "$PY" -m sigmanens_dist.train "${RESUME[@]}" "run_dir=$WORK/resume_straight" &
    {  # SIGTERM once the preemption point's checkpoint is written: exit 75; then the run resumed to the end
      "$PY" -m sigmanens_dist.train "${RESUME[@]}" "run_dir=$WORK/resume_cut" >"$WORK/resume_cut.log" 2>&1 &
      pid=$! begin=$SECONDS
      until [ -e "$CUT" ] || ! kill -0 "$pid" 2>/dev/null || ((SECONDS - begin > 300)); do sleep 0.1; done
      kill -TERM "$pid" 2>/dev/null
      wait "$pid"
      rc=$?
      verdict=pass
      [ "$rc" = 75 ] || verdict="FAIL (exit $rc, expected 75; resume_cut.log)"
      echo "| resume_preempted | $verdict | $((SECONDS - begin)) s |" | tee -a "$WORK/stages.md"
      stage resume_continued 0 200 "$PY" -m sigmanens_dist.train "${RESUME[@]}" "run_dir=$WORK/resume_cut" \
        checkpoint.resume=auto
    } &
    wait
    "$PY" - "$WORK" "${steps[3]}" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path

work, cut = Path(sys.argv[1]), int(sys.argv[2])
print("\n| method (bf16, synthetic) | val acc | val NLL | train img/s |\n|---|---:|---:|---:|")
for d in sorted(p for p in work.glob("train_*") if p.is_dir()):
    f = d / "final_metrics.json"
    m = json.loads(f.read_text()) if f.is_file() else {}
    print(f"| {d.name[6:]} | {m.get('acc', float('nan')):.4f} | {m.get('nll', float('nan')):.4f} | "
          f"{m.get('train_img_per_s', float('nan')):.0f} |")


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


a, b = work / "resume_straight", work / "resume_cut"
if (a / "metrics.jsonl").is_file() and (b / "metrics.jsonl").is_file():
    la, lb = losses(a), losses(b)
    common = sorted(k for k in la.keys() & lb.keys() if k > cut)
    diff = max((abs(la[k] - lb[k]) for k in common), default=float("nan"))
    print(f"\nresume: {len(common)} logged steps after the preemption; max |loss difference| vs the uninterrupted "
          f"run {diff:.3g} (0 means bit-identical; GPU kernels may be non-deterministic)")
EOF
    ;;
esac

# -- the stages' verdicts, then the logs ----------------------------------------------------------------------------
{
  echo
  echo "| stage | result | wall |"
  echo "|---|---|---|"
  cat "$WORK/stages.md"
  echo
  echo "--part $PART took $((SECONDS - BEGIN)) s; every log: logs_$PART.tar.gz"
} | tee -a "$SUMMARY"
grep -q FAIL "$WORK/stages.md" && FAILED=1
tar -czf "$OUT/logs_$PART.tar.gz" -C "$WORK" --exclude='*.pt' --exclude='*.distcp' --exclude='*.safetensors' .
exit "$FAILED"
