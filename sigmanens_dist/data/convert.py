"""``sigmanens data convert``: write a dataset's train, validation and test splits as FFCV ``.beton`` files or
webdataset shards, in the layout :func:`sigmanens_dist.data.loaders.build_data` reads (see that module's docstring).

The validation split is carved from the training pool here, exactly as a raw run carves it (``--val-split``,
``--split-seed``: the same ``split_indices``), and recorded in ``classes.json``; a run on the converted folder must
ask for the same split, so converted and raw data of one config train and validate on the same samples.

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

from torch.utils.data import Subset

from sigmanens_dist.config import load_config
from sigmanens_dist.data.datasets import convertible
from sigmanens_dist.data.loaders import CLASSES_FILE
from sigmanens_dist.data.registry import build_datasets, split_indices
from sigmanens_dist.data.webdataset_io import source_classes, unwrap_source

__all__ = ["convert", "main"]


def convert(dataset: str, root: Path | None, fmt: str, out: Path, *, max_count: int = 10_000,
            jpeg_quality: int = 90, max_resolution: int | None = 500, compress_probability: float = 0.5,
            num_workers: int = 2, train_subset: int | None = None, test_subset: int | None = None,
            val_split: float | int = 0.1, split_seed: int = 0) -> Path:
    """Convert ``dataset`` (read from ``root`` in its native format) into ``out``: ``train`` (the first
    ``train_subset`` training samples minus the carved validation split), ``val`` (``val_split`` of them, drawn from
    ``split_seed``; none when 0) and ``test`` (the first ``test_subset`` test samples). Returns ``out``.

    SST-2 is stored as sentences, with the default tokenizer (``root``'s ``tokenizer/``, or one trained on its
    ``train.tsv``) saved to ``out/tokenizer/`` so the converted folder trains on its own."""
    if dataset not in convertible():
        raise ValueError(f"--dataset {dataset!r}: convertible datasets are {', '.join(convertible())}")
    if fmt not in ("ffcv", "webdataset"):
        raise ValueError(f"--format {fmt!r}: choose ffcv or webdataset")
    text = dataset == "sst2"
    overrides = [f"data.dataset={dataset}", "data.format=raw", f"data.train_subset={train_subset or 'null'}",
                 f"data.test_subset={test_subset or 'null'}", f"data.val_split={val_split}",
                 f"data.split_seed={split_seed}", *(["data.val_from_test=true"] if val_split == 0 else []),
                 *(["model.source=hf", "model.name=bert"] if text else []), *([f"data.root={root}"] if root else [])]
    cfg = load_config(None, overrides)  # the same validation (and missing-path errors) as a training run
    out.mkdir(parents=True, exist_ok=True)
    if text:
        from sigmanens_dist.data.sst2 import read_sst2, save_default_tokenizer

        pool, test = read_sst2(cfg.data_root(), train_subset, test_subset)
        save_default_tokenizer(cfg.data_root(), out)
        num_classes = len(pool.classes)
    else:
        no_split = cfg.data.model_copy(update={"val_split": 0, "val_from_test": True})
        bundle = build_datasets(no_split, cfg.data_root())  # the whole pool, un-augmented below; then split here
        pool, test, num_classes = unwrap_source(bundle.train), bundle.test, bundle.num_classes
    classes = source_classes(pool) or [str(i) for i in range(num_classes)]
    train_idx, val_idx = split_indices(len(pool), cfg.data.val_split, split_seed)
    splits = {"train": Subset(pool, train_idx) if val_idx else pool, "test": test}
    if val_idx:
        splits["val"] = Subset(pool, val_idx)
    for split, ds in splits.items():
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
    tmp.write_text(json.dumps({"dataset": dataset, "classes": list(classes), "train_pool": len(pool),
                               "val_split": cfg.data.val_split, "split_seed": split_seed}, indent=1))
    os.replace(tmp, out / CLASSES_FILE)
    return out


def _fraction_or_count(text: str) -> float | int:
    """``0.1`` → a fraction, ``5000`` → a count (the same reading as ``data.val_split``'s)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


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
    ap.add_argument("--test-subset", type=int, help="only the first N test samples")
    ap.add_argument("--val-split", type=_fraction_or_count, default=0.1,
                    help="validation carved from the training pool: a fraction in (0, 1), a count, or 0 for none "
                         "(runs then validate on test: data.val_from_test=true); default 0.1, as data.val_split")
    ap.add_argument("--split-seed", type=int, default=0, help="seed of the carved split (data.split_seed); default 0")
    a = ap.parse_args(argv)
    out = convert(a.dataset, a.root, a.format, a.out, max_count=a.max_count, jpeg_quality=a.jpeg_quality,
                  max_resolution=a.max_resolution, compress_probability=a.compress_probability,
                  num_workers=a.num_workers, train_subset=a.train_subset, test_subset=a.test_subset,
                  val_split=a.val_split, split_seed=a.split_seed)
    split = (f"data.val_split={a.val_split} data.split_seed={a.split_seed}" if a.val_split
             else "data.val_split=0 data.val_from_test=true")
    print(f"wrote {a.format} data to {out}; train with data.format={a.format} data.root={out} {split}")
    return 0
