"""Prediction speed (docs/benchmarks.md "Prediction"): the same ensemble head called eagerly, as the exported
``torch.export`` program and as the ONNX program in onnxruntime, at several batch sizes, σN-Ens against the single
model of the same backbone; every number a ratio to a baseline measured in the same run.

    OMP_NUM_THREADS=1 python bench/bench_predict.py                        # the recipe of the long runs, ~3 min
    OMP_NUM_THREADS=1 python bench/bench_predict.py --batches 1 32 --members 4 8 --seconds 1

The model is the recipe's (``--config``, default configs/fmnist_small.yaml: timm's test_resnet on 28×28 grayscale,
10 classes) at its initial weights (speed does not depend on training), inside the head ``sigmanens export
--program`` writes (:class:`~sigmanens_dist.export.program.ProgramHead`: normalisation, member softmaxes, entropy,
mutual information, disagreement). Inputs are random [0, 1] images already in memory: this is the program's cost,
not decoding's. Each cell is images/s, the best of ``--repeats`` timed windows of ``--seconds`` each on one thread
(``torch.set_num_threads(1)``, onnxruntime with one intra-op thread).

``--end-to-end`` measures instead what ``sigmanens predict`` adds to the program (issue 53): the recipe's σN-Ens at
its initial weights exported by ``sigmanens export --program`` as ``.pt2`` and as ``.onnx``, and ``--images`` test
images of the recipe's dataset (Fashion-MNIST's test set when installed, else generated) written as PNG files. For
each format, alternating ``--repeats`` times, the raw rate (the loaded program called on the same images already
decoded and stacked into batches of ``--batch``) and :func:`sigmanens_dist.predict.predict` over the folder (reading,
decoding, the program, the parquet parts; its summary's images/s, and the whole call's with loading and the shape
check), the best of each, as a ratio to the raw rate of the same run:

    python bench/bench_predict.py --end-to-end --threads 1               # ~1 min
    python bench/bench_predict.py --end-to-end --threads 0 --images 5000   # torch's default threads
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def rate(call: Callable[[torch.Tensor], object], batch: torch.Tensor, seconds: float, repeats: int) -> float:
    """Images per second of ``call(batch)``: the best of ``repeats`` windows of at least ``seconds`` each."""
    call(batch)  # warm-up: first-call allocations, onnxruntime's arena
    best = 0.0
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            call(batch)
            calls += 1
        best = max(best, calls * len(batch) / elapsed)
    return best


def backends(head: torch.nn.Module, example: torch.Tensor, folder: Path) -> dict[str, Callable[[torch.Tensor], object]]:
    """The head as eager module, loaded .pt2 program and onnxruntime session."""
    import onnxruntime

    from sigmanens_dist.export.program_file import write_program
    from sigmanens_dist.program_meta import METADATA_FILE

    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(head, (example,), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, folder / "head.pt2")
    loaded = torch.export.load(folder / "head.pt2").module()
    write_program(head, example, (METADATA_FILE, "{}"), 1, "onnx", folder / "head.onnx")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
    session = onnxruntime.InferenceSession(str(folder / "head.onnx"), options, providers=["CPUExecutionProvider"])

    def eager(x: torch.Tensor) -> object:
        with torch.no_grad():
            return head(x)

    def exported(x: torch.Tensor) -> object:
        with torch.no_grad():
            return loaded(x)

    return {"eager": eager, "torch program": exported,
            "onnxruntime": lambda x: session.run(None, {"images": x.numpy()})}


def head_for(config: Path, method: str, members: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The recipe's model of ``method`` at ``members`` inside the program head, and an example batch."""
    from sigmanens_dist.catalog.datasets import DATASETS
    from sigmanens_dist.config import load_config
    from sigmanens_dist.export.program import ProgramHead
    from sigmanens_dist.models import build_model

    cfg = load_config(config, [f"model.method={method}", f"model.num_members={members}", "tracking.enabled=false"],
                      check_data=False)
    spec = DATASETS[cfg.data.dataset]
    chans, size = len(spec.mean), cfg.data.img_size or spec.size
    torch.manual_seed(0)
    model = build_model(cfg, len(spec.classes) or 10, chans).eval()
    return ProgramHead(model, spec.mean, spec.std, 1.0).eval(), torch.rand(2, chans, size, size)


def programs_for(config: Path, members: int, folder: Path) -> dict[str, Path]:
    """The recipe's σN-Ens of ``members`` at its initial weights as a checkpoint the trainer could have written,
    exported by ``sigmanens export --program`` as a ``.pt2`` and an ``.onnx``."""
    from sigmanens_dist.catalog.datasets import DATASETS
    from sigmanens_dist.config import load_config
    from sigmanens_dist.export.program import export_program
    from sigmanens_dist.models import build_model, load_trained

    run = folder / "run"
    cfg = load_config(config, [f"model.num_members={members}", "tracking.enabled=false", f"run_dir={run}"])
    spec = DATASETS[cfg.data.dataset]
    num_classes, chans = len(spec.classes) or 10, len(spec.mean)
    torch.manual_seed(0)
    model = build_model(cfg, num_classes, chans)
    ckpt = run / "checkpoints" / "step_00000000.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "position": {"step": 0, "epoch": 0, "batch": 0},
                "config": cfg.model_dump(mode="json"),
                "model_args": {"num_classes": num_classes, "in_chans": chans, "vocab_size": None}}, ckpt)
    paths = {"pt2": folder / "model.pt2", "onnx": folder / "model.onnx"}
    for fmt, path in paths.items():
        export_program(load_trained(ckpt), path, fmt="torch" if fmt == "pt2" else "onnx")
    return paths


def image_files(folder: Path, count: int, chw: tuple[int, int, int]) -> str:
    """``count`` PNG files in ``folder``: Fashion-MNIST's first test images when the shape is theirs and the
    dataset is installed, else uniform noise; what was written, in words."""
    import gzip

    import numpy as np
    from PIL import Image

    chans, height, width = chw
    source = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
    if chw == (1, 28, 28) and source.is_file():
        with gzip.open(source) as f:
            pixels = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:count]
        what = f"the first {len(pixels):,} Fashion-MNIST test images"
    else:
        shape = (count, height, width) if chans == 1 else (count, height, width, chans)
        pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        what = f"{count:,} {width}×{height} images of uniform noise"
    folder.mkdir()
    for i, image in enumerate(pixels):
        Image.fromarray(image).save(folder / f"{i:06d}.png")
    return what + " as PNG files"


def raw_rate(program: Callable[[torch.Tensor], object], batches: list[torch.Tensor]) -> float:
    """Images per second of ``program`` over ``batches``, once."""
    start = time.perf_counter()
    for batch in batches:
        program(batch)
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def end_to_end(args: argparse.Namespace) -> None:
    """Raw program rate against ``predict``'s over the same image files, both formats, alternating runs."""
    import shutil

    from sigmanens_dist.predict import predict
    from sigmanens_dist.predict.backends import load_program
    from sigmanens_dist.predict.inputs import decode, discover, read_unit

    logging.getLogger("sigmanens").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = programs_for(args.config, args.members[0], root)
        rows = []
        for fmt, path in paths.items():
            program = load_program(path, torch.device("cpu"))
            chw = tuple(program.meta.input.chw)
            if fmt == "pt2":
                what = image_files(root / "images", args.images, chw)
            samples = [s for u in discover([root / "images"], 1024) for s in read_unit(u)]
            images = [torch.from_numpy(decode(s, chw[0], chw[1:])).float().div_(255) for s in samples]
            batches = [torch.stack(images[i:i + args.batch]) for i in range(0, len(images), args.batch)]
            program(batches[0])  # warm-up: first-call allocations, onnxruntime's arena
            raw = loop = whole = 0.0
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:  # the program beside one busy process: what a second core leaves it
                beside = max(raw_rate(program, batches) for _ in range(args.repeats))
            finally:
                busy.kill()
                busy.wait()
            for repeat in range(args.repeats):
                this = raw_rate(program, batches)
                raw = max(raw, this)
                out = root / f"out-{fmt}-{repeat}"
                start = time.perf_counter()
                summary = predict(path, [root / "images"], out, batch_size=args.batch, device="cpu")
                whole = max(whole, len(images) / (time.perf_counter() - start))
                loop = max(loop, summary["throughput"]["images_per_s"])
                assert summary["predicted"] == len(images), summary["skipped_inputs"][:3]
                shutil.rmtree(out)
                print(f"{fmt} repeat {repeat}: raw {this:,.0f}, "
                      f"predict {summary['throughput']['images_per_s']:,.0f} images/s", flush=True)
            rows.append((fmt, raw, loop, whole, beside))
    threads = f"{torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)}"
    print(f"\nimages/s, {what}, batch {args.batch}, σN-Ens M={args.members[0]}, the program on {threads} "
          f"(onnxruntime's intra-op threads too), predict's decoding pool of {min(8, os.cpu_count() or 1)}; "
          f"best of {args.repeats}")
    print("| program | raw program | predict | predict / raw | predict with loading and checks | / raw "
          "| raw beside a busy process | / raw |", "|---|---:|---:|---:|---:|---:|---:|---:|", sep="\n")
    for fmt, raw, loop, whole, beside in rows:
        print(f"| .{fmt} | {raw:,.0f} | {loop:,.0f} | {loop / raw:.2f}× | {whole:,.0f} | {whole / raw:.2f}× "
              f"| {beside:,.0f} | {beside / raw:.2f}× |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "fmnist_small.yaml")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--members", type=int, nargs="+", default=[4])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--end-to-end", action="store_true",
                    help="the raw program against sigmanens predict over the same image files, .pt2 and .onnx")
    ap.add_argument("--images", type=int, default=2000, help="--end-to-end: how many image files")
    ap.add_argument("--batch", type=int, default=64, help="--end-to-end: the batch size of both")
    ap.add_argument("--threads", type=int, default=1,
                    help="the program's intra-op threads (torch and onnxruntime); 0: torch's default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.end_to_end:
        end_to_end(args)
        return
    grid = [("single", 1), *(("sigma", m) for m in args.members)]
    rates: dict[tuple[str, int, str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method, members in grid:
            head, example = head_for(args.config, method, members)
            folder = Path(tmp) / f"{method}{members}"
            folder.mkdir()
            for name, call in backends(head, example, folder).items():
                for b in args.batches:
                    x = torch.rand(b, *example.shape[1:])
                    rates[method, members, name, b] = rate(call, x, args.seconds, args.repeats)
                    print(f"{method} M={members} {name} batch {b}: {rates[method, members, name, b]:,.0f} images/s",
                          flush=True)
    names = ["eager", "torch program", "onnxruntime"]
    print("\nimages/s (one thread), and each σN-Ens cell as a ratio to the single model's in the same column; the "
          "program columns also as a ratio to eager")
    head = "| model | batch | " + " | ".join(names) + " | torch program / eager | onnxruntime / eager |"
    print(head, "|---|---:|" + "---:|" * (len(names) + 2), sep="\n")
    for method, members in grid:
        for b in args.batches:
            cells = []
            for name in names:
                r = rates[method, members, name, b]
                ref = rates["single", 1, name, b]
                cells.append(f"{r:,.0f}" + ("" if method == "single" else f" ({r / ref:.2f}×)"))
            eager = rates[method, members, "eager", b]
            cells += [f"{rates[method, members, n, b] / eager:.2f}×" for n in names[1:]]
            label = "single model" if method == "single" else f"σN-Ens M={members}"
            print(f"| {label} | {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
