"""Write a dataset's train, validation and test splits as FFCV ``.beton`` files or webdataset shards, in the layout
:func:`sigmanens_dist.data.loaders.build_data` reads (see that module's docstring); ``sigmanens data convert`` is
its command line (``cli.py``), which validates the options as a training run's config first.

The validation split is carved from the training pool here, exactly as a raw run carves it (``val_split``,
``split_seed``: the same ``split_indices``), and recorded in ``classes.json``; a run on the converted folder must
ask for the same split, so converted and raw data of one config train and validate on the same samples.

The output folder must be new, empty, or this command's own unfinished conversion (which is resumed); anything else,
a finished conversion included, is refused unless ``force``, since converting would overwrite or delete it.

Webdataset shards may also be written to an S3 prefix: each shard is uploaded as soon as it is complete (a local
temporary folder holds one at a time), then each split's ``manifest.json``, then ``classes.json``; a reader opens
``classes.json`` and the manifests first, so it never takes a partial upload for a dataset. A prefix that holds
anything is refused unless ``force`` (an interrupted upload is redone, not resumed).
"""

from __future__ import annotations

import fnmatch
import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch.utils.data import Subset

from sigmanens_dist.atomic import check_writable_folder, write_text
from sigmanens_dist.catalog.datasets import convertible
from sigmanens_dist.data.ffcv_io import write_beton, write_text_beton
from sigmanens_dist.data.loaders import CLASSES_FILE
from sigmanens_dist.data.raw import build_datasets, split_indices
from sigmanens_dist.data.sources import source_classes, unwrap_source
from sigmanens_dist.data.sst2 import TOKENIZER_DIR, read_sst2, save_default_tokenizer
from sigmanens_dist.data.webdataset_io import MANIFEST, MANIFEST_FORMAT, PARTIAL_MANIFEST, SHARDS_GLOB
from sigmanens_dist.data.webdataset_write import write_shards
from sigmanens_dist.errors import UsageError
from sigmanens_dist.storage.remote import RemoteNotFound, RemotePath, first_object, upload

__all__ = ["convert", "fraction_or_count", "out_location"]

_SPLITS = ("train", "val", "test")
_SHARD_FIELDS = {"name": str, "first": int, "count": int, "bytes": int, "sha256": str}  # what a resume reads of one


def convert(data: Any, root: Path, fmt: str, out: Path | RemotePath, *, max_count: int = 10_000,
            jpeg_quality: int = 90, max_resolution: int | None = 500, compress_probability: float = 0.5,
            num_workers: int = 2, force: bool = False) -> Path | RemotePath:
    """Convert the dataset that the validated data section ``data`` names (``data.dataset``, read from ``root`` in
    its native format) into ``out``: ``train`` (the first ``data.train_subset`` training samples minus the carved
    validation split), ``val`` (``data.val_split`` of them, drawn from ``data.split_seed``; none when 0) and
    ``test`` (the first ``data.test_subset`` test samples). Returns ``out``. An ``out`` that holds anything but an
    unfinished conversion of ``fmt`` is refused before the dataset is read, unless ``force``; so is an ``s3://``
    ``out`` that holds anything (webdataset only; see the module docstring).

    SST-2 is stored as sentences, with the default tokenizer (``root``'s ``tokenizer/``, or one trained on its
    ``train.tsv``) saved to ``out/tokenizer/`` so the converted folder trains on its own."""
    dataset = data.dataset
    if dataset not in convertible():
        raise UsageError(f"--dataset {dataset!r}: convertible datasets are {', '.join(convertible())}")
    if fmt not in ("ffcv", "webdataset"):
        raise UsageError(f"--format {fmt!r}: choose ffcv or webdataset")
    options = {"max_count": max_count, "jpeg_quality": jpeg_quality, "max_resolution": max_resolution,
               "compress_probability": compress_probability, "num_workers": num_workers}
    if isinstance(out, RemotePath):
        _check_bucket(out, fmt, force)
        with tempfile.TemporaryDirectory(prefix="sigmanens-convert-") as stage:
            local = Path(stage)
            _write(data, root, fmt, local, lambda shard: _upload(local, shard, out, keep=False), **options)
            files = sorted(p for p in local.rglob("*") if p.is_file())  # shards are up already; manifests last
            for path in sorted(files, key=lambda p: (p.name == CLASSES_FILE, p.name == MANIFEST)):
                _upload(local, path, out)
        return out
    _check_out(out, fmt, dataset == "sst2", force)
    return _write(data, root, fmt, out, None, **options)


def _write(data: Any, root: Path, fmt: str, out: Path, on_shard: Callable[[Path], None] | None, *, max_count: int,
           jpeg_quality: int, max_resolution: int | None, compress_probability: float, num_workers: int) -> Path:
    """:func:`convert` into the checked local folder ``out``; ``on_shard`` gets each finished webdataset shard."""
    dataset, split_seed, text = data.dataset, data.split_seed, data.dataset == "sst2"
    out.mkdir(parents=True, exist_ok=True)
    if text:
        pool, test = read_sst2(root, data.train_subset, data.test_subset)
        save_default_tokenizer(root, out)
        num_classes = len(pool.classes)
    else:
        no_split = data.model_copy(update={"val_split": 0, "val_from_test": True})
        bundle = build_datasets(no_split, root)  # the whole pool, un-augmented below; then split here
        # every split as stored (PIL, uint8, the source file), its transform left to the reader of the format
        pool, test, num_classes = unwrap_source(bundle.train), unwrap_source(bundle.test), bundle.num_classes
    classes = source_classes(pool) or [str(i) for i in range(num_classes)]
    train_idx, val_idx, _ = split_indices(len(pool), data.val_split, split_seed)  # no calib: raw data only
    splits = {"train": Subset(pool, train_idx) if val_idx else pool, "test": test}
    if val_idx:
        splits["val"] = Subset(pool, val_idx)
    for split, ds in splits.items():
        if fmt == "ffcv":
            if text:
                write_text_beton(ds, out / f"{split}.beton", num_workers=num_workers)
            else:
                write_beton(ds, out / f"{split}.beton", max_resolution=max_resolution, jpeg_quality=jpeg_quality,
                            compress_probability=compress_probability, num_workers=num_workers)
        else:
            write_shards(ds, out / split, split=split, max_count=max_count, jpeg_quality=jpeg_quality,
                         num_workers=num_workers, desc=f"{dataset} {split}", on_shard=on_shard)
    write_text(out / CLASSES_FILE, json.dumps({"dataset": dataset, "classes": list(classes), "train_pool": len(pool),
                                               "val_split": data.val_split, "split_seed": split_seed}, indent=1))
    return out


def out_location(text: str) -> Path | RemotePath:
    """``--out``: a local folder or an ``s3://BUCKET/PREFIX``; HTTP servers are read-only here."""
    if "://" not in text:
        return Path(text)
    scheme = text.split("://", 1)[0].lower()
    if scheme != "s3":
        shown = text if "@" not in text else f"{scheme}://…@…"  # never echo credentials
        why = "HTTP is read-only here" if scheme in ("http", "https") else "not a place shards are written to"
        raise UsageError(f"--out {shown}: {why}; write to a local folder (and serve it) or to s3://BUCKET/PREFIX")
    try:
        return RemotePath(text)
    except ValueError as err:
        raise UsageError(f"--out: {err}") from None


def _check_bucket(out: RemotePath, fmt: str, force: bool) -> None:
    if fmt != "webdataset":
        raise UsageError(f"--out {out}: only webdataset shards are written to a bucket ({fmt} is read from local "
                         "files); give a local --out")
    try:
        found = first_object(out)
    except RemoteNotFound:
        raise UsageError(f"--out {out}: no such bucket; create it first (or check AWS_ENDPOINT_URL)") from None
    if found is not None and not force:
        raise UsageError(f"--out {out} is not empty (it holds {found}); a conversion to a bucket is not resumed: "
                         "choose another --out, or pass --force to write over it")


def _upload(local: Path, path: Path, out: RemotePath, keep: bool = True) -> None:
    upload(path, out / path.relative_to(local).as_posix())
    if not keep:
        path.unlink()


def _check_out(out: Path, fmt: str, text: bool, force: bool) -> None:
    """Refuse an ``out`` whose content converting could overwrite or delete (webdataset deletes the shards it did not
    record), unless ``force``: anything but what an unfinished conversion to ``fmt`` writes. A finished one
    (``classes.json``, written last) is refused too: its options are not all recorded, so it cannot be told from
    another conversion's. Manifests a resume would trust are read now, forced or not, so one that is not ours stops
    the conversion before it starts."""
    check_writable_folder(out, "--out ")  # a file there or in place of a parent, a read-only parent
    folders = [out / split for split in _SPLITS if (out / split).exists()] if fmt == "webdataset" else []
    if out.exists() and not force:
        if (out / CLASSES_FILE).exists():
            raise UsageError(f"--out {out} holds a finished conversion ({CLASSES_FILE}); choose another --out, or "
                             f"pass --force to convert over it")
        splits = [f"{split}.beton" for split in _SPLITS] if fmt == "ffcv" else list(_SPLITS)
        written = [CLASSES_FILE, *splits, *([TOKENIZER_DIR] if text else [])]
        foreign = [entry.name for entry in sorted(out.iterdir()) if not _written_as(entry.name, written)]
        for folder in folders:
            files = (MANIFEST, PARTIAL_MANIFEST, SHARDS_GLOB.format(split=folder.name))
            foreign += ([folder.name] if not folder.is_dir() else
                        [f"{folder.name}/{f.name}" for f in sorted(folder.iterdir()) if not _written_as(f.name, files)])
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise UsageError(f"--out {out} is not empty and not an unfinished {fmt} conversion: it holds {shown}; "
                             f"choose another --out, or pass --force to convert into it anyway")
    for record in (folder / name for folder in folders for name in (MANIFEST, PARTIAL_MANIFEST)):
        if record.is_file():
            _check_record(record)


def _written_as(name: str, patterns: Iterable[str]) -> bool:
    """``name`` matches one of ``patterns`` or is the temporary name of its atomic write (``.NAME.*``, atomic.py's
    and the tokenizer's), which a killed conversion leaves behind."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f".{p}.*") for p in patterns)


def _check_record(path: Path) -> None:
    """Refuse, naming it, a manifest or partial manifest that ``write_shards`` did not write: a resume trusts its
    shard list to choose which shards to keep and which to delete."""
    try:
        record = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{path}: not valid JSON ({err}), so not a manifest `sigmanens data convert` wrote; move it "
                         f"away or convert into another folder") from None
    shards = record.get("shards") if isinstance(record, dict) and record.get("format") == MANIFEST_FORMAT else None
    if not isinstance(shards, list) or not all(
            isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in _SHARD_FIELDS.items()) for s in shards):
        raise UsageError(f"{path}: not a {MANIFEST_FORMAT} manifest (its format and a list of shards, each with "
                         f"{', '.join(_SHARD_FIELDS)}); move it away or convert into another folder")


def fraction_or_count(text: str) -> float | int:
    """``0.1`` → a fraction, ``5000`` → a count (the same reading as ``data.val_split``'s)."""
    try:
        return int(text)
    except ValueError:
        return float(text)
