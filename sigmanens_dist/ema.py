"""Exponential moving average of a model's weights and floating-point buffers.

Not ``torch.optim.swa_utils.AveragedModel(use_buffers=True)``: that one also "averages" integer buffers (in float,
truncated back: it corrupts the σ store's layout checksum and BN step counts) and walks every buffer name, so the
σ running stats, reachable both as the flat buffer and as per-layer views, would be averaged twice per step. Here
each storage is averaged once (views are skipped) and integer tensors are copied.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["EMA"]


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters and buffers, one tensor per storage: the σ store comes first in a SigmaEnsemble, so its flat
    buffers are kept and the per-layer views of them skipped (after a deepcopy those views no longer carry
    ``_base``, so sharing is judged by storage)."""
    seen: set[int] = set()
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            yield name, t


class EMA:
    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay!r}")
        self.decay = decay
        self.module = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        source = dict(_own_tensors(model))
        for name, mine in _own_tensors(self.module):
            theirs = source[name].detach()
            if mine.is_floating_point():
                mine.lerp_(theirs, 1.0 - self.decay)
            else:
                mine.copy_(theirs)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state)
