"""``train.randaugment`` on FFCV: timm's auto-augmentation of each decoded crop, the raw reader's very step.

FFCV's pipeline has no RandAugment, so :class:`FFCVLoader` decodes uint8 crops (``SeededCropDecoder``: crop and
flip) and hands each batch to :class:`AugmentPool`, whose worker processes apply the auto-augmentation step of the
raw reader's training transform (``raw.image_folder_transforms``, timm's ``create_transform``) to every crop under
``sampler.seeded(seed)``, where ``seed`` is the sample's :func:`sampler.sample_seed` from its place in the epoch,
as the map-style and webdataset readers seed theirs. So the draws replay on resume whatever process augments a
sample. Processes, not threads: ``seeded`` seeds the global generators timm draws from, which the training thread
draws from too (timm's Mixup), and only another process can use them at the same time.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np
from PIL import Image
from timm.data.auto_augment import AugMixAugment, AutoAugment, RandAugment

from sigmanens_dist.data.raw import timm_train_transform
from sigmanens_dist.data.sampler import seeded

__all__ = ["AugmentPool", "auto_augmentation"]

Augmentation = Callable[[Image.Image], Image.Image]


def auto_augmentation(randaugment: str, img_size: int, mean: Sequence[float]) -> Augmentation:
    """The auto-augmentation step (RandAugment, AutoAugment or AugMix) of the raw reader's training transform for
    ``randaugment`` at ``img_size``, filling with ``mean``: what it applies to its flipped crop."""
    train = timm_train_transform(img_size, randaugment, mean, (1.0,) * len(mean))
    (step,) = [t for t in train.transforms if isinstance(t, RandAugment | AutoAugment | AugMixAugment)]
    return step


_worker_augmentation: Augmentation | None = None


def _start_worker(randaugment: str, img_size: int, mean: Sequence[float]) -> None:
    global _worker_augmentation
    _worker_augmentation = auto_augmentation(randaugment, img_size, mean)


def _augment(images: np.ndarray, seeds: list[int]) -> np.ndarray:
    """``images`` (N, H, W, 3) uint8, each augmented under its own seed (in a worker process)."""
    augmentation = _worker_augmentation
    if augmentation is None:  # an invariant: the pool's initializer sets it (a bug if hit)
        raise RuntimeError("an augmentation worker without its augmentation")
    out = np.empty_like(images)
    for j, seed in enumerate(seeds):
        with seeded(seed):
            out[j] = np.asarray(augmentation(Image.fromarray(images[j])))
    return out


class AugmentPool:
    """``workers`` processes that augment uint8 HWC batches, each sample under its seed. One pool per setting in a
    process (:meth:`shared`), so the loaders of several members do not each start their own."""

    def __init__(self, randaugment: str, img_size: int, mean: Sequence[float], workers: int) -> None:
        self.workers = workers
        # spawn: the parent runs FFCV's and numba's threads, which a forked child would inherit mid-lock
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(randaugment, img_size, tuple(mean)))

    @classmethod
    def shared(cls, randaugment: str, img_size: int, mean: Sequence[float], workers: int) -> AugmentPool:
        """This process's pool for these settings, started on first use."""
        key = (randaugment, img_size, tuple(mean), workers)
        if key not in _POOLS:
            _POOLS[key] = cls(*key)
        return _POOLS[key]

    def submit(self, images: np.ndarray, seeds: Sequence[int]) -> list[Future]:
        """Starts augmenting ``images`` (N, H, W, 3) uint8, sample j under ``seeds[j]``; copies ``images`` first, so
        the caller may reuse its buffer at once. :meth:`gather` the result."""
        bounds = np.linspace(0, len(images), min(self.workers, len(images)) + 1).astype(int)
        return [self._pool.submit(_augment, images[lo:hi].copy(), list(seeds[lo:hi]))
                for lo, hi in itertools.pairwise(bounds)]

    @staticmethod
    def gather(job: list[Future]) -> np.ndarray:
        """The augmented batch of a :meth:`submit` (a worker's exception is raised here, with its traceback)."""
        return np.concatenate([part.result() for part in job])


_POOLS: dict[tuple[str, int, tuple[float, ...], int], AugmentPool] = {}
