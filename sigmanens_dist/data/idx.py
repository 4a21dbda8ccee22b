"""IDX files (the MNIST / Fashion-MNIST format) read straight into memory, gzipped or not; nothing downloads.

Debian's ``dataset-fashion-mnist`` package installs the four gzipped IDX files under :data:`FASHION_MNIST_ROOT`.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from sigmanens_dist.catalog.datasets import DATASETS, FASHION_MNIST_ROOT
from sigmanens_dist.errors import MissingPathError, UsageError

__all__ = ["FASHION_MNIST_CLASSES", "FASHION_MNIST_MEAN", "FASHION_MNIST_ROOT", "FASHION_MNIST_STD",
           "IdxImageDataset", "read_idx"]

FASHION_MNIST_MEAN, FASHION_MNIST_STD = DATASETS["fashion_mnist"].mean[0], DATASETS["fashion_mnist"].std[0]
FASHION_MNIST_CLASSES = DATASETS["fashion_mnist"].classes

# IDX type codes (third magic byte); all multi-byte values are big-endian.
_IDX_DTYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
               0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_GZIP_MAGIC = b"\x1f\x8b"
_SPLIT_PREFIX = {"train": "train", "test": "t10k"}


def read_idx(path: Path | str) -> np.ndarray:
    """The array stored in an IDX file, in native byte order. Gzip is detected from the content, not the name."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise UsageError(f"{path}: corrupt or truncated gzip stream ({err})") from err
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        codes = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise UsageError(f"{path}: not an IDX file; expected magic 00 00 <type: one of {codes}> <ndim ≥ 1>, "
                         f"found {raw[:4].hex(' ') or 'an empty file'}")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"{path}: truncated IDX header; {ndim} dims need {header} bytes, found {len(raw)}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = math.prod(dims) * dtype.itemsize
    found = len(raw) - header
    if found != expected:
        what = "truncated" if found < expected else "trailing bytes after the data"
        raise UsageError(f"{path}: {what}; header promises shape {dims} of {dtype.name} = {expected} data bytes, "
                         f"found {found}")
    # astype copies into a writable, native-endian array (frombuffer's view of bytes is read-only).
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


class IdxImageDataset(Dataset):
    """Fashion-MNIST from its IDX files, held in memory as uint8 (the full train set is 47 MB).

    ``ds[i]`` is ``(image, label)``: a normalised ``(1, H, W)`` float tensor and an int. :meth:`tensors` gives the
    whole (sub)set at once, for evaluation loops that need no per-sample augmentation.
    """

    num_classes = 10
    in_chans = 1
    classes = FASHION_MNIST_CLASSES
    mean, std = FASHION_MNIST_MEAN, FASHION_MNIST_STD

    def __init__(self, root: Path | str, split: Literal["train", "test"], subset: int | None = None) -> None:
        if split not in _SPLIT_PREFIX:  # an invariant: the readers pass a literal split (a bug if hit)
            raise ValueError(f"split={split!r} is not one of {', '.join(map(repr, _SPLIT_PREFIX))}")
        if subset is not None and subset < 1:
            raise UsageError(f"subset={subset} must be a positive number of samples, or None for all of them")
        root = Path(root)
        prefix = _SPLIT_PREFIX[split]
        images_path = _find(root, f"{prefix}-images-idx3-ubyte")
        labels_path = _find(root, f"{prefix}-labels-idx1-ubyte")
        images, labels = read_idx(images_path), read_idx(labels_path)
        if images.ndim != 3 or images.dtype != np.uint8:
            raise UsageError(f"{images_path}: expected uint8 images of shape (N, H, W), found {images.dtype} "
                             f"of shape {images.shape}")
        if labels.ndim != 1 or labels.dtype != np.uint8:
            raise UsageError(f"{labels_path}: expected uint8 labels of shape (N,), found {labels.dtype} "
                             f"of shape {labels.shape}")
        if len(images) != len(labels):
            raise UsageError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
        if len(labels) and labels.max() >= self.num_classes:
            raise UsageError(f"{labels_path}: label {int(labels.max())} is out of range; expected 0.."
                             f"{self.num_classes - 1}")
        n = len(labels) if subset is None else min(subset, len(labels))  # like data/raw.py: a larger subset = all
        self.root, self.split = root, split
        self.images = torch.from_numpy(images[:n]).unsqueeze(1)  # (N, 1, H, W) uint8
        self.labels = torch.from_numpy(labels[:n]).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self._normalise(self.images[index]), int(self.labels[index])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All images, normalised float32 ``(N, 1, H, W)`` (a fresh tensor: 4 bytes a pixel), and int64 labels."""
        return self._normalise(self.images), self.labels

    def _normalise(self, images: torch.Tensor) -> torch.Tensor:
        return (images.float() / 255.0 - self.mean) / self.std


def _find(root: Path, stem: str) -> Path:
    candidates = [root / stem, root / f"{stem}.gz"]
    for path in candidates:
        if path.is_file():
            return path
    raise MissingPathError(f"no {stem} IDX file in {root}; looked for {' and '.join(map(str, candidates))}. "
                           f"Fashion-MNIST: `apt-get install dataset-fashion-mnist` puts it in {FASHION_MNIST_ROOT}")
