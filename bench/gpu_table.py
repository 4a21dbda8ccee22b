"""The accelerator table of bench/gpu_check.sh: every row of a part in one process, printed as it goes.

    python bench/gpu_table.py --part eager --summary OUT.md                 (on a GPU: the sizes below)
    python bench/gpu_table.py --part eager --summary OUT.md --device cpu    (smoke sizes, the same code)

Each row is bench_core's train step in bf16 (plain backbone at M·B rows, σN-Ens(M) at B per member, a loop over
M member copies), at a fixed number of rows per step whatever M (so M=16 needs no more activation memory than M=4).
A row or candidate that runs out of memory is printed as ``OOM`` and the rest go on; one process for all rows
spares each its start-up. ``eager``: every model at M = 4 and 16, NCHW and (convolutional ones) channels_last, then
σN-Ens and plain each in its fastest format, and the top-10 kernels of one step of each for ResNet-50 and ViT-Ti at
M=4. ``compiled``: ResNet-50 and ViT-Ti at M=4 under torch.compile, with each compilation's seconds.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_core import StepResult, measure, step_candidates, top_ops  # bench/ is the script's folder: on sys.path


@dataclass(frozen=True)
class Model:
    """A row's model: timm name, image size, rows per step (fixed across M) and timm kwargs."""

    name: str
    img: int
    rows: int
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def conv(self) -> bool:
        return not self.name.startswith("vit")


# 1,024 rows of ResNet-50 at 224² in bf16 is about 45 GiB of saved activations; ViT-S less (fused attention).
GPU = [Model("resnet18", 32, 2048), Model("resnet50", 224, 1024), Model("vit_tiny_patch16_224", 224, 1024),
       Model("vit_small_patch16_224", 224, 1024)]
SMOKE_VIT = {"img_size": 16, "patch_size": 8, "depth": 1}
CPU = [Model("resnet18", 8, 32), Model("resnet50", 8, 32, {"layers": (1, 1, 1, 1)}),  # one block per stage
       Model("vit_tiny_patch16_224", 16, 32, SMOKE_VIT), Model("vit_small_patch16_224", 16, 32, SMOKE_VIT)]
PROFILED = ("resnet50", "vit_tiny_patch16_224")  # at M=4, NCHW: the top-10 kernels of σN-Ens and plain
COMPILED = ("vit_tiny_patch16_224", "resnet50")  # at M=4, NCHW; the quicker compilation first
MEMBERS = (4, 16)
ROLES = ("plain", "σN-Ens", "loop")

HEADER = ("| model | M | rows (B per member) | format | plain ms | σN-Ens ms | loop ms | σN-Ens / plain "
          "| loop / σN-Ens | peak plain GiB | peak σN-Ens GiB | peak loop GiB | first call plain / σN-Ens s |")


class Table:
    """Rows printed as they come and appended to the summary file (flushed: a part cut short keeps its rows);
    profiles printed at once and kept for the summary's end (a table interrupted by them would end there)."""

    def __init__(self, summary: Path) -> None:
        self.summary = summary
        self.profiles: list[str] = []

    def out(self, line: str = "", echo: bool = True) -> None:
        if echo:
            print(line, flush=True)
        with self.summary.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


def _ms(r: StepResult, label: str | None) -> str:
    if label is None:
        return "—"
    if label in r.failed:
        return "OOM"
    return f"{r.seconds[label] * 1e3:.1f}"


def _gib(r: StepResult, label: str | None) -> str:
    if label is None or label in r.failed:
        return "—"
    peak = r.peak[label]
    return "n/a" if peak is None else f"{peak / 2**30:.2f}"


def _ratio(r: StepResult, a: str | None, b: str | None) -> str:
    if a is None or b is None or a not in r.seconds or b not in r.seconds:
        return "—"
    return f"{r.seconds[a] / r.seconds[b]:.2f}×"


def _row(model: Model, m: int, fmt: str, r: StepResult, labels: list[str]) -> str:
    plain, sigma, loop = (labels + [None] * 3)[:3]
    first = " / ".join(f"{r.first[k]:.1f}" if k in r.first else "—" for k in (plain, sigma))
    return (f"| {model.name} {model.img}² | {m} | {model.rows} ({model.rows // m}) | {fmt} | {_ms(r, plain)} | "
            f"{_ms(r, sigma)} | {_ms(r, loop)} | {_ratio(r, sigma, plain)} | {_ratio(r, loop, sigma)} | "
            f"{_gib(r, plain)} | {_gib(r, sigma)} | {_gib(r, loop)} | {first} |")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_row(table: Table, model: Model, m: int, fmt: str, compiled: bool, args: argparse.Namespace,
            profile: bool = False) -> dict[str, float]:
    """One row: its line in the table (``OOM`` or the error where it failed); returns the seconds per role."""
    device = torch.device(args.device)
    try:
        return _measure_row(table, model, m, fmt, compiled, device, args.repeats, args.warmup, profile)
    except torch.cuda.OutOfMemoryError as err:
        note = "OOM: " + str(err).split("\n")[0][:100]
    except Exception as err:  # a broken row must not cost the others: named in its row, and the part fails
        note = f"FAIL {type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"
        args.failed = True
    finally:  # the row's models, optimisers and activations (its frame, or the traceback's) go before the next
        _free(device)
    table.out(f"| {model.name} {model.img}² | {m} | {model.rows} ({model.rows // m}) | {fmt} | {note} "
              "| | | | | | | | |")
    return {}


def _measure_row(table: Table, model: Model, m: int, fmt: str, compiled: bool, device: torch.device, repeats: int,
                 warmup: int, profile: bool) -> dict[str, float]:
    amp = torch.bfloat16 if device.type == "cuda" else None
    cands = step_candidates(model.name, m, model.rows // m, model.img, device, amp, compiled, fmt == "channels_last",
                            dict(model.kwargs))
    labels = [c.label for c in cands]
    r = measure(cands, repeats, device, warmup=warmup)
    table.out(_row(model, m, fmt, r, labels))
    if profile:
        for c in cands[:2]:
            if c.label not in r.failed:
                text = (f"\ntop-10 {'kernels' if device.type == 'cuda' else 'ops'} by self time, one step of "
                        f"{c.label} ({model.name} {model.img}², {fmt}):\n```\n" + "\n".join(top_ops(c.step, device))
                        + "\n```")
                print(text, flush=True)
                table.profiles.append(text)
    return {role: r.seconds[label] for role, label in zip(ROLES, labels, strict=False) if label in r.seconds}


def _models(args: argparse.Namespace, names: tuple[str, ...] | None = None) -> list[Model]:
    """The part's models at the device's sizes, cut to ``--models`` when given; only ``names``, in their order,
    when given."""
    models = [m for m in (CPU if args.device == "cpu" else GPU) if not args.models or m.name in args.models]
    if names is None:
        return models
    return sorted((m for m in models if m.name in names), key=lambda m: names.index(m.name))


def eager(table: Table, args: argparse.Namespace) -> None:
    models = _models(args)
    best: list[str] = []
    table.out(HEADER)
    table.out("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        for m in MEMBERS:
            seconds = {}
            for fmt in ("nchw", "channels_last") if model.conv else ("nchw",):
                profile = model.name in PROFILED and m == 4 and fmt == "nchw"
                seconds[fmt] = run_row(table, model, m, fmt, False, args, profile)
            best.append(_best(model, m, seconds))
    table.out("\nσN-Ens in its fastest format against the plain backbone in its fastest (eager, same rows per step):\n")
    table.out("| model | M | plain best | σN-Ens best | σN-Ens / plain, best vs best |")
    table.out("|---|---:|---:|---:|---:|")
    for line in best:
        table.out(line)
    for text in table.profiles:
        table.out(text, echo=False)  # printed when measured


def _best(model: Model, m: int, seconds: dict[str, dict[str, float]]) -> str:
    """The best-format line of one (model, M): each role's fastest format and the ratio of the two."""
    picks = {}
    for role in ROLES[:2]:
        timed = {fmt: s[role] for fmt, s in seconds.items() if role in s}
        picks[role] = min(timed.items(), key=lambda kv: kv[1]) if timed else None
    cells = [f"{p[1] * 1e3:.1f} ms ({p[0]})" if p else "OOM" for p in picks.values()]
    plain, sigma = picks["plain"], picks["σN-Ens"]
    ratio = f"{sigma[1] / plain[1]:.2f}×" if plain and sigma else "—"
    return f"| {model.name} {model.img}² | {m} | {cells[0]} | {cells[1]} | {ratio} |"


def compiled(table: Table, args: argparse.Namespace) -> None:
    models = _models(args, COMPILED)
    table.out(HEADER)
    table.out("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in models:
        begin = time.perf_counter()
        run_row(table, model, 4, "nchw", True, args)
        print(f"  ({model.name} compiled and timed in {time.perf_counter() - begin:.0f} s; the first call of each "
              "candidate is its compilation)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["eager", "compiled"], required=True)
    ap.add_argument("--summary", type=Path, required=True, help="markdown file the rows are appended to")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--models", type=lambda text: [n for n in text.split(",") if n], default=[],
                    help="comma-separated timm names: only these rows (a rerun of some)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per candidate (default: 5; CPU 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default: 2; CPU 0)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.repeats = args.repeats if args.repeats is not None else (1 if cpu else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if cpu else 2)
    args.failed = False
    if cpu:
        torch.set_num_threads(1)  # smoke sizes: more threads only add contention on a shared machine
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    (eager if args.part == "eager" else compiled)(Table(args.summary), args)
    sys.exit(1 if args.failed else 0)


if __name__ == "__main__":
    main()
