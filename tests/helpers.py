"""Shared helpers for the end-to-end tests: launching training the way users do, reading what it wrote."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# A tiny LayerNorm ViT on generated 16x16 images: fast on 2 CPU cores and free of batch statistics, so runs that
# split the same global batch differently across ranks must agree.
TINY_VIT = ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=16", "model.kwargs.patch_size=4",
            "model.kwargs.depth=2", "model.kwargs.embed_dim=48", "model.kwargs.num_heads=2"]
SYNTHETIC = ["data.dataset=synthetic", "data.img_size=16", "data.train_subset=512", "data.val_subset=128",
             "data.num_workers=0"]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port())]


def train_cmd(run_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    """``python -m sigmanens_dist.train`` (one process) or under ``torchrun`` (several)."""
    launcher = [*torchrun(nproc), "-m"] if nproc > 1 else [sys.executable, "-m"]
    return [*launcher, "sigmanens_dist.train", f"run_dir={run_dir}", "tracking.enabled=false", *overrides]


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, expect: int = 0, timeout: int = 600
              ) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(run_dir, *overrides, nproc=nproc), cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{proc.stdout[-3000:]}\n" \
                                      f"{proc.stderr[-6000:]}"
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss per step from metrics.jsonl; a step logged twice (re-done after a kill) keeps its last value."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row:
            out[row["step"]] = row["train/loss"]
    return out


def final_state(run_dir: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """``part`` (model, ema, …) of the newest checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    return torch.load(ckpts[-1], map_location="cpu", weights_only=False)[part]


def interrupted(run: Path, overrides: list[str], sig: int, after_ckpt: str, nproc: int = 1) -> int:
    """Start training, send ``sig`` once ``after_ckpt`` exists, return the exit status."""
    log = run.parent / f"{run.name}.stderr"  # a file, not a pipe: an unread pipe could fill and stall the run
    with log.open("w") as f:
        proc = subprocess.Popen(train_cmd(run, *overrides, nproc=nproc), cwd=REPO, env=env(),
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / after_ckpt).exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.time() < deadline, "checkpoint never appeared"
        time.sleep(0.02)
    if sig == signal.SIGKILL:
        os.killpg(proc.pid, signal.SIGKILL)
    elif nproc == 1:
        proc.send_signal(sig)
    else:  # like a signal that reached one worker only: the others must follow
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert workers, "no torchrun workers found"
        subprocess.run(["kill", f"-{sig.name[3:]}", workers[-1]], check=True)
    proc.wait(timeout=300)
    err = log.read_text()
    if sig != signal.SIGKILL:
        assert "checkpointed at step" in err or proc.returncode != 0, err[-3000:]
    return proc.returncode
