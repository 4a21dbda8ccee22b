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
"""

from __future__ import annotations

import argparse
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

    from sigmanens_dist.export.format import METADATA_FILE
    from sigmanens_dist.export.program_onnx import write_onnx

    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(head, (example,), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, folder / "head.pt2")
    loaded = torch.export.load(folder / "head.pt2").module()
    write_onnx(head, example, (METADATA_FILE, "{}"), 1, folder / "head.onnx")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "fmnist_small.yaml")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--members", type=int, nargs="+", default=[4])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
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
