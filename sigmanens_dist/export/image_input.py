"""An image file as a program takes it: decoded, its channels made the program's, centre-cropped and resized as the
run was evaluated (the program's ``input.crop_ratio``), as ``(C, H, W)`` uint8 pixels. The one definition of that
transform, used by ``sigmanens predict`` and by a registered program's MLflow pyfunc.

Standalone on purpose (PIL and numpy only, nothing of sigmanens_dist, no torch): the same file is logged beside a
registered program (sigmanens_dist/registry/pyfunc_program.py), as ``program_meta.py`` is.

The transform: the centre square whose side is ``crop_ratio`` × the shorter side (FFCV's evaluation crop; 1: the
whole shorter side, which for a square image is all of it), resized to the program's side with PIL's bilinear filter
(antialiased when shrinking). A program without ``crop_ratio`` (one exported before it was recorded) takes images of
its exact size only, as it was evaluated on them.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

__all__ = ["CONVERTIBLE", "MODES", "ImageError", "describe", "pixels"]

MODES = {1: "L", 3: "RGB"}  # a program's channels -> the PIL mode it takes
# modes of 8-bit pixels that PIL converts to L or RGB (transparency dropped, a palette looked up); 16-bit and float
# images (I, I;16, F) are not: their values are not 0-255, and scaling them would be a guess
CONVERTIBLE = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr"})
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError)


class ImageError(ValueError):
    """An image that cannot be made what the program takes (one line saying why)."""


def describe(channels: int, size: tuple[int, int], crop_ratio: float | None) -> str:
    """What a program takes, for a refusal: ``16×16 RGB images`` or ``RGB images of any size (…)``."""
    if crop_ratio is None:
        return f"{size[1]}×{size[0]} {MODES[channels]} images"
    return (f"{MODES[channels]} images of any size (centre {crop_ratio:g} of the shorter side, resized to "
            f"{size[1]}×{size[0]})")


def pixels(image: bytes | np.ndarray, channels: int, size: tuple[int, int], crop_ratio: float | None,
           what: str = "the image") -> np.ndarray:
    """``image`` (a file's bytes, or ``(H, W, 3)`` uint8 RGB pixels) as the program takes it: ``(C, H, W)`` uint8;
    :class:`ImageError` when it does not decode, its mode cannot be made the program's, or (no ``crop_ratio``) it
    is not a ``size`` image of the program's mode."""
    if isinstance(image, np.ndarray):
        picture = Image.fromarray(image)
    else:
        try:
            picture = Image.open(io.BytesIO(image))
            picture.load()
        except _DECODE_ERRORS as err:
            raise ImageError(f"cannot decode {what} ({type(err).__name__}: {err})") from None
    mode, wanted = picture.mode, MODES[channels]
    width, height = picture.size
    if crop_ratio is None:
        if mode != wanted or (height, width) != size:
            raise ImageError(f"a {width}×{height} {mode} image; the program takes {describe(channels, size, None)}")
    else:
        if mode not in CONVERTIBLE:
            raise ImageError(f"a {mode} image (not 8-bit pixels); the program takes "
                             f"{describe(channels, size, crop_ratio)}")
        picture = _centre(picture.convert(wanted) if mode != wanted else picture, crop_ratio, size)
    array = np.asarray(picture)  # PIL's buffer, read-only: the one copy below makes it channels-first and writable
    return np.array(array[None] if array.ndim == 2 else array.transpose(2, 0, 1), order="C")


def _centre(picture: Image.Image, crop_ratio: float, size: tuple[int, int]) -> Image.Image:
    """The centre square of ``crop_ratio`` × the shorter side, resized to ``size`` (height, width)."""
    width, height = picture.size
    side = max(1, round(crop_ratio * min(width, height)))
    left, top = (width - side) // 2, (height - side) // 2
    if (side, side) != (width, height):
        picture = picture.crop((left, top, left + side, top + side))
    if picture.size != (size[1], size[0]):
        picture = picture.resize((size[1], size[0]), Image.Resampling.BILINEAR)
    return picture
