"""One scored pass of an ensemble over a dataset: the metrics of every sample and the time the model alone took
(shared by the test-set, shift and OOD passes of ``sigmanens eval``); and the logits of a pass, for what is fitted on
the validation split (temperature, conformal thresholds)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics import Metric

from sigmanens_dist.evaluation.metrics import SampleMetrics
from sigmanens_dist.methods.base import map_tensors
from sigmanens_dist.progress import progress

__all__ = ["Transform", "collect_logits", "not_main", "score_pass"]

Transform = Callable[[torch.Tensor, int], torch.Tensor]  # (normalised batch, batch index) -> batch


@torch.no_grad()
def score_pass(model: nn.Module, batches: Iterable[Any], num_classes: int, device: torch.device, desc: str,
               transform: Transform | None = None, sync: bool = False, also: Sequence[Metric] = ()
               ) -> tuple[SampleMetrics, float]:
    """Run ``model`` over ``batches`` of ``(x, y)``; returns the filled :class:`SampleMetrics` and the seconds spent
    in the model's forward passes alone (data loading and corruption excluded). The metrics in ``also`` are fed the
    same logits (the calibrated and conformal scores: one forward pass for all)."""
    model.eval()
    metrics = SampleMetrics(num_classes, model.num_members, sync_on_compute=sync).to(device)
    also = [extra.to(device) for extra in also]
    seconds = 0.0
    for i, (x, y) in enumerate(progress(batches, desc=desc, unit="batch", leave=False, disable=not_main())):
        x, y = map_tensors(x, lambda t: t.to(device)), y.to(device)
        if transform is not None:
            x = transform(x, i)
        _synchronize(device)
        start = time.perf_counter()
        logits = model(x)
        _synchronize(device)
        seconds += time.perf_counter() - start
        metrics.update(logits.float(), y)
        for extra in also:
            extra.update(logits.float(), y)
    return metrics, seconds


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
