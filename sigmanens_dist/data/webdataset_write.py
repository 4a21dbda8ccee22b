"""Writing WebDataset tar shards: a resumable converter (``sigmanens data convert --format webdataset``).

Shards are written with webdataset's ``ShardWriter`` (``{split}-%06d.tar``; each sample ``__key__``, ``jpg`` or
``png`` for images or ``txt`` (UTF-8) for sentences, ``cls``) and described by ``manifest.json`` (counts and sha256
per shard), the file :mod:`.webdataset_io` reads them back by. An interrupted conversion keeps
``manifest.partial.json`` and continues after its last complete shard.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from PIL import Image
from torch.utils.data import Dataset, Subset

from sigmanens_dist.atomic import file_sha256, write_text
from sigmanens_dist.data.sources import _base, _source_file, read_source, source_classes, unwrap_source
from sigmanens_dist.data.sst2 import TextDataset
from sigmanens_dist.data.webdataset_io import MANIFEST, MANIFEST_FORMAT, PARTIAL_MANIFEST, SHARDS_GLOB
from sigmanens_dist.errors import UsageError
from sigmanens_dist.progress import progress

__all__ = ["write_shards"]

_CHUNK = 256  # samples encoded per thread-pool round: bounds memory while keeping workers busy


def _encode(dataset: Dataset, index: int, quality: int) -> tuple[str, bytes, int]:
    """``(extension, bytes, label)``: sentences as UTF-8 text; source JPEG and PNG files as they are; other RGB as
    JPEG (4:4:4), other grayscale as lossless PNG."""
    if isinstance(_base(dataset, index)[0], TextDataset):
        text, label = dataset[index]
        return "txt", text.encode("utf-8"), label
    source = _source_file(dataset, index)
    if source is not None:
        ext, path, label = source
        return ext, path.read_bytes(), label
    pixels, label = read_source(dataset, index)
    buf = io.BytesIO()
    if pixels.ndim == 2:
        Image.fromarray(pixels, "L").save(buf, format="PNG")
        return "png", buf.getvalue(), label
    # 4:4:4: the default 4:2:0 halves colour resolution, which costs most on the small images converted here (CIFAR).
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=quality, subsampling=0)
    return "jpg", buf.getvalue(), label


def _selection(dataset: Dataset) -> str | None:
    """A digest of which source samples a carved split takes (None: all of them), so re-running a conversion with
    another split never keeps shards of the old one."""
    if not isinstance(dataset, Subset):
        return None
    positions = [_base(dataset, i)[1] for i in range(len(dataset))]
    return hashlib.sha256(json.dumps(positions).encode()).hexdigest()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    """Atomic: a reader (or a resumed conversion) never sees half a manifest."""
    write_text(path, json.dumps(obj, indent=1))


def _valid_prefix(out_dir: Path, shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recorded shards, up to the first one missing or changed on disk."""
    keep = []
    for entry in shards:
        path = out_dir / entry["name"]
        if not path.is_file() or path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            break
        keep.append(entry)
    return keep


class _ShardLog:
    """Records each shard as ShardWriter closes it, in the partial manifest a resumed conversion starts from."""

    def __init__(self, path: Path, settings: dict[str, Any], shards: list[dict[str, Any]], start: int,
                 on_shard: Callable[[Path], None] | None) -> None:
        self.path, self.settings, self.shards, self.on_shard = path, settings, shards, on_shard
        self.first = self.next = start
        self.max_label = -1

    def added(self, label: int) -> None:
        self.next += 1
        self.max_label = max(self.max_label, label)

    def closed(self, fname: str) -> None:
        path = Path(fname)
        self.shards.append({"name": path.name, "first": self.first, "count": self.next - self.first,
                            "max_label": self.max_label, "bytes": path.stat().st_size, "sha256": file_sha256(path)})
        self.first, self.max_label = self.next, -1
        _write_json(self.path, {"format": MANIFEST_FORMAT, "settings": self.settings, "shards": self.shards})
        if self.on_shard is not None:
            self.on_shard(path)


def write_shards(dataset: Dataset, out_dir: Path | str, *, split: str = "train", max_count: int = 10_000,
                 max_size: int = 1 << 30, jpeg_quality: int = 95, num_workers: int = 4, desc: str | None = None,
                 on_shard: Callable[[Path], None] | None = None) -> Path:
    """Writes ``dataset`` as ``out_dir/{split}-%06d.tar`` shards plus ``out_dir/manifest.json``; returns the manifest.

    A shard closes after ``max_count`` samples or once it reaches ``max_size`` bytes. Each closed shard is recorded
    (count, size, sha256) in ``manifest.partial.json`` at once, so an interrupted conversion re-run with the same
    settings keeps every shard that still matches that record and restarts after the last one; boundaries, and so the
    bytes, come out as an uninterrupted run's. A finished conversion with the same settings returns at once.
    ``num_workers`` threads encode (PIL releases the GIL), the writer stays in order. ``on_shard`` gets each shard
    once it is recorded; the conversion to a bucket uploads it there and deletes it, so that one is not resumed.
    """
    if max_count < 1 or max_size < 1:
        raise UsageError(f"max_count={max_count} and max_size={max_size} must be positive")
    if not 1 <= jpeg_quality <= 100:
        raise UsageError(f"jpeg_quality={jpeg_quality} must be in 1..100")
    import webdataset as wds  # optional extra: webdataset

    dataset = unwrap_source(dataset)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(dataset)
    if n == 0:
        raise UsageError(f"write_shards({out_dir}): the dataset is empty")
    settings = {"split": split, "num_samples": n, "classes": source_classes(dataset), "max_count": max_count,
                "max_size": max_size, "jpeg_quality": jpeg_quality, "selection": _selection(dataset)}
    manifest_path, partial_path = out_dir / MANIFEST, out_dir / PARTIAL_MANIFEST
    if manifest_path.is_file():
        done = json.loads(manifest_path.read_text())
        complete = all((out_dir / e["name"]).is_file() and (out_dir / e["name"]).stat().st_size == e["bytes"]
                       for e in done["shards"])  # sizes only: re-hashing a finished conversion would read it all
        if done.get("settings") == settings and complete:
            return manifest_path
        manifest_path.unlink()

    shards: list[dict[str, Any]] = []
    if partial_path.is_file():
        partial = json.loads(partial_path.read_text())
        if partial.get("settings") == settings:
            shards = _valid_prefix(out_dir, partial["shards"])
    start = shards[-1]["first"] + shards[-1]["count"] if shards else 0
    for stale in out_dir.glob(SHARDS_GLOB.format(split=split)):  # an interrupted shard, or shards of other settings
        if stale.name not in {s["name"] for s in shards}:
            stale.unlink()
    log = _ShardLog(partial_path, settings, shards, start, on_shard)
    if start < n:
        pattern = str(out_dir / f"{split}-%06d.tar")
        writer = wds.ShardWriter(pattern, maxcount=max_count, maxsize=max_size, post=log.closed,
                                 start_shard=len(shards), verbose=0, encoder=False, mtime=0.0)
        with ThreadPoolExecutor(max(1, num_workers)) as pool, \
                progress(total=n, initial=start, desc=desc or f"webdataset {split} → {out_dir}", unit="img") as bar:
            for lo in range(start, n, _CHUNK):
                indices = range(lo, min(n, lo + _CHUNK))
                for i, (ext, data, label) in zip(indices, pool.map(lambda i: _encode(dataset, i, jpeg_quality),
                                                                   indices), strict=True):
                    writer.write({"__key__": f"{i:09d}", ext: data, "cls": str(label).encode()})
                    log.added(label)
                    bar.update()
            writer.close()

    classes = settings["classes"]
    num_classes = len(classes) if classes is not None else 1 + max(s["max_label"] for s in shards)
    manifest = {"format": MANIFEST_FORMAT, "settings": settings, "num_samples": n, "num_classes": num_classes,
                "classes": classes, "shards": shards}
    _write_json(manifest_path, manifest)
    partial_path.unlink(missing_ok=True)
    return manifest_path

