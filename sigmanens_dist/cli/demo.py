"""The embedded demo: the single model and σN-Ens (M=4) on one timm backbone, trained on Fashion-MNIST under
2-process torchrun DDP on CPU as a small study, then compared from the study's own MLflow store: the
``sigmanens compare`` table (test-set scores, OOD AUROC against digits) and plots, and reliability diagrams.

    sigmanens demo [--nproc 2] [--seeds 0] [--out runs/demo] [--config fmnist_small] [key=value …]

The recipe is the reproduction's (``configs/fmnist_small.yaml``, README "Reproduction"), with the per-rank batch
divided by ``--nproc`` so that the global batch is the one the reproduction measured. Running it again with the same
arguments shows the finished study again without training; another ``--out`` starts afresh.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.cli.compare import main as compare_main
from sigmanens_dist.cli.study import main as study_main
from sigmanens_dist.config import load_config
from sigmanens_dist.errors import EXIT_USAGE, UsageError
from sigmanens_dist.experiments.study import DEFINITION, read_definition

RECIPE = "fmnist_small"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="torchrun processes per run (default 2)")
    ap.add_argument("--seeds", default="0", help="seeds, e.g. 0,1,2 (paired: the difference gets an interval)")
    ap.add_argument("--out", type=Path, default=Path("runs/demo"), help="the study folder (runs, store, report)")
    ap.add_argument("--config", default=RECIPE, help="a recipe path or packaged name (default fmnist_small)")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides applied to both runs")
    args = ap.parse_args(argv)
    import torch  # after parsing: `sigmanens demo --help` answers without it

    from sigmanens_dist.evaluation.plots import reliability_diagrams

    try:
        batch = load_config(args.config, args.overrides, check_data=False).train.batch_size
    except UsageError as err:  # a bad recipe or override: every problem in one message, before anything runs
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.nproc < 1 or batch % args.nproc:
        print(f"error: --nproc {args.nproc} must be ≥ 1 and divide the recipe's batch of {batch}", file=sys.stderr)
        return EXIT_USAGE
    per_rank = [f"train.batch_size={batch // args.nproc}"] if args.nproc > 1 else []
    status = study_main(["methods", "--methods", "single,sigma", "--members", "4", "--seeds", args.seeds,
                         "--nproc", str(args.nproc), "--config", str(args.config), "--out", str(args.out),
                         *args.overrides, *per_rank])
    if status != 0:
        return status
    definition = read_definition(args.out / DEFINITION)
    tracking = definition.tracking
    if tracking.parent_run_id is None:  # tracking.enabled=false: nothing to compare from
        return 0
    status = compare_main(["--parent", tracking.parent_run_id, "--uri", tracking.uri,
                           "--out", str(args.out / "compare")])
    curves = {}
    for child in definition.children:
        pred = torch.load(Path(definition.out) / child.name / "val_predictions.pt", weights_only=True)
        curves[child.name] = (pred["probs"], pred["targets"])
    plot = reliability_diagrams(curves, args.out / "reliability.png")
    print(f"reliability diagrams (validation split): {plot}")
    return status

