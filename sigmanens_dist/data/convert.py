"""``sigmanens data convert``: write a dataset's train and val splits as FFCV ``.beton`` files or webdataset shards,
in the layout :func:`sigmanens_dist.data.loaders.build_data` reads (see that module's docstring).

    sigmanens data convert --dataset imagenet --root /data/imagenet --format ffcv --out /data/imagenet_ffcv \\
        --max-resolution 500 --jpeg-quality 90 --compress-probability 0.5
    sigmanens data convert --dataset fashion_mnist --format webdataset --out /data/fmnist_wds --max-count 5000
    sigmanens data convert --dataset sst2 --root /data/SST-2 --format webdataset --out /data/sst2_wds --max-count 8000
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.config import load_config
from sigmanens_dist.data.loaders import CLASSES_FILE
from sigmanens_dist.data.registry import build_datasets
from sigmanens_dist.data.webdataset_io import source_classes, unwrap_source
from sigmanens_dist.datasets import convertible

__all__ = ["convert", "main"]


def convert(dataset: str, root: Path | None, fmt: str, out: Path, *, max_count: int = 10_000,
            jpeg_quality: int = 90, max_resolution: int | None = 500, compress_probability: float = 0.5,
            num_workers: int = 2, train_subset: int | None = None, val_subset: int | None = None) -> Path:
    """Convert both splits of ``dataset`` (read from ``root`` in its native format); returns ``out``.

    SST-2 is stored as sentences, with the default tokenizer (``root``'s ``tokenizer/``, or one trained on its
    ``train.tsv``) saved to ``out/tokenizer/`` so the converted folder trains on its own."""
    if dataset not in convertible():
        raise ValueError(f"--dataset {dataset!r}: convertible datasets are {', '.join(convertible())}")
    if fmt not in ("ffcv", "webdataset"):
        raise ValueError(f"--format {fmt!r}: choose ffcv or webdataset")
    text = dataset == "sst2"
    overrides = [f"data.dataset={dataset}", "data.format=raw", f"data.train_subset={train_subset or 'null'}",
                 f"data.test_subset={val_subset or 'null'}",
                 # every training sample goes into train, the test set into val (converted data's only eval split)
                 "data.val_split=0", "data.val_from_test=true",
                 *(["model.source=hf", "model.name=bert"] if text else []), *([f"data.root={root}"] if root else [])]
    cfg = load_config(None, overrides)  # the same validation (and missing-path errors) as a training run
    out.mkdir(parents=True, exist_ok=True)
    if text:
        from sigmanens_dist.data.sst2 import read_sst2, save_default_tokenizer

        train, val = read_sst2(cfg.data_root(), train_subset, val_subset)
        save_default_tokenizer(cfg.data_root(), out)
        num_classes = len(train.classes)
    else:
        bundle = build_datasets(cfg.data, cfg.data_root())
        train, val, num_classes = bundle.train, bundle.test, bundle.num_classes  # the test set is converted val
    classes = source_classes(unwrap_source(train)) or [str(i) for i in range(num_classes)]
    for split, ds in (("train", train), ("val", val)):
        if fmt == "ffcv":
            from sigmanens_dist.data.ffcv_io import write_beton, write_text_beton

            if text:
                write_text_beton(ds, out / f"{split}.beton", num_workers=num_workers)
            else:
                write_beton(ds, out / f"{split}.beton", max_resolution=max_resolution, jpeg_quality=jpeg_quality,
                            compress_probability=compress_probability, num_workers=num_workers)
        else:
            from sigmanens_dist.data.webdataset_io import write_shards

            write_shards(ds, out / split, split=split, max_count=max_count, jpeg_quality=jpeg_quality,
                         num_workers=num_workers, desc=f"{dataset} {split}")
    tmp = out / f".{CLASSES_FILE}.tmp"
    tmp.write_text(json.dumps({"dataset": dataset, "classes": list(classes)}, indent=1))
    os.replace(tmp, out / CLASSES_FILE)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens data convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, choices=sorted(convertible()))
    ap.add_argument("--root", type=Path, help="the dataset in its native format (default: the dataset's default)")
    ap.add_argument("--format", required=True, choices=["ffcv", "webdataset"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-count", type=int, default=10_000, help="webdataset: samples per shard")
    ap.add_argument("--jpeg-quality", type=int, default=90)
    ap.add_argument("--max-resolution", type=int, default=500, help="ffcv: cap on the longer image side")
    ap.add_argument("--compress-probability", type=float, default=0.5, help="ffcv: share stored as JPEG")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--train-subset", type=int, help="only the first N training samples")
    ap.add_argument("--val-subset", type=int, help="only the first N validation samples")
    a = ap.parse_args(argv)
    out = convert(a.dataset, a.root, a.format, a.out, max_count=a.max_count, jpeg_quality=a.jpeg_quality,
                  max_resolution=a.max_resolution, compress_probability=a.compress_probability,
                  num_workers=a.num_workers, train_subset=a.train_subset, val_subset=a.val_subset)
    print(f"wrote {a.format} data to {out}; train with data.format={a.format} data.root={out}")
    return 0
