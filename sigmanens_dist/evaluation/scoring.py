"""One scored pass of an ensemble over a dataset: the metrics of every sample and the time the model alone took
(shared by the test-set, shift and OOD passes of ``sigmanens eval``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from sigmanens_dist.evaluation.metrics import SampleMetrics
from sigmanens_dist.inference.collect import not_main
from sigmanens_dist.methods.base import map_tensors
from sigmanens_dist.progress import progress

__all__ = ["Transform", "score_pass"]

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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
