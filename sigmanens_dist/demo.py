"""The embedded demo: a single model and σN-Ens (M=4) from the same timm backbone, trained on Fashion-MNIST under
2-process torchrun DDP on CPU, tracked in the local MLflow store, compared in a table and a reliability diagram.

    python -m sigmanens_dist.demo [--nproc 2] [--out runs/demo] [key=value overrides for both runs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from sigmanens_dist.metrics import reliability_diagrams

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
RUNS = {"single model": ["model.method=single"], "σN-Ens M=4": ["model.method=sigma", "model.num_members=4"]}


def train(run_dir: Path, nproc: int, overrides: Sequence[str], config: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "sigmanens_dist.train", "--config", str(config), f"run_dir={run_dir}", *overrides]
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(cmd, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"training in {run_dir} failed with exit status {result.returncode}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="torchrun processes (default 2)")
    ap.add_argument("--out", type=Path, default=Path("runs/demo"), help="where both runs and the plot go")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides applied to both runs")
    args = ap.parse_args(argv)

    results, curves = {}, {}
    for label, extra in RUNS.items():
        run_dir = args.out / ("single" if label == "single model" else "sigma_m4")
        shutil.rmtree(run_dir, ignore_errors=True)  # a demo starts fresh; earlier runs stay in the MLflow store
        train(run_dir, args.nproc, [*extra, "checkpoint.resume=none", *args.overrides], args.config)
        results[label] = json.loads((run_dir / "final_metrics.json").read_text())
        pred = torch.load(run_dir / "val_predictions.pt")
        curves[label] = (pred["probs"], pred["targets"])

    table = Table(title=f"Fashion-MNIST validation split (carved from training data), {args.nproc}-process DDP on CPU")
    columns = [("params", "{:,.0f}"), ("acc", "{:.4f}"), ("nll", "{:.4f}"), ("ece", "{:.4f}"),
               ("brier", "{:.4f}"), ("disagreement", "{:.4f}"), ("train_img_per_s", "{:.0f}")]
    table.add_column("model", no_wrap=True)
    for name, _ in columns:
        table.add_column(name.replace("train_img_per_s", "img/s"), justify="right", no_wrap=True)
    for label, r in results.items():
        table.add_row(label, *(fmt.format(r[name]) for name, fmt in columns))
    console = Console()
    (console if console.is_terminal else Console(width=120)).print(table)  # logs and pipes get the full table
    plot = reliability_diagrams(curves, args.out / "reliability.png")
    db = (args.out.resolve() / "mlflow.db").as_posix()  # the default store sits beside the run directories
    print(f"reliability diagrams: {plot}\nMLflow UI: mlflow ui --backend-store-uri sqlite:///{db}  "
          "(then open http://127.0.0.1:5000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
