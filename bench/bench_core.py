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
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class Candidate:
    """One way to run the train step: its label, one step, and how to free its gradients (while another's memory
    is measured)."""

    label: str
    step: Callable[[], None]
    free: Callable[[], None]


@dataclass
class StepResult:
    """Per candidate label: median seconds of a step, seconds of the first call (with torch.compile: the
    compilation), and peak memory above what was allocated before it (bytes; None on the CPU); ``failed`` names
    the candidates that ran out of memory (left out of the timing)."""

    seconds: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    peak: dict[str, int | None] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def _sgd_step(label: str, model: nn.Module, params: list[nn.Parameter], loss_fn: Callable[[], torch.Tensor],
              amp: torch.dtype | None = None) -> Candidate:
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    device = params[0].device

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
            loss = loss_fn()
        loss.backward()
        opt.step()

    return Candidate(label, step, lambda: opt.zero_grad(set_to_none=True))


def step_candidates(model_name: str, m: int, batch: int, img: int, device: torch.device, amp: torch.dtype | None,
                    compile_models: bool = False, channels_last: bool = False,
                    kwargs: dict[str, int | float | str] | None = None) -> list[Candidate]:
    """The plain backbone at batch M·B, σN-Ens(M) at batch B per member, and (eager only) a loop over M member
    copies at batch B: equal FLOPs, so a ratio of their step times is the price of σN-Ens."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    src = timm.create_model(model_name, num_classes=10, **(kwargs or {})).train()
    ens = convert_to_sigma_ensemble(copy.deepcopy(src), m).train().to(device, memory_format=fmt)
    members = [] if compile_models else [copy.deepcopy(src).train().to(device, memory_format=fmt) for _ in range(m)]
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

    out = [_sgd_step(f"plain backbone, batch {m * batch}", src, list(src.parameters()), lambda: ce(src(xb), yb), amp),
           _sgd_step(f"σN-Ens M={m}, batch {batch}", ens, list(ens.parameters()), ens_loss, amp)]
    if members:
        out.append(_sgd_step(f"loop over {m} member copies, batch {batch}", members[0],
                             [p for mm in members for p in mm.parameters()],
                             lambda: sum(ce(mm(x), y) for mm in members), amp))
    return out


def measure(candidates: list[Candidate], repeats: int, device: torch.device, warmup: int = 2) -> StepResult:
    """Each candidate's first call alone (its peak memory, and its compilation when compiled; one that runs out of
    memory is left out), then the others interleaved."""
    result = StepResult()
    for c in candidates:
        for other in candidates:
            other.free()  # the others' gradients: the peak must not depend on who ran before
        try:
            result.first[c.label], result.peak[c.label] = _first_call(c.step, device)
        except torch.cuda.OutOfMemoryError as err:
            result.failed[c.label] = "OOM: " + str(err).split("\n")[0][:120]
        if c.label in result.failed:  # out of the except block: its traceback no longer holds the step's tensors
            c.free()
            _release(device)
    live = {c.label: c.step for c in candidates if c.label not in result.failed}
    result.seconds = _interleaved(live, repeats, warmup=warmup, device=device)
    return result


def bench_step(model_name: str, m: int, batch: int, img: int, repeats: int, device: torch.device,
               amp: torch.dtype | None, compile_models: bool = False, channels_last: bool = False,
               kwargs: dict[str, int | float | str] | None = None) -> StepResult:
    cands = step_candidates(model_name, m, batch, img, device, amp, compile_models, channels_last, kwargs)
    r = measure(cands, repeats, device, warmup=3 if compile_models else 2)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, threads={torch.get_num_threads()}"
    print(f"\n[train step] {model_name} {img}x{img}, {where}, amp={amp}, compile={compile_models}, "
          f"{'channels_last' if channels_last else 'NCHW'}, median of {repeats}")
    base = r.seconds.get(cands[0].label)
    for c in cands:
        if c.label in r.failed:
            print(f"  {c.label:40s} {r.failed[c.label]}")
            continue
        v, peak = r.seconds[c.label], r.peak[c.label]
        mem = "" if peak is None else f"   peak +{peak / 2**30:6.2f} GiB"
        ratio = f"   ratio vs plain {v / base:5.2f}x" if base else ""
        print(f"  {c.label:40s} {v * 1e3:8.1f} ms{ratio}{mem}   first call {r.first[c.label]:6.1f} s")
    t = [r.seconds.get(c.label) for c in cands]
    if t[0] and t[1]:
        print(f"  σN-Ens / plain = {t[1] / t[0]:.2f}x (goal ≤ 1.15x)"
              + (f";  member loop / σN-Ens = {t[2] / t[1]:.2f}x (goal > 1)" if len(t) > 2 and t[2] else ""))
    return r


def _first_call(fn: Callable[[], None], device: torch.device) -> tuple[float, int | None]:
    """Seconds of one call and its peak accelerator memory above what was allocated before it (None on the CPU,
    where the allocator keeps no such count)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, None
    _release(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start, torch.cuda.max_memory_allocated(device) - base


def _release(device: torch.device) -> None:
    """Return freed blocks to the device, so that what one candidate held does not count as another's."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def top_ops(fn: Callable[[], None], device: torch.device, n: int = 10) -> list[str]:
    """One profiled call: its ``n`` costliest kernels on a GPU (ops on the CPU) by self time, one line each."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()  # warm: no first-call allocation or autotuning in the profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        fn()
        _sync(device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    # on a GPU the kernels alone: an op that launches a kernel is given that kernel's device time too
    events = [e for e in prof.key_averages() if not cuda or e.device_type != torch.autograd.DeviceType.CPU]
    rows = sorted(events, key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in rows) or 1.0
    return [f"{getattr(e, attr) / 1e3:8.2f} ms {100 * getattr(e, attr) / total:5.1f}% {e.count:5d}x  {e.key[:90]}"
            for e in rows[:n]]


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
