"""Write a dataset's train, validation and test splits as FFCV ``.beton`` files or webdataset shards, in the layout
:func:`sigmanens_dist.data.loaders.build_data` reads (see that module's docstring); ``sigmanens data convert`` is
its command line (``cli.py``), which validates the options as a training run's config first.

The validation split is carved from the training pool here, exactly as a raw run carves it (``val_split``,
``split_seed``: the same ``split_indices``), and recorded in ``classes.json``; a run on the converted folder must
ask for the same split, so converted and raw data of one config train and validate on the same samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.data import Subset

from sigmanens_dist.atomic import write_text
from sigmanens_dist.data.datasets import convertible
from sigmanens_dist.data.loaders import CLASSES_FILE
from sigmanens_dist.data.raw import build_datasets, split_indices
from sigmanens_dist.data.sources import source_classes, unwrap_source

__all__ = ["convert", "fraction_or_count"]


def convert(data: Any, root: Path, fmt: str, out: Path, *, max_count: int = 10_000, jpeg_quality: int = 90,
            max_resolution: int | None = 500, compress_probability: float = 0.5, num_workers: int = 2) -> Path:
    """Convert the dataset that the validated data section ``data`` names (``data.dataset``, read from ``root`` in
    its native format) into ``out``: ``train`` (the first ``data.train_subset`` training samples minus the carved
    validation split), ``val`` (``data.val_split`` of them, drawn from ``data.split_seed``; none when 0) and
    ``test`` (the first ``data.test_subset`` test samples). Returns ``out``.

    SST-2 is stored as sentences, with the default tokenizer (``root``'s ``tokenizer/``, or one trained on its
    ``train.tsv``) saved to ``out/tokenizer/`` so the converted folder trains on its own."""
    dataset, split_seed = data.dataset, data.split_seed
    if dataset not in convertible():
        raise ValueError(f"--dataset {dataset!r}: convertible datasets are {', '.join(convertible())}")
    if fmt not in ("ffcv", "webdataset"):
        raise ValueError(f"--format {fmt!r}: choose ffcv or webdataset")
    text = dataset == "sst2"
    out.mkdir(parents=True, exist_ok=True)
    if text:
        from sigmanens_dist.data.sst2 import read_sst2, save_default_tokenizer

        pool, test = read_sst2(root, data.train_subset, data.test_subset)
        save_default_tokenizer(root, out)
        num_classes = len(pool.classes)
    else:
        no_split = data.model_copy(update={"val_split": 0, "val_from_test": True})
        bundle = build_datasets(no_split, root)  # the whole pool, un-augmented below; then split here
        pool, test, num_classes = unwrap_source(bundle.train), bundle.test, bundle.num_classes
    classes = source_classes(pool) or [str(i) for i in range(num_classes)]
    train_idx, val_idx = split_indices(len(pool), data.val_split, split_seed)
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
    write_text(out / CLASSES_FILE, json.dumps({"dataset": dataset, "classes": list(classes), "train_pool": len(pool),
                                               "val_split": data.val_split, "split_seed": split_seed}, indent=1))
    return out


def fraction_or_count(text: str) -> float | int:
    """``0.1`` → a fraction, ``5000`` → a count (the same reading as ``data.val_split``'s)."""
    try:
        return int(text)
    except ValueError:
        return float(text)
