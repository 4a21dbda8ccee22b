"""An ImageNet-style JPEG tree of generated images, so converters, loaders and benchmarks run on real JPEG files
without any download.

Each class has its own grating orientation, frequency and colour; each image adds a random phase, a second random
grating and pixel noise. Images are therefore learnable, all different, and textured enough that JPEG and blur
behave as on photographs (flat images would compress to nothing and hide decoder bugs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from sigmanens_dist.errors import UsageError
from sigmanens_dist.progress import progress

__all__ = ["class_name", "make_image_folder"]


def class_name(index: int) -> str:
    """WordNet-id-like folder name, so class folders sort in index order as ImageFolder expects."""
    return f"n{index:08d}"


def make_image_folder(root: Path | str, num_classes: int, per_class: int, size: int, seed: int = 0,
                      val_per_class: int | None = None, quality: int = 90) -> Path:
    """Writes ``root/train/<class>/*.JPEG`` (``per_class`` each) and ``root/val/<class>/*.JPEG`` (``val_per_class``,
    default ``max(1, per_class // 5)``) of ``size``×``size`` RGB images; returns ``root``. Same seed, same bytes."""
    if num_classes < 1 or per_class < 1 or size < 8:
        raise UsageError(f"need num_classes ≥ 1, per_class ≥ 1 and size ≥ 8; got num_classes={num_classes}, "
                         f"per_class={per_class}, size={size}")
    root = Path(root)
    val_per_class = max(1, per_class // 5) if val_per_class is None else val_per_class
    style = np.random.default_rng([seed, 0])
    angles = style.uniform(0, np.pi, num_classes)
    freqs = style.uniform(2.0, 8.0, num_classes)
    colours = style.uniform(0.2, 0.9, (num_classes, 3))
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    total = num_classes * (per_class + val_per_class)
    with progress(total=total, desc=f"synthetic JPEGs → {root}", unit="img", leave=False) as bar:
        for split_id, (split, count) in enumerate((("train", per_class), ("val", val_per_class))):
            for c in range(num_classes):
                folder = root / split / class_name(c)
                folder.mkdir(parents=True, exist_ok=True)
                for i in range(count):
                    rng = np.random.default_rng([seed, 1 + split_id, c, i])
                    pixels = _texture(rng, xx, yy, angles[c], freqs[c], colours[c])
                    Image.fromarray(pixels).save(folder / f"{class_name(c)}_{i:05d}.JPEG", quality=quality)
                    bar.update()
    return root


def _texture(rng: np.random.Generator, xx: np.ndarray, yy: np.ndarray, angle: float, freq: float,
             colour: np.ndarray) -> np.ndarray:
    phase, angle2, freq2 = rng.uniform(0, 2 * np.pi), rng.uniform(0, np.pi), rng.uniform(1.0, 12.0)
    main = np.sin(2 * np.pi * freq * (xx * np.cos(angle) + yy * np.sin(angle)) + phase)
    other = np.sin(2 * np.pi * freq2 * (xx * np.cos(angle2) + yy * np.sin(angle2)))
    grey = 0.5 + 0.3 * main + 0.12 * other
    img = grey[..., None] * colour[None, None, :] * 1.2 + rng.normal(0, 0.04, (*grey.shape, 3))
    return (np.clip(img, 0, 1) * 255).astype(np.uint8)
