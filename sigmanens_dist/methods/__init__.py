"""Ensemble methods behind one interface (:class:`EnsembleMethod`), chosen by ``model.method``.

========  ==============================================================  ===================
method    what                                                            module
========  ==============================================================  ===================
sigma     σN-Ens: per-member σ norms over a shared backbone + L_div        ``methods.sigma``
single    the plain backbone (one member)                                 ``methods.single``
deep      Deep Ensemble: M independent backbones                          ``methods.deep``
batch     BatchEnsemble: shared weights, rank-1 per-member fast weights   ``methods.batch``
packed    Packed-Ensembles: grouped layers, width α, γ sub-groups         ``methods.packed``
film      σN-Ens without σ gate and L_div (per-member norms only)         ``methods.film``
========  ==============================================================  ===================

``METHODS`` is the one table of methods (name → class, in this order everywhere: study grids, compare tables).
A method's traits are attributes of its class (``member_axis``, ``regularized``, ``knobs``, see
:class:`EnsembleMethod`); its module builds it from a config (``build(cfg, make_backbone)``). The modules are plain
torch, so the table imports them all.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from sigmanens_dist.methods.base import EnsembleMethod, Inputs, call_backbone, logits_of, map_tensors, member_chunks
from sigmanens_dist.methods.batch import BatchEnsemble
from sigmanens_dist.methods.deep import DeepEnsemble
from sigmanens_dist.methods.film import FiLMEnsemble
from sigmanens_dist.methods.packed import PackedEnsemble
from sigmanens_dist.methods.sigma import SigmaEnsemble
from sigmanens_dist.methods.single import SingleModel

__all__ = ["METHODS", "METHOD_NAMES", "EnsembleMethod", "Inputs", "MemberStream", "build_method", "call_backbone",
           "logits_of", "map_tensors", "member_chunks", "member_major", "member_train_stream", "method_module"]

log = logging.getLogger(__name__)

# model.method -> its class: the one place methods are listed (config.py's model.method Literal must match it,
# tests/test_methods.py checks; config sits below this floor and cannot import it).
METHODS: dict[str, type[EnsembleMethod]] = {cls.name: cls for cls in (
    SigmaEnsemble, SingleModel, DeepEnsemble, BatchEnsemble, PackedEnsemble, FiLMEnsemble)}
METHOD_NAMES = tuple(METHODS)


def method_module(name: str) -> Any:
    """The module of method ``name``, whose ``build(cfg, make_backbone)`` makes it from a config."""
    if name not in METHODS:
        raise ValueError(f"unknown model.method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    return sys.modules[METHODS[name].__module__]


def build_method(cfg: Any, make_backbone: Callable[[], nn.Module]) -> EnsembleMethod:
    """The ensemble ``cfg.model.method`` asks for, built around fresh backbones from ``make_backbone``."""
    model = method_module(cfg.model.method).build(cfg, make_backbone)
    summary = getattr(model, "summary", None)
    if summary is not None:
        log.info("model.method=%s: %s", cfg.model.method, summary)
    else:
        log.info("model.method=%s: %d members, %s parameters", cfg.model.method, model.num_members,
                 f"{sum(p.numel() for p in model.parameters()):,}")
    return model


def member_major(cfg: Any, model: EnsembleMethod) -> bool:
    """Whether training batches are member-major (each member its own samples): ``model.member_batches``, or the
    method's default when unset."""
    choice = cfg.model.member_batches or type(model).default_member_batches
    return choice == "independent" and model.num_members > 1


class MemberStream:
    """M train streams, one per member, read in lockstep and concatenated member-major: batch ``(M·B, …)``.

    Member k's stream is the one a single run with ``seed = cfg.seed + k`` reads, so every member keeps its own
    data order (and augmentation draws); all have the same length, and ``iter_epoch(epoch, start)`` replays like
    the underlying streams do, so exact resume holds."""

    def __init__(self, streams: list[Any]) -> None:
        lengths = {len(s) for s in streams}
        if len(lengths) != 1:
            raise ValueError(f"member streams differ in length: {sorted(lengths)}")
        self.streams = streams

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
                xs = [map_tensors(x, lambda t, n=size: t[:n]) for x in xs]
                ys = [y[:size] for y in ys]
            if isinstance(xs[0], torch.Tensor):
                x = torch.cat(xs)
            else:
                x = type(xs[0])({k: torch.cat([xi[k] for xi in xs]) for k in xs[0]})
            yield x, torch.cat(ys)


def member_train_stream(cfg: Any, env: Any, data: Any, model: EnsembleMethod) -> Any:
    """``data`` with a member-major train stream when members get their own batches (``member_major``), else
    ``data`` unchanged. Member 0 reuses ``data.train``; member k reads the stream of seed ``cfg.seed + k`` (a raw
    dataset is shared by all members; a converted format gets one loader per member)."""
    if not member_major(cfg, model):
        return data
    from sigmanens_dist.data.loaders import MapStyleStream, build_data

    def stream(seed: int) -> Any:
        if isinstance(data.train, MapStyleStream):
            return MapStyleStream(data.train.dataset, cfg.train.batch_size, env, seed, data.train.num_workers)
        return build_data(cfg.data, cfg.train.batch_size, seed, env, cfg.train.randaugment).train

    streams = [data.train] + [stream(cfg.seed + k) for k in range(1, model.num_members)]
    return replace(data, train=MemberStream(streams))
