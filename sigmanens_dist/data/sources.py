"""Sources for the converters (``sigmanens data convert``: FFCV and webdataset): the map-style datasets of
data/raw.py, read without augmentation, as uint8 pixels and a label, or as the JPEG file itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision import datasets

from sigmanens_dist.data.idx import IdxImageDataset
from sigmanens_dist.data.raw import Evaluated, SeededAugment
from sigmanens_dist.errors import UsageError

__all__ = ["as_uint8_image", "read_source", "source_classes", "unwrap_source"]

_MAGIC = {b"\xff\xd8\xff": "jpg", b"\x89PNG\r\n\x1a\n": "png"}  # file signature → the shard extension


def unwrap_source(dataset: Dataset) -> Dataset:
    """The stored samples under a raw-format train, val or test set (its augmentation or evaluation transform
    removed): converters store source images, never transformed ones; the reader transforms them."""
    return dataset.dataset if isinstance(dataset, SeededAugment | Evaluated) else dataset


def source_classes(dataset: Dataset) -> list[str] | None:
    """Class names from the dataset (or the one a ``Subset`` wraps), if it has them."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    classes = getattr(dataset, "classes", None)
    return [str(c) for c in classes] if classes is not None else None


def as_uint8_image(image: Any, where: str) -> np.ndarray:
    """``(H, W)`` or ``(H, W, 3)`` uint8 from a PIL image, an HW/HWC uint8 array or a CHW uint8 tensor.

    Float tensors are refused: their normalisation is unknown, and storing them would silently change the data.
    """
    if isinstance(image, Image.Image):
        image = image if image.mode in ("L", "RGB") else image.convert("RGB")
        return np.asarray(image)
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] not in (1, 3):
            raise UsageError(f"{where}: tensor images must be uint8 (C, H, W) with C in (1, 3); got {image.dtype} "
                             f"{tuple(image.shape)}. Pass the dataset without its float/normalising transform")
        image = image.permute(1, 2, 0).numpy()
    if isinstance(image, np.ndarray) and image.dtype == np.uint8:
        if image.ndim == 3 and image.shape[2] == 1:
            image = image[..., 0]
        if image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3):
            return np.ascontiguousarray(image)
    shape = getattr(image, "shape", None)
    raise UsageError(f"{where}: unsupported image {type(image).__name__} {getattr(image, 'dtype', '')} {shape}; "
                     f"allowed: PIL image, uint8 array (H, W) / (H, W, 1|3), uint8 tensor (1|3, H, W)")


def _base(dataset: Dataset, index: int) -> tuple[Dataset, int]:
    """The dataset under any ``Subset`` wrappers (a carved split) and the sample's index in it."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, int(dataset.indices[index])
    return dataset, index


def read_source(dataset: Dataset, index: int) -> tuple[np.ndarray, int]:
    """Sample ``index`` as ``(uint8 pixels (H, W) or (H, W, 3), label)``, whatever form the dataset stores it in."""
    dataset, index = _base(dataset, index)
    if isinstance(dataset, IdxImageDataset):  # its __getitem__ normalises; the stored uint8 pixels are the source
        return dataset.images[index, 0].numpy(), int(dataset.labels[index])
    image, label = dataset[index]
    return as_uint8_image(image, f"sample {index}"), int(label)


def _source_file(dataset: Dataset, index: int) -> tuple[str, Path, int] | None:
    """``(extension, path, label)`` of sample ``index`` when it is a JPEG or PNG file read with no transform: its
    bytes can be stored as they are, which is lossless (a reader decodes the pixels the raw reader does) and many
    times faster than decoding and re-encoding."""
    dataset, index = _base(dataset, index)
    if not isinstance(dataset, datasets.DatasetFolder) or dataset.transform is not None:
        return None
    path, label = dataset.samples[index]
    with open(path, "rb") as f:
        head = f.read(8)
    ext = next((e for magic, e in _MAGIC.items() if head.startswith(magic)), None)
    return (ext, Path(path), int(label)) if ext is not None else None
