"""OOD detection: an ensemble's uncertainty is only useful if it is higher on inputs unlike the training data.

:func:`score_ood` is what ``sigmanens eval`` reports: for each of :data:`OOD_SCORES` (max softmax, entropy, mutual
information) how well it separates the eval set from an OOD set (AUROC 1: perfectly, 0.5: not at all). The
lighter :func:`ood_scores` measures predictive entropy alone for any model and two loaders. The OOD sets are in
:mod:`sigmanens_dist.data.ood`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.metrics import ood_detection
from sigmanens_dist.evaluation.scoring import score_pass
from sigmanens_dist.inference.scores import predictive_entropy

__all__ = ["OOD_SCORES", "ood_scores", "score_ood"]

OOD_SCORES = ("msp", "entropy", "mutual_information")


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
        raise UsageError(f"ood_scores: {which} yielded no samples")
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


def score_ood(model: nn.Module, in_scores: dict[str, torch.Tensor], batches: Callable[[], Iterable], num_classes: int,
              device: torch.device, variant: str, name: str) -> dict[str, Any]:
    """OOD set ``name`` (``batches()``: its ``(x, _)`` batches) against the eval set's per-sample ``in_scores``: the
    detection metrics of each score, OOD positive, and both sets' scores under ``"_scores"`` for the plots."""
    metrics, _ = score_pass(model, ((x, torch.zeros(len(x), dtype=torch.long)) for x, _ in batches()), num_classes,
                            device, f"{variant} ood {name}")
    out_scores = metrics.scores()
    report: dict[str, Any] = {"set": name, "num_in": len(in_scores["msp"]), "num_out": len(out_scores["msp"])}
    for score in OOD_SCORES:
        report[score] = ood_detection(in_scores[score].cpu(), out_scores[score].cpu())
    report["_scores"] = {s: (in_scores[s].cpu(), out_scores[s].cpu()) for s in OOD_SCORES}  # for the plots only
    return report
