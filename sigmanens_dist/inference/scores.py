"""The ensemble's per-input scores from its member logits ``(M, B, K)``: the prediction is the mean of the members'
softmaxes; its entropy, and the mutual information between prediction and member (the epistemic part). The one
definition the metrics, the OOD scores and the program's outputs share."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["disagreement", "ensemble_log_probs", "entropy", "mutual_information", "predictive_entropy"]


def ensemble_log_probs(member_logits: Tensor) -> Tensor:
    """log of the mean member softmax, ``(M, B, K) -> (B, K)``, computed stably (logsumexp over members − log M)."""
    return member_logits.float().log_softmax(-1).logsumexp(0) - math.log(member_logits.shape[0])


def entropy(log_probs: Tensor) -> Tensor:
    """Shannon entropy (nats) over the last dim from log-probabilities; ``0·log 0 = 0``."""
    return torch.special.entr(log_probs.exp()).sum(-1)


def predictive_entropy(member_logits: Tensor) -> Tensor:
    """Entropy of the ensemble prediction (mean of member softmaxes) per sample: ``(M, B, K) -> (B,)``."""
    return entropy(ensemble_log_probs(member_logits))


def mutual_information(member_logits: Tensor) -> Tensor:
    """Mutual information between prediction and member, per sample: entropy of the mean minus the mean member
    entropy, ``(M, B, K) -> (B,)``. Zero when all members agree; the ensemble's epistemic uncertainty."""
    member = entropy(member_logits.float().log_softmax(-1)).mean(0)
    return (predictive_entropy(member_logits) - member).clamp_min(0)


def disagreement(member_logits: Tensor) -> Tensor:
    """The share of member pairs whose top-1 classes differ, per sample, ``(M, B, K) -> (B,)``; 0 with one member."""
    m = member_logits.shape[0]
    preds = member_logits.argmax(-1)  # (M, B)
    pairs = max(m * (m - 1) // 2, 1)
    return (preds[:, None] != preds[None]).sum((0, 1)).float() / (2 * pairs)
