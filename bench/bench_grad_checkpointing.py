"""Activation memory and step time of ``train.grad_checkpointing`` against the same σN-Ens without it, in one run.

    OMP_NUM_THREADS=1 python bench/bench_grad_checkpointing.py [--depth 6 --dim 192 --members 4 --batch 8 --steps 5]

Activation memory is counted exactly and device-independently: the bytes of every tensor autograd saves for
backward during one forward pass (``torch.autograd.graph.saved_tensors_hooks``), which is what checkpointing trades
for recomputation. With checkpointing that is the blocks' inputs; backward then recomputes one block at a time, so
the peak adds about one block's activations (1/depth of the plain figure) to it. Step time is the median forward +
backward + SGD step over ``--steps`` steps after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from sigmanens_dist.config import load_config
from sigmanens_dist.models import build_model


def _model(args: argparse.Namespace, checkpointing: bool) -> torch.nn.Module:
    cfg = load_config(None, ["model.name=vit_tiny_patch16_224", f"model.kwargs.depth={args.depth}",
                             f"model.kwargs.embed_dim={args.dim}", "model.kwargs.num_heads=3",
                             "model.kwargs.img_size=32", "model.kwargs.patch_size=4",
                             f"model.num_members={args.members}", f"train.grad_checkpointing={checkpointing}",
                             "data.dataset=synthetic"])
    torch.manual_seed(0)
    return build_model(cfg, num_classes=10, in_chans=3).train()


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x).sum()
    out.backward()
    return total


def _step_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        logits = model(x)  # (M, B, K)
        loss = F.cross_entropy(logits.flatten(0, 1), y.repeat(logits.shape[0]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    rows = {}
    for checkpointing in (False, True):
        model = _model(args, checkpointing)
        rows[checkpointing] = (_saved_bytes(model, x), _step_seconds(model, x, y, args.steps))
    (base_mem, base_t), (ck_mem, ck_t) = rows[False], rows[True]
    print(f"σN-Ens ViT depth={args.depth} dim={args.dim} M={args.members} batch={args.batch} (32×32), "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'':24}{'saved for backward':>20}{'step s':>10}")
    print(f"{'no checkpointing':24}{base_mem / 2**20:>16.1f} MiB{base_t:>10.3f}")
    print(f"{'grad_checkpointing':24}{ck_mem / 2**20:>16.1f} MiB{ck_t:>10.3f}")
    print(f"ratio (checkpointing / none): activation memory {ck_mem / base_mem:.2f}×, step time {ck_t / base_t:.2f}×")


if __name__ == "__main__":
    main()
