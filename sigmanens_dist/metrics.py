"""Evaluation of member-vectorised ensembles: the ensemble predicts with the mean of its members' softmaxes.

Every state lives in a torchmetrics metric, so :meth:`EnsembleMetrics.compute` syncs across ranks under
torch.distributed. Loss sums accumulate in float64: feeding the data in one batch or in many gives the same numbers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor, nn
from torchmetrics import Metric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError
from torchmetrics.functional.classification import multiclass_calibration_error

__all__ = ["EnsembleMetrics", "reliability_diagram", "reliability_diagrams"]


def _sum() -> SumMetric:
    # NaN losses must show in the result, not be dropped; float64 makes the sums independent of batching.
    return SumMetric(nan_strategy="disable").set_dtype(torch.float64)


class EnsembleMetrics(nn.Module):
    """Accuracy, NLL, ECE, Brier, disagreement and entropy of the ensemble, plus accuracy, NLL and ECE per member.

    An ``nn.Module`` so that ``.to(device)`` moves every state. ``update`` takes member logits ``(M, B, K)``.
    """

    def __init__(self, num_classes: int, num_members: int, n_bins: int = 15) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes} must be at least 2")
        if num_members < 1:
            raise ValueError(f"num_members={num_members} must be at least 1")
        if n_bins < 1:
            raise ValueError(f"n_bins={n_bins} must be at least 1")
        self.num_classes, self.num_members, self.n_bins = num_classes, num_members, n_bins

        def acc() -> MulticlassAccuracy:
            return MulticlassAccuracy(num_classes, average="micro", validate_args=False)

        def ece() -> MulticlassCalibrationError:
            return MulticlassCalibrationError(num_classes, n_bins=n_bins, norm="l1", validate_args=False)

        self.acc, self.ece = acc(), ece()
        self.count, self.nll, self.brier, self.entropy, self.disagreement = (_sum() for _ in range(5))
        self.member_acc = nn.ModuleList(acc() for _ in range(num_members))
        self.member_ece = nn.ModuleList(ece() for _ in range(num_members))
        self.member_nll = nn.ModuleList(_sum() for _ in range(num_members))

    @torch.no_grad()
    def update(self, member_logits: Tensor, target: Tensor) -> None:
        """Add a batch: ``member_logits`` ``(M, B, K)``, ``target`` ``(B,)`` class indices."""
        self._check(member_logits, target)
        m, b, _ = member_logits.shape
        log_probs = member_logits.float().log_softmax(-1)  # (M, B, K)
        probs = log_probs.exp()
        # log of the mean probability, stably: logsumexp over members − log M.
        log_mean = log_probs.logsumexp(0) - math.log(m)  # (B, K)
        mean = probs.mean(0)
        rows = torch.arange(b, device=target.device)

        self.count.update(float(b))
        self.acc.update(mean, target)
        self.ece.update(mean, target)
        self.nll.update(-log_mean[rows, target])
        onehot = nn.functional.one_hot(target, self.num_classes).to(mean.dtype)
        self.brier.update((mean - onehot).square().sum(-1))
        self.entropy.update(torch.special.entr(mean).sum(-1))  # −p·log p, 0 where p = 0
        if m > 1:
            preds = probs.argmax(-1)  # (M, B)
            # Each unordered pair is counted twice by the full M×M comparison; the diagonal never differs.
            self.disagreement.update((preds[:, None] != preds[None]).sum() / 2)
        for i in range(m):
            self.member_acc[i].update(probs[i], target)
            self.member_ece[i].update(probs[i], target)
            self.member_nll[i].update(-log_probs[i, rows, target])

    def compute(self) -> dict[str, float]:
        """All metrics as floats, synced across ranks; ``member{m}/…`` per member and ``member_mean/…`` averages."""
        n = float(self.count.compute())
        if n == 0:
            raise RuntimeError("EnsembleMetrics.compute() called before any update(): there are no samples to score")
        m = self.num_members
        pairs = m * (m - 1) / 2
        out = {
            "acc": float(self.acc.compute()),
            "nll": float(self.nll.compute()) / n,
            "ece": float(self.ece.compute()),
            "brier": float(self.brier.compute()) / n,
            "disagreement": float(self.disagreement.compute()) / (pairs * n) if m > 1 else 0.0,
            "entropy": float(self.entropy.compute()) / n,
        }
        for i in range(m):
            out[f"member{i}/acc"] = float(self.member_acc[i].compute())
            out[f"member{i}/nll"] = float(self.member_nll[i].compute()) / n
            out[f"member{i}/ece"] = float(self.member_ece[i].compute())
        for key in ("acc", "nll", "ece"):
            out[f"member_mean/{key}"] = sum(out[f"member{i}/{key}"] for i in range(m)) / m
        return out

    def reset(self) -> None:
        """Forget every sample seen so far."""
        for module in self.modules():
            if isinstance(module, Metric):
                module.reset()

    def _check(self, member_logits: Tensor, target: Tensor) -> None:
        m, k = self.num_members, self.num_classes
        if member_logits.ndim != 3 or member_logits.shape[0] != m or member_logits.shape[2] != k:
            raise ValueError(f"member_logits must have shape (M={m}, B, K={k}), got {tuple(member_logits.shape)}")
        b = member_logits.shape[1]
        if target.ndim != 1 or target.shape[0] != b:
            raise ValueError(f"target must have shape (B={b},) to match member_logits {tuple(member_logits.shape)}, "
                             f"got {tuple(target.shape)}")
        if target.is_floating_point() or target.dtype == torch.bool:
            raise ValueError(f"target must hold integer class indices, got dtype {target.dtype}")
        lo, hi = torch.stack(torch.aminmax(target)).tolist()  # one device sync, not two
        if lo < 0 or hi >= k:
            raise ValueError(f"target values must lie in 0..{k - 1}, got min {lo}, max {hi}")


def reliability_diagram(probs: Tensor, target: Tensor, path: Path | str, title: str = "", n_bins: int = 15) -> Path:
    """One model's reliability diagram; see :func:`reliability_diagrams`."""
    return reliability_diagrams({title: (probs, target)}, path, n_bins=n_bins)


def reliability_diagrams(curves: dict[str, tuple[Tensor, Tensor]], path: Path | str, n_bins: int = 15) -> Path:
    """Side-by-side reliability diagrams (one column per model) saved as a PNG at ``path``; returns ``path``.

    ``curves`` maps a model's name to its predictive probabilities ``(N, K)`` and targets ``(N,)``. Each column
    shows accuracy per confidence bin against the diagonal, the gap to the bin's mean confidence, and below it how
    many samples fall in each bin. The ECE in each title is torchmetrics' (l1, ``n_bins`` equal-width bins).
    """
    if not curves:
        raise ValueError("curves is empty; give at least one {name: (probs, target)}")
    if n_bins < 1:
        raise ValueError(f"n_bins={n_bins} must be at least 1")
    path = Path(path)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    width = 1.0 / n_bins
    fig = Figure(figsize=(4.2 * len(curves), 5.4), layout="constrained")
    grid = fig.add_gridspec(2, len(curves), height_ratios=(3, 1))
    for col, (name, (probs, target)) in enumerate(curves.items()):
        acc, conf, count, ece = _bins(name, probs, target, n_bins)
        top = fig.add_subplot(grid[0, col])
        bottom = fig.add_subplot(grid[1, col], sharex=top)
        filled = count > 0
        top.bar(edges[:-1], acc, width=width, align="edge", color="tab:blue", edgecolor="black", linewidth=0.6,
                label="accuracy")
        top.bar(edges[:-1][filled], (conf - acc)[filled], bottom=acc[filled], width=width, align="edge",
                color="tab:red", alpha=0.3, edgecolor="tab:red", hatch="//", linewidth=0.6, label="gap to confidence")
        top.plot([0, 1], [0, 1], linestyle="--", color="gray", label="perfect calibration")
        top.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy", title=f"{name}\nECE = {100 * ece:.2f}%".lstrip())
        top.tick_params(labelbottom=False)
        top.legend(loc="upper left", fontsize="small")
        bottom.bar(edges[:-1], count, width=width, align="edge", color="tab:gray", edgecolor="black", linewidth=0.6)
        bottom.set(xlabel="confidence (max probability)", ylabel="samples")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _bins(name: str, probs: Tensor, target: Tensor, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per-bin accuracy, mean confidence and count (bins as torchmetrics draws them), and the ECE."""
    if probs.ndim != 2 or target.ndim != 1 or probs.shape[0] != target.shape[0] or probs.shape[0] == 0:
        raise ValueError(f"{name!r}: expected probs (N, K) and target (N,) with N ≥ 1, got {tuple(probs.shape)} "
                         f"and {tuple(target.shape)}")
    probs, target = probs.detach().float().cpu(), target.detach().long().cpu()
    if probs.min() < 0 or probs.max() > 1:
        raise ValueError(f"{name!r}: probs must be probabilities in [0, 1] (softmax the logits first), got values "
                         f"in [{float(probs.min()):.3g}, {float(probs.max()):.3g}]")
    num_classes = probs.shape[1]
    if target.min() < 0 or target.max() >= num_classes:
        raise ValueError(f"{name!r}: target values must lie in 0..{num_classes - 1}, got min {int(target.min())}, "
                         f"max {int(target.max())}")
    ece = float(multiclass_calibration_error(probs, target, num_classes, n_bins=n_bins, norm="l1"))
    conf, pred = probs.max(1)
    correct = (pred == target).double()
    # Same edges and right-closed bucketing as torchmetrics; a confidence of exactly 1 joins the last bin.
    index = (torch.bucketize(conf, torch.linspace(0, 1, n_bins + 1), right=True) - 1).clamp(max=n_bins - 1)
    count = torch.bincount(index, minlength=n_bins).double()
    safe = count.clamp(min=1)
    acc = torch.bincount(index, weights=correct, minlength=n_bins) / safe
    mean_conf = torch.bincount(index, weights=conf.double(), minlength=n_bins) / safe
    return acc.numpy(), mean_conf.numpy(), count.numpy(), ece
