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
from collections.abc import Callable
from typing import Any

from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.methods.base import EnsembleMethod, Inputs, call_backbone, logits_of, map_tensors, member_chunks
from sigmanens_dist.methods.batch import BatchEnsemble
from sigmanens_dist.methods.deep import DeepEnsemble
from sigmanens_dist.methods.film import FiLMEnsemble
from sigmanens_dist.methods.packed import PackedEnsemble
from sigmanens_dist.methods.sigma import SigmaEnsemble
from sigmanens_dist.methods.single import SingleModel

__all__ = [
    "METHODS",
    "METHOD_NAMES",
    "EnsembleMethod",
    "Inputs",
    "build_method",
    "call_backbone",
    "display_name",
    "logits_of",
    "map_tensors",
    "member_chunks",
    "method_module",
]

log = logging.getLogger(__name__)

# model.method -> its class: the one place methods are listed (config/model_section.py's model.method Literal must
# match it, tests/methods/test_methods.py checks; config sits below this floor and cannot import it).
METHODS: dict[str, type[EnsembleMethod]] = {cls.name: cls for cls in (
    SigmaEnsemble, SingleModel, DeepEnsemble, BatchEnsemble, PackedEnsemble, FiLMEnsemble)}
METHOD_NAMES = tuple(METHODS)


def display_name(method: str) -> str:
    """``sigma`` → ``σN-Ens``: the name people know a method by, or the key for a method this version does not know."""
    cls = METHODS.get(method)
    return cls.display if cls is not None and cls.display else method


def method_module(name: str) -> Any:
    """The module of method ``name``, whose ``build(cfg, make_backbone)`` makes it from a config."""
    if name not in METHODS:
        raise UsageError(f"unknown model.method {name!r}; choose one of {', '.join(METHOD_NAMES)}")
    return sys.modules[METHODS[name].__module__]


def build_method(cfg: Config, make_backbone: Callable[[], nn.Module]) -> EnsembleMethod:
    """The ensemble ``cfg.model.method`` asks for, built around fresh backbones from ``make_backbone``."""
    model = method_module(cfg.model.method).build(cfg, make_backbone)
    summary = getattr(model, "summary", None)
    if summary is not None:
        log.info("model.method=%s: %s", cfg.model.method, summary)
    else:
        log.info("model.method=%s: %d members, %s parameters", cfg.model.method, model.num_members,
                 f"{sum(p.numel() for p in model.parameters()):,}")
    return model

