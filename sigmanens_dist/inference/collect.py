"""The member logits of one pass over a split: what a post-hoc fit (temperature, conformal thresholds) reads, in
eval and in a program's export alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sigmanens_dist.methods.base import map_tensors
from sigmanens_dist.progress import progress

__all__ = ["collect_logits", "not_main"]


@torch.no_grad()
def collect_logits(model: nn.Module, batches: Iterable[Any], device: torch.device, desc: str
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Member logits ``(M, N, K)`` (float32, CPU) and targets ``(N,)`` of a pass; under torch.distributed gathered
    from every rank in rank order, so that every rank fits the same numbers on the whole split."""
    model.eval()
    logits, targets = [], []
    for x, y in progress(batches, desc=desc, unit="batch", leave=False, disable=not_main()):
        logits.append(model(map_tensors(x, lambda t: t.to(device))).float().cpu())
        targets.append(y.cpu())
    out = torch.cat(logits, 1), torch.cat(targets)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        out = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts])
    return out


def not_main() -> bool:
    """One progress bar: rank 0's."""
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
