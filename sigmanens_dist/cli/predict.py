"""``sigmanens predict PROGRAM INPUTS... --out DIR``: run an exported program over many inputs (docs/deploy.md).

    sigmanens predict model.pt2 photos/ extra.jpg --out preds
    sigmanens predict model.pt2 shards/test-*.tar data/test.beton --out preds --format jsonl
    torchrun --nproc_per_node 4 -m sigmanens_dist.cli predict model.pt2 shards/ --out preds

PROGRAM is a .pt2 from `sigmanens export RUN --program` (or an .onnx program), or a registered one:
models:/NAME@ALIAS or models:/NAME/VERSION (`sigmanens export RUN --program OUT --register NAME`), downloaded from
the registry of --tracking-uri (default $MLFLOW_TRACKING_URI) and then vetted and run as a file is.
INPUTS are image files, folders of images (recursive), webdataset shards (.tar) and FFCV files (.beton). Each unit
(a shard, or --chunk-size images or FFCV samples) is written as DIR/parts/<unit>.parquet once predicted; a rerun
skips the units already there, so a killed job continues where it stopped. DIR/summary.json has the counts,
per-class predictions, mean uncertainties, the skipped (unreadable) inputs and the throughput.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.errors import EXIT_UNAVAILABLE, EXIT_USAGE, UnavailableError, UsageError
from sigmanens_dist.program_meta import NORM_STATS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens predict", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("program", help="a .pt2 (sigmanens export RUN --program OUT.pt2) or .onnx program, or "
                                    "models:/NAME@ALIAS or models:/NAME/VERSION")
    ap.add_argument("inputs", type=Path, nargs="+", help="image files, folders of images, .tar shards, .beton files")
    ap.add_argument("--out", type=Path, required=True, help="output folder (parts/, manifest.json, summary.json)")
    ap.add_argument("--batch-size", type=int, default=64, help="images per forward pass (default 64)")
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet", help="part files (default parquet)")
    ap.add_argument("--device", help="default: cuda if available, else cpu (under torchrun: cuda:LOCAL_RANK)")
    ap.add_argument("--force", action="store_true", help="start over in a --out that holds other predictions")
    ap.add_argument("--norm-stats", choices=NORM_STATS,
                    help="check that PROGRAM normalises with these BatchNorm statistics (fixed when exported: "
                         "sigmanens export RUN --program OUT --norm-stats batch); refused otherwise")
    ap.add_argument("--chunk-size", type=int, default=1024,
                    help="image files (or FFCV samples) per unit, i.e. per part file (default 1024)")
    ap.add_argument("--tracking-uri", metavar="URI", help="the MLflow registry a models:/ PROGRAM is in (default "
                                                          "$MLFLOW_TRACKING_URI)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        from sigmanens_dist.predict import predict  # after parsing: `sigmanens predict --help` answers without torch

        with tempfile.TemporaryDirectory(prefix="sigmanens-program-") as tmp:
            program = _program(args.program, args.tracking_uri, Path(tmp))
            summary = predict(program, args.inputs, args.out, batch_size=args.batch_size, fmt=args.format,
                              device=args.device, force=args.force, chunk_size=args.chunk_size,
                              norm_stats=args.norm_stats, source=args.program)  # the URI, not the temporary copy
    except (UsageError, UnavailableError) as err:  # a registry that does not answer: one line too, but exit 1
        if main_rank:
            print(f"sigmanens predict: error: {err}", file=sys.stderr)
        return EXIT_USAGE if isinstance(err, UsageError) else EXIT_UNAVAILABLE
    if summary is not None:
        print(f"predicted {summary['predicted']} inputs ({summary['skipped']} skipped) into {args.out}: "
              f"{summary['units']['total']} part files in {args.out / 'parts'}, summary in "
              f"{args.out / 'summary.json'}")
    return 0


def _program(text: str, tracking_uri: str | None, tmp: Path) -> Path:
    """PROGRAM as a file: itself, or the registered program a ``models:/`` URI names, downloaded into ``tmp``."""
    if not text.startswith("models:/"):
        if tracking_uri is not None:
            raise UsageError(f"--tracking-uri goes with a registered PROGRAM (models:/NAME@ALIAS), not {text}")
        return Path(text)
    from sigmanens_dist.registry import fetch_program  # after parsing: the registry imports torch

    return fetch_program(text, tracking_uri, tmp)
