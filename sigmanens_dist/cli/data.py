"""``sigmanens data convert``: a dataset written as FFCV .beton files or webdataset shards."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.catalog.datasets import convertible
from sigmanens_dist.config import DataConfig, choices, load_config
from sigmanens_dist.errors import EXIT_UNAVAILABLE, EXIT_USAGE, UnavailableError, UsageError

__all__ = ["main"]

DATA_CONVERT_USAGE = """Write a dataset as FFCV .beton files or webdataset shards (train, val, test), in the layout
training reads with data.format=ffcv|webdataset.

    sigmanens data convert --dataset imagenet --root /data/imagenet --format ffcv --out /data/imagenet_ffcv \\
        --max-resolution 500 --jpeg-quality 90 --compress-probability 0.5
    sigmanens data convert --dataset fashion_mnist --format webdataset --out /data/fmnist_wds --max-count 5000
    sigmanens data convert --dataset sst2 --root /data/SST-2 --format webdataset --out /data/sst2_wds --max-count 8000
    AWS_PROFILE=training sigmanens data convert --dataset cifar10 --root /data/cifar10 --format webdataset \
        --out s3://training-data/c10_wds

--out must be new, empty, or an unfinished conversion of the same format (which is resumed); --force writes into
any folder. An s3://BUCKET/PREFIX --out (webdataset; credentials from the AWS environment) must hold nothing unless
--force: each shard is uploaded when complete, the manifests and classes.json last. HTTP servers are read-only.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``sigmanens data SUBCOMMAND``: ``convert`` is the one there is."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "convert":
        print("usage: sigmanens data convert --help", file=sys.stderr)
        return 2
    return _convert(argv[1:])


def _convert(argv: Sequence[str]) -> int:
    """``sigmanens data convert``: the options are checked as a training run's config (the same validation and
    missing-path errors), then :func:`sigmanens_dist.data.convert.convert` writes the format."""
    ap = argparse.ArgumentParser(prog="sigmanens data convert", description=DATA_CONVERT_USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=sorted(convertible()))
    ap.add_argument("--root", type=Path, help="the dataset in its native format (default: the dataset's default)")
    ap.add_argument("--format", required=True, choices=[f for f in choices(DataConfig, "format") if f != "raw"])
    ap.add_argument("--out", required=True, help="a local folder, or s3://BUCKET/PREFIX for webdataset shards")
    ap.add_argument("--force", action="store_true",
                    help="write into --out even if it holds a finished conversion or other files")
    ap.add_argument("--max-count", type=int, default=10_000, help="webdataset: samples per shard")
    ap.add_argument("--jpeg-quality", type=int, default=90)
    ap.add_argument("--max-resolution", type=int, default=500, help="ffcv: cap on the longer image side")
    ap.add_argument("--compress-probability", type=float, default=0.5, help="ffcv: share stored as JPEG")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--train-subset", type=int, help="only the first N training samples")
    ap.add_argument("--test-subset", type=int, help="only the first N test samples")
    ap.add_argument("--val-split", type=_fraction_or_count, default=0.1,
                    help="validation carved from the training pool: a fraction in (0, 1), a count, or 0 for none "
                         "(runs then validate on test: data.val_from_test=true); default 0.1, as data.val_split")
    ap.add_argument("--split-seed", type=int, default=0, help="seed of the carved split (data.split_seed); default 0")
    a = ap.parse_args(argv)
    from sigmanens_dist.data.convert import convert, out_location  # after parsing: `--help` answers without torch

    try:
        target = out_location(a.out)
        cfg = load_config(None, _convert_overrides(a.dataset, a.root, a.train_subset, a.test_subset, a.val_split,
                                                   a.split_seed))
        out = convert(cfg.data, cfg.data_root(), a.format, target, max_count=a.max_count,
                      jpeg_quality=a.jpeg_quality, max_resolution=a.max_resolution,
                      compress_probability=a.compress_probability, num_workers=a.num_workers, force=a.force)
    except UsageError as err:  # the user's to fix: the message alone, exit 2 (errors.py)
        print(f"sigmanens data convert: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except UnavailableError as err:  # a bucket's server that does not answer: one line, exit 1
        print(f"sigmanens data convert: error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    split = (f"data.val_split={a.val_split} data.split_seed={a.split_seed}" if a.val_split
             else "data.val_split=0 data.val_from_test=true")
    print(f"wrote {a.format} data to {out}; train with data.format={a.format} data.root={out} {split}")
    return 0


def _fraction_or_count(text: str) -> float | int:
    # lazy: data.convert imports torch, not needed by `--help`
    from sigmanens_dist.data.convert import fraction_or_count

    return fraction_or_count(text)


def _convert_overrides(dataset: str, root: Path | None, train_subset: int | None, test_subset: int | None,
                       val_split: float | int, split_seed: int) -> list[str]:
    """The config overrides of a conversion: the raw dataset, its subsets and the split to carve."""
    return [f"data.dataset={dataset}", "data.format=raw", f"data.train_subset={train_subset or 'null'}",
            f"data.test_subset={test_subset or 'null'}", f"data.val_split={val_split}", f"data.split_seed={split_seed}",
            *(["data.val_from_test=true"] if val_split == 0 else []),
            *(["model.source=hf", "model.name=bert"] if dataset == "sst2" else []),
            *([f"data.root={root}"] if root else [])]
