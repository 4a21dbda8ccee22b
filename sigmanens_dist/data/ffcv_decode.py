"""An FFCV image decoder that draws each sample's crop and flip from ``(seed, epoch, sample index)``.

FFCV 1.0.2's crop and flip draw from numba's per-thread generators, which depend on thread scheduling and cannot be
replayed. Here every draw is a counter-based hash (splitmix64) of ``(seed, epoch, sample index, draw number)``, so a
sample gets the same crop and flip in an epoch whichever rank, thread or batch position reads it, and a resumed
epoch replays them exactly. Decoding and resizing are FFCV's own (libjpeg-turbo, OpenCV ``INTER_AREA``), so the
pixels of a given crop are FFCV's. Two faster decodes were measured and dropped: a lossless ``tjTransform`` crop
(it entropy-decodes the whole image anyway, so it gained nothing) and libjpeg-turbo's DCT-domain downscale (it
changes the pixels, and at ImageNet sizes few crops are large enough to use it).

The compiled code talks to Python through a two-cell array accessed by address (numba freezes captured arrays into
the compiled code): it reads the epoch that :meth:`SeededCropDecoder.set_epoch` wrote, and writes the index of a
JPEG libjpeg-turbo could not decode, which :meth:`SeededCropDecoder.check` turns into an error. Raising inside the
pipeline instead would kill FFCV's batch thread and leave the training loop waiting forever for its next batch.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numba
import numpy as np
from ffcv.fields.rgb_image import IMAGE_MODES, SimpleRGBImageDecoder, get_center_crop
from ffcv.libffcv import imdecode, lib, resize_crop
from ffcv.pipeline.allocation_query import AllocationQuery
from ffcv.pipeline.compiler import Compiler
from ffcv.pipeline.state import State

from sigmanens_dist.errors import UsageError

__all__ = ["SeededCropDecoder", "center_crop", "random_resized_crop", "uniform"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@numba.njit(cache=True)
def _mix(z: np.uint64) -> np.uint64:
    """splitmix64's finaliser: a bijective scramble of 64 bits."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True)
def uniform(seed: int, epoch: int, index: int, draw: int) -> float:
    """The ``draw``-th uniform in [0, 1) of sample ``index`` in ``epoch``: a pure function of its arguments."""
    key = _mix(_mix(_mix(np.uint64(seed) + _GOLDEN) ^ np.uint64(epoch)) ^ np.uint64(index))
    return float(_mix(key + np.uint64(draw + 1) * _GOLDEN) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@numba.njit(cache=True)
def random_resized_crop(height: int, width: int, scale_lo: float, scale_hi: float, log_ratio_lo: float,
                        log_ratio_hi: float, seed: int, epoch: int, index: int) -> tuple[int, int, int, int, bool]:
    """``(top, left, h, w, flip)``: torchvision's ``RandomResizedCrop.get_params`` (ten tries at an area fraction
    and log-uniform aspect ratio, then the centred crop clamped to the ratio range) and a fair-coin flip."""
    area = height * width
    flip = uniform(seed, epoch, index, 0) < 0.5
    for attempt in range(10):
        target = area * (scale_lo + (scale_hi - scale_lo) * uniform(seed, epoch, index, 1 + 4 * attempt))
        aspect = math.exp(log_ratio_lo + (log_ratio_hi - log_ratio_lo) * uniform(seed, epoch, index, 2 + 4 * attempt))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(uniform(seed, epoch, index, 3 + 4 * attempt) * (height - h + 1))
            left = int(uniform(seed, epoch, index, 4 + 4 * attempt) * (width - w + 1))
            return top, left, h, w, flip
    in_ratio = width / height
    if in_ratio < math.exp(log_ratio_lo):
        w, h = width, round(width / math.exp(log_ratio_lo))
    elif in_ratio > math.exp(log_ratio_hi):
        h, w = height, round(height * math.exp(log_ratio_hi))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w, flip


_ffcv_center_crop = numba.njit(get_center_crop)


@numba.njit
def center_crop(height: int, width: int, ratio: float) -> tuple[int, int, int, int, bool]:
    """``(top, left, c, c, False)``: FFCV's own centre crop (``CenterCropRGBImageDecoder``), with no flip."""
    top, left, h, w = _ffcv_center_crop(height, width, None, ratio)
    return top, left, h, w, False


def _copy_by_address() -> Callable[[int, int, int], None]:
    """A numba-callable ``memcpy(source, destination, size)`` on integer addresses (FFCV's ``my_memcpy``)."""
    fn = lib["my_memcpy"]  # item access returns a fresh function object, so FFCV's own argtypes stay untouched
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64]
    fn.restype = None
    return fn


class SeededCropDecoder(SimpleRGBImageDecoder):
    """Decodes an ``RGBImageField`` to ``output_size`` uint8 HWC crops (see the module doc).

    ``train=True``: torchvision's random-resized crop (``scale``, ``ratio``) and a random horizontal flip, drawn
    from ``(seed, epoch, index)``. ``train=False``: FFCV's centre crop of ``crop_ratio`` × the shorter side.
    """

    def __init__(self, output_size: tuple[int, int], train: bool, seed: int = 0,
                 scale: tuple[float, float] = (0.08, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 crop_ratio: float = 0.875) -> None:
        super().__init__()
        # an invariant: the loaders pass constants (a bug if hit)
        if not (0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= ratio[1] and 0 < crop_ratio <= 1):
            raise ValueError(f"need 0 < scale[0] ≤ scale[1] ≤ 1, 0 < ratio[0] ≤ ratio[1] and 0 < crop_ratio ≤ 1; "
                             f"got scale={scale}, ratio={ratio}, crop_ratio={crop_ratio}")
        self.output_size, self.train, self.seed = output_size, train, seed
        self.scale, self.ratio, self.crop_ratio = scale, ratio, crop_ratio
        self._cells = np.array([0, -1], dtype=np.int64)  # [epoch, index of an undecodable JPEG or -1]

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next batches are drawn for (read by the compiled code at every batch)."""
        self._cells[:] = epoch, -1

    def check(self, path: object) -> None:
        """Raises if a JPEG in ``path`` failed to decode since :meth:`set_epoch`."""
        if self._cells[1] >= 0:
            raise UsageError(f"{path}: sample {self._cells[1]} holds a JPEG that libjpeg-turbo cannot decode "
                             f"(corrupt payload); re-run write_beton()")

    def declare_state_and_memory(self, previous_state: State) -> tuple[State, tuple[AllocationQuery, ...]]:
        out = (self.output_size[0], self.output_size[1], 3)
        biggest = np.uint64(self.metadata["width"].max()) * np.uint64(self.metadata["height"].max()) * np.uint64(3)
        u8 = np.dtype("<u1")
        return (replace(previous_state, jit_mode=True, shape=out, dtype=u8),
                (AllocationQuery(out, u8), AllocationQuery((biggest,), u8), AllocationQuery(out, u8)))

    def generate_code(self) -> Callable:
        jpg = IMAGE_MODES["jpg"]
        mem_read = self.memory_read
        my_range = Compiler.get_iterator()
        imdecode_c, resize_crop_c = Compiler.compile(imdecode), Compiler.compile(resize_crop)
        copy, epoch_address = _copy_by_address(), self._cells.ctypes.data
        failed_address = epoch_address + 8
        train, seed, crop_ratio = self.train, self.seed, self.crop_ratio
        scale_lo, scale_hi = float(self.scale[0]), float(self.scale[1])
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])

        def decode(batch_indices: Any, my_storage: Any, metadata: Any, storage_state: Any) -> Any:
            destination, temp_storage, unflipped = my_storage
            cell = np.zeros(1, dtype=np.int64)
            copy(epoch_address, cell.ctypes.data, 8)
            epoch = cell[0]
            for dst_ix in my_range(len(batch_indices)):
                index = batch_indices[dst_ix]
                field = metadata[index]
                data = mem_read(field["data_ptr"], storage_state)
                height, width = int(field["height"]), int(field["width"])
                if train:
                    top, left, h, w, flip = random_resized_crop(height, width, scale_lo, scale_hi, log_lo, log_hi,
                                                                seed, epoch, index)
                else:
                    top, left, h, w, flip = center_crop(height, width, crop_ratio)
                if field["mode"] == jpg:
                    image = temp_storage[dst_ix].reshape(-1)[:3 * height * width]
                    if imdecode_c(data, image, height, width, height, width, 0, 0, 1, 1, False, False) != 0:
                        bad = np.full(1, index, dtype=np.int64)
                        copy(bad.ctypes.data, failed_address, 8)
                    image = image.reshape(height, width, 3)
                else:
                    image = data.reshape(height, width, 3)
                if flip:
                    resize_crop_c(image, top, top + h, left, left + w, unflipped[dst_ix])
                    destination[dst_ix] = unflipped[dst_ix, :, ::-1]
                else:
                    resize_crop_c(image, top, top + h, left, left + w, destination[dst_ix])
            return destination[:len(batch_indices)]

        decode.is_parallel = True
        return decode
