"""Strategies side by side at 2 processes on CPU (gloo): step time relative to DDP, parameter + gradient +
optimiser bytes held per rank, and checkpoint save / load time relative to ``torch.save`` / ``torch.load`` of the
full state.

    OMP_NUM_THREADS=1 python bench/bench_strategies.py [--depth 6 --dim 192 --members 4 --batch 8 --steps 8]

It launches itself under torchrun (2 processes). Bytes are what each rank holds in tensors after a step (parameters
as stored: a shard under FSDP2 and ZeRO-3; gradients right after backward, including ZeRO's partitioned gradient
buffers; optimiser state including ZeRO's fp32 partitions of the parameters).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent


def _local(t: torch.Tensor | None) -> int:
    """Bytes this rank stores for ``t`` (a DTensor's local shard, a ZeRO-3 parameter's partition)."""
    if t is None:
        return 0
    if hasattr(t, "ds_tensor"):
        t = t.ds_tensor
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _zero_grad_bytes(strategy) -> int:
    """ZeRO keeps reduced gradients in its own partition buffers instead of ``param.grad``: ZeRO-3 in one flat
    buffer (``averaged_gradients`` are views of it), ZeRO-1/2 in ``averaged_gradients``."""
    opt = getattr(getattr(strategy, "engine", None), "optimizer", None)
    flat = getattr(opt, "grad_partitions_flat_buffer", None)
    if isinstance(flat, torch.Tensor):
        return flat.numel() * flat.element_size()
    grads = getattr(opt, "averaged_gradients", None) or {}
    return sum(t.numel() * t.element_size() for item in grads.values() for t in item if isinstance(t, torch.Tensor))


def _zero_master_bytes(strategy) -> int:
    """ZeRO's fp32 partitions of the parameters (the tensors its wrapped optimiser steps)."""
    opt = strategy.engine.optimizer
    groups = getattr(opt, "fp32_partitioned_groups_flat", None)  # ZeRO-3
    if groups is None:
        groups = getattr(opt, "single_partition_of_fp32_groups", [])  # ZeRO-1/2
    return sum(t.numel() * t.element_size() for t in groups)


def _run(name: str, args: argparse.Namespace, env, out: dict) -> None:
    from sigmanens_dist import convert_to_sigma_ensemble
    from sigmanens_dist.distributed.strategies import build_strategy
    from sigmanens_dist.distributed.strategies.base import FOLDER_KEY

    stage = int(name[-1]) if name.startswith("zero") else None
    options = {"zero_stage": stage, "per_rank_batch": args.batch} if stage else {}
    strategy = build_strategy("deepspeed" if stage else name, env, options=options)
    torch.manual_seed(0)
    model = convert_to_sigma_ensemble(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4,
                                                        depth=args.depth, embed_dim=args.dim, num_heads=3,
                                                        num_classes=10), args.members)
    wrapped = strategy.wrap(model)
    opt = strategy.build_optimizer([{"params": list(model.parameters())}],
                                   lambda g: torch.optim.AdamW(g, lr=1e-4))
    gen = torch.Generator().manual_seed(env.rank)
    x, y = torch.randn(args.batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
    times, grad_bytes = [], 0
    for i in range(args.steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        with strategy.micro_batch(True):
            loss = F.cross_entropy(wrapped(x).flatten(0, 1), y.repeat(args.members))
            strategy.backward(loss + 0.01 * model.diversity_loss(0.5))
        if i == 0:
            grad_bytes = sum(_local(p.grad) for p in model.parameters()) + _zero_grad_bytes(strategy)
        strategy.step(None)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    params = sum(_local(p) for p in model.parameters())
    optim = sum(_local(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    if stage:
        optim += _zero_master_bytes(strategy)
    folder = Path(args.tmp) / name
    folder.mkdir(exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    if strategy.checkpoint_format == "file":
        if env.is_main:
            torch.save(strategy.state_dict(), folder / "full.pt")
    else:
        strategy.save_shards(folder)
    dist.barrier()
    save = time.perf_counter() - t0
    t0 = time.perf_counter()
    if strategy.checkpoint_format == "file":
        strategy.load_state_dict(torch.load(folder / "full.pt", weights_only=False))
    else:
        strategy.load_state_dict({FOLDER_KEY: folder, "format": strategy.checkpoint_format,
                                  "rng": [None] * env.world_size})
    dist.barrier()
    load = time.perf_counter() - t0
    out[name] = {"step": statistics.median(times), "params": params, "grads": grad_bytes, "optim": optim,
                 "save": save, "load": load}


def worker(args: argparse.Namespace) -> None:
    from sigmanens_dist.distributed.env import init_distributed

    env = init_distributed("gloo")
    names = ["ddp", "fsdp"]
    try:
        import deepspeed  # noqa: F401

        names += ["zero1", "zero2", "zero3"]
    except ImportError:
        pass
    out: dict = {}
    for name in names:
        _run(name, args, env, out)
    if env.is_main:
        base = out["ddp"]
        total = lambda r: r["params"] + r["grads"] + r["optim"]  # noqa: E731
        print(f"vit depth={args.depth} dim={args.dim}, M={args.members}, batch {args.batch}/rank, 2 ranks (gloo), "
              f"median of {args.steps} steps; bytes per rank (MB); save/load vs torch.save/torch.load of the full "
              "state (the DDP row)")
        print(f"  {'strategy':8s} {'step':>7s} {'vs ddp':>7s} {'params':>7s} {'grads':>7s} {'optim':>7s} "
              f"{'total':>7s} {'vs ddp':>7s} {'save':>7s} {'load':>7s}")
        for name, r in out.items():
            print(f"  {name:8s} {r['step'] * 1e3:6.0f}ms {r['step'] / base['step']:6.2f}x "
                  f"{r['params'] / 1e6:7.2f} {r['grads'] / 1e6:7.2f} {r['optim'] / 1e6:7.2f} {total(r) / 1e6:7.2f} "
                  f"{total(r) / total(base):6.2f}x {r['save'] / base['save']:6.2f}x {r['load'] / base['load']:6.2f}x")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29655",
               __file__, "--worker", "--tmp", tmp, *sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        sys.exit(subprocess.run(cmd, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
