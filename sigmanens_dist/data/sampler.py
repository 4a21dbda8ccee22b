"""Deterministic, resumable batch order shared by all ranks.

Each epoch draws one global permutation from ``(seed, epoch)``; global batch i is ``perm[i·B·W : (i+1)·B·W]`` and
rank r takes its r-th slice of B. So W ranks at batch B see exactly the samples one process sees at batch W·B, every
rank runs the same number of steps, and a run resumed at (epoch, batch) sees the very batches it would have seen.
Each sample also gets its own augmentation seed, derived from its place in the global order (not from the rank).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from sigmanens_dist.errors import UsageError

__all__ = ["EvalShardSampler", "ShardedBatchSampler", "epoch_seed", "sample_seed", "seeded"]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, epoch, position) over 63 bits


class ShardedBatchSampler:
    """Yields lists of ``(index, augmentation_seed)`` for this rank; ``set_position`` chooses epoch and start batch."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True) -> None:
        if num_samples < batch_size * world_size:
            raise UsageError(f"the training set has {num_samples} samples, fewer than one global batch "
                             f"({batch_size} per rank × {world_size} ranks); lower train.batch_size")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        """Batches per epoch (the last incomplete global batch is dropped so every rank takes the same steps)."""
        return self.num_samples // (self.batch_size * self.world_size)

    def set_position(self, epoch: int, start: int = 0) -> None:
        # an invariant: the position comes from this run's own checkpoint (a bug if hit)
        if not 0 <= start <= len(self):
            raise ValueError(f"start batch {start} outside an epoch of {len(self)} batches")
        self.epoch, self.start = epoch, start

    def global_batches(self, epoch: int) -> torch.Tensor:
        """Sample indices of every global batch of ``epoch``: ``(len(self), world_size, batch_size)``."""
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(self.num_samples, generator=g) if self.shuffle else torch.arange(self.num_samples)
        return order[: len(self) * self.batch_size * self.world_size].view(len(self), self.world_size, -1)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batches = self.global_batches(self.epoch)
        glob = self.batch_size * self.world_size
        for i in range(self.start, len(self)):
            lo = i * glob + self.rank * self.batch_size
            yield [(int(index), sample_seed(self.seed, self.epoch, lo + j))
                   for j, index in enumerate(batches[i, self.rank].tolist())]


class EvalShardSampler:
    """Contiguous, unpadded shards for evaluation: every sample is scored exactly once across ranks."""

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int) -> None:
        per = -(-num_samples // world_size)
        self.indices = list(range(rank * per, min(num_samples, (rank + 1) * per)))
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(0, len(self.indices), self.batch_size):
            yield self.indices[i: i + self.batch_size]


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of everything drawn per epoch (the permutation, loader generators): one formula for every format."""
    return seed * 1_000_003 + epoch


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """Augmentation seed of one sample, from its place in the epoch (never from rank, worker or resume point)."""
    return (epoch_seed(seed, epoch) * _MIX + position * 0xBF58476D1CE4E5B9) % (2**63 - 1)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """One sample's augmentation under its own seed (:func:`sample_seed`), every reader the same way: the global
    generators augmentations draw from are seeded, then restored, so augmentation replays on resume whatever worker
    or rank draws the sample and whatever those generators held before, and the caller's own draws (timm's Mixup on
    the training thread) go on as if nothing had run. Those generators: torch's CPU one (torchvision's transforms),
    numpy's (timm's RandAugment picks its operations with it, AugMix its mixing weights) and python's ``random``
    (timm's crop, magnitudes and signs). CPU only: ``torch.manual_seed`` would also seed CUDA, 3× slower. Not
    thread-safe: they are globals."""
    torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    torch.default_generator.manual_seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # all 63 bits: numpy's legacy seed takes 32-bit words
    random.seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)
