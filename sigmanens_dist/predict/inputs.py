"""What ``sigmanens predict`` reads: image files, folders of them, webdataset tar shards and FFCV ``.beton`` files,
cut into units in one stable global order, each unit read sample by sample, and checked against the program's
input shape before any work.

A unit is a shard, a chunk of ``chunk_size`` image files, or a chunk of ``chunk_size`` samples of an FFCV file; its
id (``000007-train-000003``: its position in the order, then its source) names its part file, so the same inputs
always give the same units.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from sigmanens_dist.data.tar_samples import tar_samples
from sigmanens_dist.errors import MissingPathError, UsageError
from sigmanens_dist.export.image_input import CONVERTIBLE, MODES, ImageError, describe, pixels

__all__ = ["IMAGE_EXTENSIONS", "SHARD_IMAGE_EXTENSIONS", "BadInput", "Sample", "Unit", "check_shapes", "decode",
           "discover", "inputs_digest", "read_unit"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".bmp", ".webp", ".tif", ".tiff")
SHARD_IMAGE_EXTENSIONS = ("jpg", "png", "jpeg", "ppm", "webp")  # a shard sample's image member, first found wins
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


class BadInput(Exception):
    """One input that cannot be predicted (unreadable, corrupt, another size): skipped and recorded, never fatal."""


@dataclass(frozen=True)
class Unit:
    """``kind`` images: ``files`` with their ``ids``; shard: the tar ``source``; ffcv: samples ``start..stop`` of
    ``source``."""

    id: str
    kind: Literal["images", "shard", "ffcv"]
    source: Path | None = None
    files: tuple[Path, ...] = ()
    ids: tuple[str, ...] = ()
    start: int = 0
    stop: int = 0

    def describe(self) -> dict[str, Any]:
        """What the manifest records of the unit: enough to tell that a rerun sees the same inputs."""
        if self.kind == "images":
            return {"id": self.id, "images": hashlib.sha256("\n".join(self.ids).encode()).hexdigest()}
        stat = self.source.stat()
        return {"id": self.id, "source": str(self.source), "bytes": stat.st_size, "start": self.start,
                "stop": self.stop}


@dataclass
class Sample:
    """One input as read: ``payload`` is encoded image bytes, or an ``(H, W, 3)`` uint8 array (FFCV raw), or None
    with ``error`` saying why it could not be read."""

    id: str
    payload: bytes | np.ndarray | None
    error: str | None = None
    ext: str = field(default="")


def _unknown(path: Path) -> UsageError:
    return UsageError(f"INPUT {path}: not an image ({', '.join(IMAGE_EXTENSIONS)}), a folder of images, a "
                      "webdataset shard (.tar) or an FFCV file (.beton)")


def _slug(path: Path) -> str:
    return re.sub(r"[^\w.-]+", "_", path.stem)[:60] or "input"


def discover(inputs: Sequence[Path], chunk_size: int) -> list[Unit]:
    """The units of ``inputs`` in their global order: the arguments in the order given; a folder's images sorted by
    relative path; consecutive image files (of one or several arguments) chunked together."""
    if chunk_size < 1:
        raise UsageError(f"--chunk-size {chunk_size}: give a number of inputs ≥ 1")
    units: list[Unit] = []
    pending: list[tuple[Path, str]] = []

    def flush() -> None:
        for i in range(0, len(pending), chunk_size):
            chunk = pending[i:i + chunk_size]
            units.append(Unit(f"{len(units):06d}-images", "images", files=tuple(p for p, _ in chunk),
                              ids=tuple(name for _, name in chunk)))
        pending.clear()

    for path in inputs:
        if not path.exists():
            raise MissingPathError(f"INPUT {path}: no such file or folder")
        suffix = path.suffix.lower()
        if path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()),
                           key=lambda p: p.relative_to(path).as_posix())
            if not found:
                raise UsageError(f"INPUT {path}: a folder with no images ({', '.join(IMAGE_EXTENSIONS)}) in it")
            pending += [(p, (path / p.relative_to(path)).as_posix()) for p in found]
        elif suffix in IMAGE_EXTENSIONS:
            pending.append((path, path.as_posix()))
        elif suffix == ".tar":
            flush()
            units.append(Unit(f"{len(units):06d}-{_slug(path)}", "shard", source=path))
        elif suffix == ".beton":
            flush()
            count = _beton(path).num_samples
            for start in range(0, count, chunk_size):
                stop = min(start + chunk_size, count)
                units.append(Unit(f"{len(units):06d}-{_slug(path)}", "ffcv", source=path, start=start, stop=stop))
        else:
            raise _unknown(path)
    flush()
    return units


def inputs_digest(units: Sequence[Unit]) -> str:
    return hashlib.sha256(json.dumps([u.describe() for u in units]).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# FFCV: read with FFCV's own reader after the project's integrity check, decoded here sample by sample.


@dataclass(frozen=True)
class _Beton:
    num_samples: int
    images: np.ndarray  # the image field's metadata per sample: mode, width, height, data_ptr
    ptr: np.ndarray  # the allocation table sorted by pointer, and each allocation's size
    size: np.ndarray


@functools.lru_cache(maxsize=8)
def _beton(path: Path) -> _Beton:
    """FFCV's reading of ``path``'s header, metadata and allocation table, after the project's integrity check."""
    from sigmanens_dist.data.ffcv_io import check_beton  # ffcv_io imports pydantic, which predict must not need

    try:
        check_beton(path, "image")
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise UsageError(f"INPUT {err}") from None
    from ffcv.reader import Reader  # optional extra: ffcv

    reader = Reader(str(path))
    alloc = np.sort(reader.alloc_table, order="ptr")
    return _Beton(int(reader.num_samples), reader.metadata[f"f{reader.field_names.index('image')}"],
                  alloc["ptr"], alloc["size"])


def _read_beton(unit: Unit) -> Iterator[Sample]:
    beton = _beton(unit.source)
    with unit.source.open("rb") as f:
        for index in range(unit.start, unit.stop):
            sid = f"{unit.source.as_posix()}:{index}"
            meta = beton.images[index]
            at = int(np.searchsorted(beton.ptr, meta["data_ptr"]))
            if at >= len(beton.ptr) or beton.ptr[at] != meta["data_ptr"]:
                yield Sample(sid, None, "its image data is missing from the allocation table")
                continue
            f.seek(int(meta["data_ptr"]))
            data = f.read(int(beton.size[at]))
            if meta["mode"] == 0:  # FFCV's 'jpg'
                yield Sample(sid, data, ext="jpg")
                continue
            height, width = int(meta["height"]), int(meta["width"])
            if len(data) < height * width * 3:
                yield Sample(sid, None, f"raw image of {len(data)} bytes, short of {height}×{width}×3")
                continue
            yield Sample(sid, np.frombuffer(data[:height * width * 3], np.uint8).reshape(height, width, 3))


# ---------------------------------------------------------------------------------------------------------------------
# Shards: a sample is the members sharing a key, grouped as training groups them (data/tar_samples.py).


def _shard_samples(path: Path) -> Iterator[Sample]:
    """Each sample of a shard in tar order; a tar that breaks off ends the unit with one sample saying where."""
    key = None
    try:
        with path.open("rb") as f:
            for key, parts in tar_samples(f):
                yield _shard_sample(path, key, parts)
    except (tarfile.TarError, OSError, EOFError) as err:
        at = f"after key {key!r}" if key is not None else "at its start"
        yield Sample(f"{path.as_posix()}:{key or ''}", None, f"corrupt or truncated tar {at} ({err})")


def _shard_sample(path: Path, key: str, parts: dict[str, bytes]) -> Sample:
    sid = f"{path.as_posix()}:{key}"
    ext = next((e for e in SHARD_IMAGE_EXTENSIONS if e in parts), None)
    if ext is None:
        return Sample(sid, None, f"no image member (it has {sorted(parts)}; expected one of "
                                 f"{', '.join(SHARD_IMAGE_EXTENSIONS)})")
    return Sample(sid, parts[ext], ext=ext)


def read_unit(unit: Unit) -> Iterator[Sample]:
    """The samples of ``unit`` in order, each read but not decoded."""
    if unit.kind == "shard":
        yield from _shard_samples(unit.source)
    elif unit.kind == "ffcv":
        yield from _read_beton(unit)
    else:
        for path, sid in zip(unit.files, unit.ids, strict=True):
            try:
                yield Sample(sid, path.read_bytes(), ext=path.suffix.lower().lstrip("."))
            except OSError as err:
                yield Sample(sid, None, f"unreadable ({err.strerror or err})")


# ---------------------------------------------------------------------------------------------------------------------
# Decoding and the shape check.


def decode(sample: Sample, channels: int, size: tuple[int, int], crop_ratio: float | None = None) -> np.ndarray:
    """``(C, H, W)`` uint8 pixels, made by the program's own transform (``image_input.pixels``, which the registered
    pyfunc runs too); a batch of them divided by 255 is what the recipe's loader has before normalising.
    :class:`BadInput` when the sample cannot be read or made what the program takes."""
    if sample.payload is None:
        raise BadInput(sample.error)
    try:
        return pixels(sample.payload, channels, size, crop_ratio, sample.ext or "the image")
    except ImageError as err:
        raise BadInput(str(err)) from None


def _refuse(where: str, width: int, height: int, mode: str, channels: int, size: tuple[int, int],
            crop_ratio: float | None) -> None:
    """Refuse an image the program's transform cannot make one it takes: of another size or mode without a
    transform (a program exported before ``input.crop_ratio``), of a mode that is not 8-bit pixels with one."""
    fits = (mode in CONVERTIBLE) if crop_ratio is not None else (mode == MODES[channels] and (height, width) == size)
    if not fits:
        hint = "" if crop_ratio is not None else " (resize or convert the inputs first)"
        raise UsageError(f"INPUT {where}: a {width}×{height} {mode} image; the program takes "
                         f"{describe(channels, size, crop_ratio)}{hint}")


def check_shapes(units: Sequence[Unit], channels: int, size: tuple[int, int], crop_ratio: float | None = None
                 ) -> None:
    """Refuse, before any work, inputs the program's transform cannot make what it takes (:func:`_refuse`): every
    image file's header (no decoding), the first decodable image of each shard, every FFCV sample's metadata. What
    cannot be read here is left to the run, which records it as skipped."""
    if channels not in MODES:
        raise UsageError(f"PROGRAM: takes {channels}-channel images; predict reads 1-channel (L) or 3-channel (RGB)")
    for unit in units:
        if unit.kind == "images":
            for path in unit.files:
                try:
                    with Image.open(path) as image:  # the header only
                        header = (*image.size, image.mode)
                except _DECODE_ERRORS:
                    continue
                _refuse(str(path), *header, channels, size, crop_ratio)
        elif unit.kind == "shard":
            for sample in _shard_samples(unit.source):
                try:
                    with Image.open(io.BytesIO(sample.payload or b"")) as image:
                        image.load()
                except _DECODE_ERRORS:
                    continue
                _refuse(f"{sample.id} (the first image of {unit.source})", *image.size, image.mode, channels, size,
                        crop_ratio)
                break
        elif unit.start == 0:  # an FFCV file, once
            images = _beton(unit.source).images
            if channels != 3 and crop_ratio is None:
                raise UsageError(f"INPUT {unit.source}: FFCV stores RGB images; the program takes "
                                 f"{describe(channels, size, None)}")
            if crop_ratio is not None:
                continue
            wrong = np.flatnonzero((images["height"] != size[0]) | (images["width"] != size[1]))
            if len(wrong):
                i = int(wrong[0])
                raise UsageError(f"INPUT {unit.source}: {len(wrong)} of its images are not {size[1]}×{size[0]} "
                                 f"(sample {i} is {images['width'][i]}×{images['height'][i]}); the program takes "
                                 f"{describe(channels, size, None)}")
