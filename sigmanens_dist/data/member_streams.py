"""Member-major train streams: when members read their own batches (``model.member_batches=independent``), M train
streams, one per member, are read in lockstep and concatenated member-major, ``(M·B, …)``.

Only the trainer uses them; the model is typed by what is read of it (:class:`MemberModel`), since data/ sits below
methods/.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, ClassVar, Protocol

import torch
from torch.utils.data import Dataset

from sigmanens_dist.config import Config
from sigmanens_dist.data.bad_samples import Checked
from sigmanens_dist.data.loaders import Data, MapStyleStream, TrainStream, build_data
from sigmanens_dist.data.raw import SeededAugment, augmix_at_severity
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.errors import UsageError

__all__ = ["MemberStream", "member_major", "member_train_stream"]

log = logging.getLogger(__name__)


class MemberModel(Protocol):
    """What the streams read of an ensemble (methods/base.py's ``EnsembleMethod``)."""

    num_members: int
    default_member_batches: ClassVar[str]


def member_major(cfg: Config, model: MemberModel) -> bool:
    """Whether training batches are member-major (each member its own samples): ``model.member_batches``, or the
    method's default when unset."""
    choice = cfg.model.member_batches or type(model).default_member_batches
    return choice == "independent" and model.num_members > 1


def _head(x: Any, n: int) -> Any:
    """The first ``n`` rows of an input tensor, or of every tensor of a tokenizer-style mapping."""
    if isinstance(x, torch.Tensor):
        return x[:n]
    return type(x)({k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in x.items()})


class MemberStream:
    """M train streams, one per member, read in lockstep and concatenated member-major: batch ``(M·B, …)``.

    Member k's stream is the one a single run with ``seed = cfg.seed + k`` reads, so every member keeps its own
    data order (and augmentation draws); all have the same length, and ``iter_epoch(epoch, start)`` replays like
    the underlying streams do, so exact resume holds.

    With a CUDA ``device`` the member batches are concatenated there: each is copied from the page-locked memory
    its loader pinned (asynchronously), where a concatenation on the host would make one unpinned batch, whose copy
    to the GPU blocks the step, and cost a host copy of every image."""

    def __init__(self, streams: list[Any], device: torch.device | None = None) -> None:
        lengths = {len(s) for s in streams}
        if len(lengths) != 1:  # an invariant: every member's stream is built from one layout (a bug if hit)
            raise ValueError(f"member streams differ in length: {sorted(lengths)}")
        self.streams = streams
        self.device = device if device is not None and device.type == "cuda" else None

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.device is None:
            return torch.cat(parts)
        return torch.cat([p.to(self.device, non_blocking=True) for p in parts])

    def __len__(self) -> int:
        return len(self.streams[0])

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        for batches in zip(*(s.iter_epoch(epoch, start_batch) for s in self.streams), strict=True):
            xs, ys = zip(*batches, strict=True)
            size = min(len(y) for y in ys)
            if size != max(len(y) for y in ys):
                # data.on_bad_sample=skip dropped samples from some members' batches: a member-major batch needs
                # equal member chunks, so every member gives up its last rows down to the shortest batch.
                log.warning("member batches of %s samples after skipping bad ones: each member keeps %d",
                            sorted(len(y) for y in ys), size)
                xs = [_head(x, size) for x in xs]
                ys = [y[:size] for y in ys]
            if isinstance(xs[0], torch.Tensor):
                x = self._cat(list(xs))
            else:
                x = type(xs[0])({k: self._cat([xi[k] for xi in xs]) for k in xs[0]})
            yield x, self._cat(list(ys))


def member_train_stream(cfg: Config, env: DistEnv, data: Data, model: MemberModel) -> Data:
    """``data`` with a member-major train stream when members get their own batches (``member_major``), else
    ``data`` unchanged. Member 0 reuses ``data.train``; member k reads the stream of seed ``cfg.seed + k`` (a raw
    dataset is shared by all members; a converted format gets one loader per member).

    With ``train.augmix.member_severity`` every member, member 0 included, reads the raw training samples through
    its own AugMix at its entry's severity (:func:`augmix_at_severity`); refused with a UsageError where members
    share one batch (the method's default, which the config cannot know)."""
    augmix = cfg.train.augmix
    severities = augmix.member_severity if augmix is not None else None
    if not member_major(cfg, model):
        if severities is not None:
            raise UsageError(f"train.augmix.member_severity={severities} needs members that read their own batches, "
                             f"but model.method={cfg.model.method} gives every member one batch (model.member_batches "
                             "unset: the method's default, shared); set model.member_batches=independent, or drop "
                             "member_severity")
        return data

    def stream(k: int) -> TrainStream:
        seed = cfg.seed + k
        if isinstance(data.train, MapStyleStream):
            dataset = data.train.dataset
            if severities is not None:
                dataset = _at_severity(dataset, severities[k])
            return MapStyleStream(dataset, cfg.train.batch_size, env, seed, data.train.num_workers)
        return build_data(cfg.data, cfg.train.batch_size, seed, env, cfg.train.randaugment).train

    if severities is not None:
        log.info("train.augmix: member k trains at AugMix severity member_severity[k] = %s", severities)
    first = data.train if severities is None else stream(0)
    streams = [first] + [stream(k) for k in range(1, model.num_members)]
    return replace(data, train=MemberStream(streams, env.device))


def _at_severity(dataset: Dataset, severity: int) -> Checked:
    """The raw training set (``Checked`` over the augmixed ``SeededAugment``, data/loaders.py's ``_raw``) with its
    AugMix at ``severity``; the same bad-sample policy and count."""
    assert isinstance(dataset, Checked) and isinstance(dataset.dataset, SeededAugment), \
        "the config allows train.augmix with the raw readers alone"
    return Checked(augmix_at_severity(dataset.dataset, severity), dataset.num_classes, dataset.bad, dataset.split)
