"""OOD detection by predictive entropy: an ensemble's uncertainty is only useful if it is higher on inputs unlike
the training data. ``ood_scores`` measures how well predictive entropy separates in-distribution samples from OOD
ones (AUROC 1: perfectly, 0.5: not at all); the OOD sets are in :mod:`sigmanens_dist.data.ood`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sigmanens_dist.evaluation.metrics import ood_detection, predictive_entropy

__all__ = ["ood_scores"]


@torch.no_grad()
def _entropies(model: nn.Module, loader: Iterable[Any], device: torch.device, which: str) -> torch.Tensor:
    out = []
    for batch in loader:
        x = batch[0] if isinstance(batch, tuple | list) else batch
        x = {k: v.to(device) for k, v in x.items()} if isinstance(x, dict) else x.to(device)
        logits = model(x)
        if logits.ndim == 2:  # a plain classifier: one member
            logits = logits.unsqueeze(0)
        out.append(predictive_entropy(logits).cpu())
    if not out or sum(len(e) for e in out) == 0:
        raise ValueError(f"ood_scores: {which} yielded no samples")
    return torch.cat(out)


def ood_scores(model: nn.Module, in_loader: Iterable[Any], out_loader: Iterable[Any],
               device: torch.device | str | None = None) -> dict[str, float]:
    """AUROC of predictive entropy for telling ``out_loader``'s samples (positives) from ``in_loader``'s, plus each
    set's mean entropy. Loaders yield ``(x, y)`` batches (labels unused) or bare inputs; the model returns member
    logits ``(M, B, K)`` (or ``(B, K)``). The model is scored in eval mode and left in the mode it was in."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        ent_in = _entropies(model, in_loader, device, "in_loader")
        ent_out = _entropies(model, out_loader, device, "out_loader")
    finally:
        model.train(was_training)
    auroc = ood_detection(ent_in, ent_out)["auroc"]
    return {"auroc_entropy": auroc, "entropy_in": float(ent_in.mean()), "entropy_out": float(ent_out.mean()),
            "num_in": float(len(ent_in)), "num_out": float(len(ent_out))}
