"""σNorm core benchmarks; every number is a ratio against a baseline measured in the same run.

    python bench/bench_core.py            # all four
    python bench/bench_core.py --only step --model resnet18 --batch 32 --img 32
    python bench/bench_core.py --only step --device cuda --amp bf16 --batch 128 --img 64      (on a GPU)

1. train step (forward + backward + SGD) of σN-Ens(M) at batch B vs the plain backbone at batch M·B (equal FLOPs;
   goal ≤ 1.15×) and vs a naive loop over M separate member copies at batch B (must be slower than σN-Ens);
2. host cost: fwd+bwd of 40 tiny BatchNorm layers, σN-Ens(M) / plain (goal ≤ 1.5× at M=16): what a launch-bound
   accelerator pays per op;
3. ``diversity_loss`` fused (one op over the flat (M, F) view) vs a loop over layers, ResNet-50 size, M=16 (goal ≥ 5×);
4. parameters of σN-Ens(M) / single model (a Deep Ensemble is M×).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import timm
import torch
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble, diversity_loss


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 2,
                 device: torch.device | None = None) -> dict[str, float]:
    """Median seconds per call; calls alternate between candidates so machine noise hits all of them alike (on a GPU
    each call is timed to its kernels' end)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _sgd_step(model: nn.Module, params: list[nn.Parameter], loss_fn: Callable[[], torch.Tensor],
              amp: torch.dtype | None = None) -> Callable[[], None]:
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    device = params[0].device

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
            loss = loss_fn()
        loss.backward()
        opt.step()

    return step


def bench_step(model_name: str, m: int, batch: int, img: int, repeats: int, device: torch.device,
               amp: torch.dtype | None, compile_models: bool = False, channels_last: bool = False,
               kwargs: dict[str, int | float | str] | None = None) -> None:
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    src = timm.create_model(model_name, num_classes=10, **(kwargs or {})).train()
    ens = convert_to_sigma_ensemble(copy.deepcopy(src), m).train().to(device, memory_format=fmt)
    members = [copy.deepcopy(src).train().to(device, memory_format=fmt) for _ in range(m)]
    src = src.to(device, memory_format=fmt)
    if compile_models:  # the trainer's train.compile; the member loop is left out (M more compilations)
        src.compile()
        ens.compile()
    x = torch.randn(batch, 3, img, img, device=device).contiguous(memory_format=fmt)
    xb = torch.randn(m * batch, 3, img, img, device=device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,), device=device)
    yb = torch.randint(0, 10, (m * batch,), device=device)
    ce = nn.functional.cross_entropy

    def ens_loss() -> torch.Tensor:
        logits = ens(x)
        return ce(logits.flatten(0, 1), y.repeat(m)) + 1e-3 * ens.diversity_loss(0.5)

    fns = {
        f"plain backbone, batch {m * batch}": _sgd_step(src, list(src.parameters()), lambda: ce(src(xb), yb), amp),
        f"σN-Ens M={m}, batch {batch}": _sgd_step(ens, list(ens.parameters()), ens_loss, amp),
    }
    if not compile_models:
        fns[f"loop over {m} member copies, batch {batch}"] = _sgd_step(
            members[0], [p for mm in members for p in mm.parameters()], lambda: sum(ce(mm(x), y) for mm in members),
            amp)
    peak = {k: _peak_memory(fn, device) for k, fn in fns.items()}  # each alone, before the timing (its warm-up)
    t = _interleaved(fns, repeats, warmup=3 if compile_models else 2, device=device)
    base = next(iter(t.values()))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, threads={torch.get_num_threads()}"
    print(f"\n[train step] {model_name} {img}x{img}, {where}, amp={amp}, compile={compile_models}, "
          f"{'channels_last' if channels_last else 'NCHW'}, median of {repeats}")
    for k, v in t.items():
        mem = "" if peak[k] is None else f"   peak {peak[k] / 2**30:6.2f} GiB"
        print(f"  {k:40s} {v * 1e3:8.1f} ms   ratio vs plain {v / base:5.2f}x{mem}")
    names = list(t)
    print(f"  σN-Ens / plain = {t[names[1]] / t[names[0]]:.2f}x (goal ≤ 1.15x)"
          + (f";  member loop / σN-Ens = {t[names[2]] / t[names[1]]:.2f}x (goal > 1)" if len(names) > 2 else ""))


def _peak_memory(fn: Callable[[], None], device: torch.device) -> int | None:
    """Peak accelerator memory of one call (None on the CPU, where the allocator keeps no such count)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def bench_host(m: int, repeats: int, layers: int = 40) -> None:
    """Host cost: forward + backward of ``layers`` tiny BatchNorm2d layers on a few pixels, where the math is nearly
    nothing and most of the time is dispatch overhead (what a GPU step of small norms pays): σN-Ens(M) on 2 images per
    member against the plain stack on as many rows."""
    plain = nn.Sequential(*[nn.BatchNorm2d(8) for _ in range(layers)]).train()
    ens = convert_to_sigma_ensemble(copy.deepcopy(plain), m).train()
    x = torch.randn(2 * m, 8, 2, 2, requires_grad=True)

    def plain_pass() -> None:
        plain(x).sum().backward()

    def sigma_pass() -> None:
        ens.forward_members(x).sum().backward()

    t = _interleaved({"plain": plain_pass, "sigma": sigma_pass}, repeats, warmup=5)
    print(f"\n[host cost] {layers} BatchNorm2d(8) layers on {2 * m}×8×2×2, fwd+bwd, median of {repeats}")
    print(f"  plain {t['plain'] * 1e3:7.2f} ms   σN-Ens M={m} {t['sigma'] * 1e3:7.2f} ms   "
          f"ratio {t['sigma'] / t['plain']:.2f}x (goal ≤ 1.5x at M=16)")


def bench_regularizer(model_name: str, m: int, repeats: int) -> None:
    ens = convert_to_sigma_ensemble(timm.create_model(model_name), m)
    layers = [layer for _, layer in ens.sigma_layers()]

    def fused() -> None:
        ens.sigma.flat.grad = None
        diversity_loss(ens.gamma(), 0.5).backward()

    def loop() -> None:
        ens.sigma.flat.grad = None
        sum(diversity_loss(layer.gamma, 0.5) for layer in layers).backward()

    t = _interleaved({"per-layer loop": loop, "fused": fused}, repeats)
    print(f"\n[diversity_loss fwd+bwd] {model_name}: {len(layers)} layers, {ens.gamma().shape[1]} features, M={m}")
    print(f"  per-layer loop {t['per-layer loop'] * 1e3:7.2f} ms   fused {t['fused'] * 1e3:7.2f} ms   "
          f"speed-up {t['per-layer loop'] / t['fused']:.1f}x (goal ≥ 5x)")


def bench_params(names: list[str], ms: list[int]) -> None:
    print("\n[parameters]  σN-Ens(M) / single model   (a Deep Ensemble is M×)")
    for name in names:
        src = timm.create_model(name)
        n = sum(p.numel() for p in src.parameters())
        cells = []
        for m in ms:
            ens = convert_to_sigma_ensemble(src, m)
            cells.append(f"M={m}: {sum(p.numel() for p in ens.parameters()) / n:.4f}x")
        print(f"  {name:22s} {n / 1e6:7.2f}M   " + "   ".join(cells))


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["step", "host", "reg", "params"])
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--img", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 … (the train-step benchmark)")
    ap.add_argument("--amp", choices=["none", "bf16"], default="none", help="autocast of the train-step benchmark")
    ap.add_argument("--compile", action="store_true", help="torch.compile the plain backbone and σN-Ens")
    ap.add_argument("--channels-last", action="store_true", help="models and inputs in channels_last memory format")
    ap.add_argument("--kwargs", nargs="*", default=[], help="timm.create_model kwargs as key=value (img_size=32 …)")
    args = ap.parse_args()
    if args.only in (None, "step"):
        bench_step(args.model, args.members, args.batch, args.img, args.repeats, torch.device(args.device),
                   torch.bfloat16 if args.amp == "bf16" else None, args.compile, args.channels_last,
                   {k: _number(v) for k, v in (kv.split("=", 1) for kv in args.kwargs)})
    if args.only in (None, "host"):
        bench_host(args.members, args.repeats * 20)
    if args.only in (None, "reg"):
        bench_regularizer("resnet50", 16, args.repeats * 5)
    if args.only in (None, "params"):
        bench_params(["resnet50", "wide_resnet50_2", "vit_tiny_patch16_224"], [4, 16])


if __name__ == "__main__":
    main()
