"""What to do with an unreadable sample or an out-of-range label: stop with an error naming it (default), or skip
it and count it (``data.on_bad_sample=skip``) — the count is shared by the DataLoader worker processes and logged
by the loop as ``data/bad_samples``."""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from sigmanens_dist.errors import UsageError

__all__ = ["BadSampleError", "BadSamples", "Checked", "collate_present"]

log = logging.getLogger(__name__)


class BadSampleError(RuntimeError):
    """A sample that cannot be read mid-run. Not a :class:`UsageError`: its cause may pass (a network file system
    that failed a read), so the run exits 1 and a Slurm job is retried up to its limit; the message names the sample
    and ``data.on_bad_sample=skip``."""


class BadSamples:
    def __init__(self, policy: str = "error") -> None:
        if policy not in ("error", "skip"):
            raise UsageError(f"data.on_bad_sample={policy!r}: choose 'error' or 'skip'")
        self.policy = policy
        self._count = mp.Value("q", 0)  # fork-inherited shared memory: workers add, the main process reads

    @property
    def skipping(self) -> bool:
        return self.policy == "skip"

    def skip(self, what: str, err: Exception) -> None:
        """Count and report the skipped sample described by ``what``."""
        with self._count.get_lock():
            self._count.value += 1
        log.warning("skipping %s: %s: %s", what, type(err).__name__, err)

    @property
    def count(self) -> int:
        return int(self._count.value)


class Checked(Dataset):
    """Reads through ``bad``: a sample that fails to load, or whose label is outside ``0..num_classes-1``, raises
    an error naming it or (skip) comes back as None, which :func:`collate_present` drops."""

    def __init__(self, dataset: Dataset, num_classes: int, bad: BadSamples, split: str) -> None:
        self.dataset, self.num_classes, self.bad, self.split = dataset, num_classes, bad, split

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        index = key[0] if isinstance(key, tuple) else key
        try:
            x, y = self.dataset[key]
            # caught just below: a bad label goes through the data.on_bad_sample policy
            if not 0 <= int(y) < self.num_classes:
                raise ValueError(f"label {int(y)} outside 0..{self.num_classes - 1}")
        except Exception as err:  # any failure of a single sample goes through the policy
            what = f"{self.split} sample {index}{_source_of(self.dataset, index)}"
            if not self.bad.skipping:
                raise BadSampleError(f"{what}: {type(err).__name__}: {err} (data.on_bad_sample=skip skips and counts "
                                     "such samples instead)") from err
            self.bad.skip(what, err)
            return None
        return x, y


def collate_present(batch: Sequence[Any]) -> Any:
    present = [b for b in batch if b is not None]
    if not present:
        raise UsageError(f"all {len(batch)} samples of a batch were unreadable and skipped")
    return default_collate(present)


def _source_of(dataset: Dataset, index: int) -> str:
    """`` (path)`` for folder datasets, so the error names the file."""
    base = dataset
    while not hasattr(base, "samples") and hasattr(base, "dataset"):
        if isinstance(base, torch.utils.data.Subset):
            index = base.indices[index]
        base = base.dataset
    samples = getattr(base, "samples", None)
    return f" ({samples[index][0]})" if samples is not None and 0 <= index < len(samples) else ""
