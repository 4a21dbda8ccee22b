"""Exponential moving average of a model's weights and floating-point buffers.

:class:`EMA` keeps a copy of the model (whole parameters: DDP, ZeRO-1/2); :class:`ShardedEMA` keeps one shadow per
parameter shard where the model keeps it (FSDP2, which cannot be deep-copied) and is scored by swapping the
shadows into the model. Both answer ``update``, ``scored`` (the module to evaluate), ``state_dict`` and
``load_state_dict`` in the model's own state-dict form, so checkpoints, ``sigmanens eval`` and export read either.

Not ``torch.optim.swa_utils.AveragedModel(use_buffers=True)``: that one also "averages" integer buffers (in float,
truncated back: it corrupts the σ store's layout checksum and BN step counts) and walks every buffer name, so the
σ running stats, reachable both as the flat buffer and as per-layer views, would be averaged twice per step. Here
each piece of memory is averaged once (views are skipped) and integer tensors are copied.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from sigmanens_dist.errors import UsageError

__all__ = ["EMA", "ShardedEMA", "build_ema"]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` covers (its local shard's, for a DTensor)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.data_ptr(), local.data_ptr() + local.numel() * local.element_size()


def _own_names(module: nn.Module) -> list[str]:
    """Parameters and buffers, each piece of memory once: a tensor lying inside one already listed is a view of it
    and is skipped. The σ store comes first in a SigmaEnsemble, so its flat buffers are kept and the per-layer views
    of them skipped. Tensors that only share a storage without overlapping (DeepSpeed's flattened parameters) are
    all kept, and so are empty shards (a (1, N, C) position embedding sharded over more ranks than rows)."""
    kept: list[tuple[int, int]] = []
    names = []
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        lo, hi = _span(t)
        if hi > lo and any(a <= lo and hi <= b for a, b in kept):
            continue
        kept.append((lo, hi))
        names.append(name)
    return names


def _tensors(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    everything = dict(module.named_parameters()) | dict(module.named_buffers())
    return {name: everything[name] for name in names}


def _resharded(module: nn.Module) -> nn.Module:
    """``module`` with every FSDP2 unit sharded: a unit left unsharded after its forward (the root) would expose
    views into its all-gather buffer instead of its shards (a no-op for a unit that is sharded, or for no FSDP)."""
    from torch.distributed.fsdp import FSDPModule  # public from torch 2.6; pyproject allows 2.4: FSDP runs only

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return module


def _check(decay: float) -> None:
    if not 0.0 < decay < 1.0:
        raise UsageError(f"EMA decay must be in (0, 1), got {decay!r}")


@torch.no_grad()
def _average(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], decay: float) -> None:
    for name, t in mine.items():
        source = theirs[name].detach()
        if t.is_floating_point():
            t.lerp_(source, 1.0 - decay)
        else:
            t.copy_(source)


class EMA:
    """A whole copy of the model, averaged in place."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        _check(decay)
        self.decay, self.names = decay, _own_names(model)
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    def update(self, model: nn.Module) -> None:
        _average(_tensors(self.module, self.names), _tensors(model, self.names), self.decay)

    @contextlib.contextmanager
    def scored(self, model: nn.Module) -> Iterator[nn.Module]:
        yield self.module

    def state_dict(self, model: nn.Module | None = None) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any], model: nn.Module | None = None) -> None:
        self.module.load_state_dict(state)


class ShardedEMA:
    """The average of a sharded model, one shadow per tensor with the model's own placement (a DTensor shard for a
    sharded parameter, so it costs 1/world of a copy): averaging is local, with no communication."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        _check(decay)
        self.decay, self.names = decay, _own_names(_resharded(model))
        self.shadow = {name: t.detach().clone() for name, t in _tensors(model, self.names).items()}

    def update(self, model: nn.Module) -> None:
        _average(self.shadow, _tensors(_resharded(model), self.names), self.decay)

    @contextlib.contextmanager
    def scored(self, model: nn.Module) -> Iterator[nn.Module]:
        """``model`` holding the averaged weights while inside; its own weights are put back after."""
        own = _tensors(_resharded(model), self.names)
        with torch.no_grad():
            kept = {name: t.detach().clone() for name, t in own.items()}
            for name, t in own.items():
                t.detach().copy_(self.shadow[name])
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, t in own.items():
                    t.detach().copy_(kept[name])

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The averaged weights in ``model``'s state-dict form (DTensors for sharded tensors), for DCP."""
        with self.scored(model):
            return {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None:
        """Load ``state`` through ``model`` (which reshards it) and keep it as the shadows; ``model``'s own weights
        are put back by :meth:`scored`."""
        with self.scored(model):
            set_model_state_dict(model, state)
            for name, t in _tensors(model, self.names).items():
                self.shadow[name].copy_(t.detach())


def build_ema(strategy: Any, decay: float) -> EMA | ShardedEMA:
    """The weight average ``strategy`` can keep (after its ``build_optimizer``), handed to it for its checkpoints:
    shadows of the local shards where parameters are sharded (FSDP2 modules cannot be deep-copied; saved with the
    DCP shards), else a whole copy of the model."""
    kind = ShardedEMA if strategy.sharded_parameters else EMA
    strategy.ema = kind(strategy.model, decay)
    return strategy.ema
