"""The training objective of an ensemble step: member task losses, their reduction over members, and λ·L_div.

Why the reduction is a choice (issue 10): with ``mean`` over members the shared weights get the average of the
member gradients (the same scale a single model's weights get), but each member's *own* parameters (its σ-store
row: γ and affine) get 1/M of the gradient a single model's norm parameters would, so they learn at lr/M.
``sum`` gives every member's own parameters the full single-model gradient, at the price of M× the gradient on
the shared weights. ``member_loss`` takes the reduction as a plain argument so any method (σN-Ens, Deep Ensembles,
…) can ask for the one it needs.

``member_loss`` takes ``(B,)`` labels every member shares or ``(M·B,)`` member-major ones
(``model.member_batches=independent``, see :class:`sigmanens_dist.data.member_streams.MemberStream`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.config import TrainConfig
from sigmanens_dist.errors import UsageError

__all__ = ["REDUCTIONS", "loss_reduction", "member_loss"]

REDUCTIONS = ("mean", "sum")
Reduction = Literal["mean", "sum"]


def member_loss(logits: torch.Tensor, y: torch.Tensor, smoothing: float = 0.0,
                reduction: Reduction = "mean") -> torch.Tensor:
    """Each member's cross-entropy (batch mean), reduced over members by ``reduction`` (``mean`` or ``sum``).

    ``logits`` is ``(M, B, K)``. ``y`` holds hard labels ``(B,)`` or soft labels ``(B, K)`` (mixup) shared by all
    members, or ``(M·B,)`` / ``(M·B, K)`` member-major when every member saw its own samples.
    """
    if reduction not in REDUCTIONS:
        raise UsageError(f"member loss reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    m, b = logits.shape[:2]
    if y.shape[0] == b:
        y = y.repeat(m, *([1] * (y.ndim - 1)))
    elif y.shape[0] != m * b:  # an invariant of the step: the loaders give B or M·B labels (a bug if hit)
        raise ValueError(f"labels for {y.shape[0]} samples do not fit logits of {m} members × {b} samples: "
                         f"give {b} (shared by the members) or {m * b} (member-major)")
    flat = logits.float().flatten(0, 1)
    if y.ndim == 2:  # soft targets
        per_sample = torch.sum(-y * F.log_softmax(flat, dim=-1), dim=-1)
    else:
        per_sample = F.cross_entropy(flat, y, label_smoothing=smoothing, reduction="none")
    per_member = per_sample.view(m, b).mean(dim=1)
    return per_member.sum() if reduction == "sum" else per_member.mean()


def loss_reduction(train: TrainConfig, model: nn.Module) -> Reduction:
    """``train.member_loss``, or when unset the method's own (``loss_reduction``: sum for a Deep Ensemble, whose
    members must each train as a single run; mean otherwise)."""
    return train.member_loss or getattr(type(model), "loss_reduction", "mean")

