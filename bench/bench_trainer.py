"""The whole training loop's throughput, not only the step; every number a ratio measured in the same run.

    python bench/bench_trainer.py                                     # CPU smoke size (a tiny ViT, 32x32)
    python bench/bench_trainer.py --device cuda --amp bf16 --model vit_tiny_patch16_224 --img 224 --batch 128

1. the trainer's images/s through the backbone (``python -m sigmanens_dist.train`` on synthetic data, median of its
   logged windows after the first two) for σN-Ens M at batch B (M·B rows) against the single model at batch M·B
   (equal FLOPs; goal ≥ 0.87, i.e. a step ≤ 1.15× the plain one);
2. the trainer's single model against a bare PyTorch loop (same model, AdamW, autocast, batch, label smoothing;
   batches already on the device): what the trainer's own machinery costs — loader, hooks, logging, checkpoint
   checks, progress bar (goal ≥ 0.95).

Both time their steps alike (sigmanens_dist.training.throughput: CUDA events on a GPU, to the kernels' end); the
data hold ``--epoch-steps`` steps of the single model (50: its loader is not restarted every few steps), read by
``--workers`` persistent workers per stream.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import timm
import torch

from sigmanens_dist.training.throughput import Throughput

REPO = Path(__file__).resolve().parent.parent
VAL = 64  # validation images carved from the training pool (the runs evaluate only at their end)


def trainer_rate(args: argparse.Namespace, method: str, batch: int, out: Path) -> float:
    """The trainer on synthetic data: the median of its logged images/s (``median_rate``)."""
    run = out / method
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}
    kwargs = [f"model.kwargs.{kv}" for kv in args.kwargs]
    cmd = [sys.executable, "-m", "sigmanens_dist.train", f"run_dir={run}", "tracking.enabled=false",
           f"model.name={args.model}", *kwargs, f"model.method={method}", f"model.num_members={args.members}",
           "data.dataset=synthetic", f"data.img_size={args.img}",
           f"data.train_subset={args.epoch_steps * args.members * args.batch + VAL}", f"data.val_split={VAL}",
           f"data.num_workers={args.workers}", f"train.batch_size={batch}",
           f"train.max_steps={args.steps}", f"train.log_every_steps={args.window}", f"train.amp={args.amp}",
           f"train.eval_every_steps={args.steps}", f"checkpoint.every_steps={args.steps}", "eval.at_end=false",
           "optim.name=adamw", "train.label_smoothing=0.1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"trainer run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return median_rate(run, args.steps, args.window)


def median_rate(run: Path, steps: int, window: int) -> float:
    """Median train/img_per_s of a finished trainer run's log windows, the first two (warm-up) left out."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/img_per_s"] for r in rows if "train/img_per_s" in r][2:]
    if not rates:
        raise SystemExit(f"--steps {steps} with --window {window} leaves no log window after the first two")
    return statistics.median(rates)


def bare_rate(args: argparse.Namespace, batch: int) -> float:
    """The same single model trained by a bare loop on batches already on the device, its steps timed as the
    trainer times its own (median of the windows after the first two)."""
    device = torch.device(args.device)
    kwargs = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.kwargs)}
    model = timm.create_model(args.model, num_classes=10, **kwargs).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ce = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    batches = [(torch.randn(batch, 3, args.img, args.img, device=device), torch.randint(0, 10, (batch,), device=device))
               for _ in range(4)]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.amp == "bf16" else contextlib.nullcontext())
    rates, window = [], Throughput(device)
    for _ in range(args.steps // args.window):
        for step in range(args.window):
            x, y = batches[step % len(batches)]
            start = window.start()
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = ce(model(x), y)
            loss.backward()
            opt.step()
            window.stop(start, batch)
        loss.item()  # the trainer reads its losses at each log line: the same synchronisation
        rates.append(window.take_rate())
    return statistics.median(rates[2:])


def _value(text: str) -> int | float | str:
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--kwargs", nargs="*", default=["img_size=32", "patch_size=8", "depth=4"],
                    help="timm.create_model kwargs as key=value (default: a CPU-sized ViT; pass none for the real one)")
    ap.add_argument("--img", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16, help="per member; the single model trains on members × batch")
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, default=10, help="steps per timed window (the trainer's log interval)")
    ap.add_argument("--workers", type=int, default=0, help="data.num_workers of the trainer runs (per member stream)")
    ap.add_argument("--epoch-steps", type=int, default=50, help="steps of the single model in one epoch of data")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--amp", default="none", choices=["none", "bf16"])
    args = ap.parse_args()
    big = args.members * args.batch
    with tempfile.TemporaryDirectory() as tmp:
        sigma = trainer_rate(args, "sigma", args.batch, Path(tmp))
        single = trainer_rate(args, "single", big, Path(tmp))
    bare = bare_rate(args, big)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, threads={torch.get_num_threads()}"
    print(f"\n[trainer] {args.model} {' '.join(args.kwargs)} {args.img}x{args.img}, {where}, amp={args.amp}, "
          f"median of {args.window}-step windows")
    # the trainer counts a step's batch (B: every member sees B images), the backbone runs M·B rows
    print(f"  trainer σN-Ens M={args.members}, batch {args.batch}: {sigma * args.members:9.1f} img/s through the "
          f"backbone ({sigma:.1f} batch images/s)")
    print(f"  trainer single, batch {big}:{' ' * (len(str(args.members)) + 4)}{single:9.1f} img/s")
    print(f"  bare loop single, batch {big}:{' ' * (len(str(args.members)) + 2)}{bare:9.1f} img/s")
    print(f"  σN-Ens / single (trainer) = {sigma * args.members / single:.2f}x images/s (goal ≥ 0.87x);  "
          f"trainer / bare loop = {single / bare:.2f}x (goal ≥ 0.95x)")


if __name__ == "__main__":
    main()
