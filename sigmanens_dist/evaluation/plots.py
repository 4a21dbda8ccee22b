"""The evaluation's pictures (PNG, matplotlib's object API: no global pyplot state, safe in any process).

The reliability diagrams are here too (the training loop draws one after its last validation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.metrics import calibration_error

__all__ = ["ood_histograms", "reliability_diagram", "reliability_diagrams", "reliability_diagrams_from_confidence",
           "severity_curves", "sharing_heatmap"]

_LABELS = {"msp": "−max softmax", "entropy": "predictive entropy", "mutual_information": "mutual information"}


def _figure(**kwargs: Any) -> Any:
    """A matplotlib Figure, matplotlib imported on first use: the training loop imports this module, and a run that
    draws nothing before its end should not pay for matplotlib at start-up."""
    from matplotlib.figure import Figure  # heavy: matplotlib, on first use (see above)

    return Figure(**kwargs)


def severity_curves(shift: dict[str, dict[str, dict[str, float]]], path: Path, title: str = "") -> Path:
    """Accuracy and ECE against corruption severity, one thin line per corruption and a thick mean."""
    fig = _figure(figsize=(9, 3.8), layout="constrained")
    for col, key in enumerate(("acc", "ece")):
        ax = fig.add_subplot(1, 2, col + 1)
        for name, by_sev in shift.items():
            sev = [int(s) for s in by_sev]
            mean = name == "mean"
            ax.plot(sev, [by_sev[str(s)][key] for s in sev], marker="o", linewidth=2.5 if mean else 1,
                    color="black" if mean else None, label=name, alpha=1 if mean else 0.7)
        ax.set(xlabel="severity", ylabel=key.upper() if key == "ece" else "accuracy", xticks=[1, 2, 3, 4, 5])
        ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", loc="best")
    fig.suptitle(f"shift: {title}".rstrip(": "))
    return _save(fig, path)


def ood_histograms(scores: dict[str, tuple[torch.Tensor, torch.Tensor]], path: Path, ood_name: str) -> Path:
    """Each OOD score's histogram for in-distribution and OOD samples (shared bins per score)."""
    fig = _figure(figsize=(4.2 * len(scores), 3.6), layout="constrained")
    for col, (score, (inside, outside)) in enumerate(scores.items()):
        ax = fig.add_subplot(1, len(scores), col + 1)
        values = torch.cat([inside, outside]).double().numpy()
        bins = np.linspace(values.min(), values.max() + 1e-12, 41)
        ax.hist(inside.double().numpy(), bins=bins, alpha=0.6, density=True, label="in-distribution")
        ax.hist(outside.double().numpy(), bins=bins, alpha=0.6, density=True, label=f"OOD ({ood_name})")
        ax.set(xlabel=_LABELS.get(score, score), ylabel="density")
        ax.legend(fontsize="small")
    return _save(fig, path)


def sharing_heatmap(layers: list[str], importances: torch.Tensor, path: Path) -> Path:
    """Mean importance σ(γ) per member (rows) and σ layer (columns): who owns which layers' features."""
    m, n = importances.shape
    fig = _figure(figsize=(min(2 + 0.18 * n, 24), 1.5 + 0.35 * m), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(importances.numpy(), aspect="auto", vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
    ax.set(xlabel="σ layer", ylabel="member", yticks=range(m))
    step = max(1, n // 40)
    ax.set_xticks(range(0, n, step), [layers[i] for i in range(0, n, step)], rotation=90, fontsize=6)
    fig.colorbar(image, ax=ax, label="mean σ(γ)")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


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
        raise UsageError("curves is empty; give at least one {name: (probs, target)}")
    return reliability_diagrams_from_confidence({name: _top1(name, p, t) for name, (p, t) in curves.items()}, path,
                                                n_bins)


def reliability_diagrams_from_confidence(curves: dict[str, tuple[Tensor, Tensor]], path: Path | str,
                                         n_bins: int = 15) -> Path:
    """:func:`reliability_diagrams` from each model's top-1 confidence ``(N,)`` and correctness ``(N,)`` (what
    :meth:`SampleMetrics.scores` keeps, so evaluation need not hold ``(N, K)`` probabilities)."""
    if not curves:
        raise UsageError("curves is empty; give at least one {name: (confidence, correct)}")
    if n_bins < 1:
        raise UsageError(f"n_bins={n_bins} must be at least 1")
    path = Path(path)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    width = 1.0 / n_bins
    fig = _figure(figsize=(4.2 * len(curves), 5.4), layout="constrained")
    grid = fig.add_gridspec(2, len(curves), height_ratios=(3, 1))
    for col, (name, (conf, correct)) in enumerate(curves.items()):
        acc, mean_conf, count, ece = _bins(conf, correct, n_bins)
        top = fig.add_subplot(grid[0, col])
        bottom = fig.add_subplot(grid[1, col], sharex=top)
        filled = count > 0
        top.bar(edges[:-1], acc, width=width, align="edge", color="tab:blue", edgecolor="black", linewidth=0.6,
                label="accuracy")
        top.bar(edges[:-1][filled], (mean_conf - acc)[filled], bottom=acc[filled], width=width, align="edge",
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


def _top1(name: str, probs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Checked top-1 confidence and correctness of ``probs`` ``(N, K)`` against ``target`` ``(N,)``."""
    # an invariant: evaluation hands the probabilities it computed (a bug if hit)
    if probs.ndim != 2 or target.ndim != 1 or probs.shape[0] != target.shape[0] or probs.shape[0] == 0:
        raise ValueError(f"{name!r}: expected probs (N, K) and target (N,) with N ≥ 1, got {tuple(probs.shape)} "
                         f"and {tuple(target.shape)}")
    probs, target = probs.detach().float().cpu(), target.detach().long().cpu()
    if probs.min() < 0 or probs.max() > 1:  # an invariant: evaluation hands softmax outputs (a bug if hit)
        raise ValueError(f"{name!r}: probs must be probabilities in [0, 1] (softmax the logits first), got values "
                         f"in [{float(probs.min()):.3g}, {float(probs.max()):.3g}]")
    num_classes = probs.shape[1]
    # an invariant: the labels were checked when read (a bug if hit)
    if target.min() < 0 or target.max() >= num_classes:
        raise ValueError(f"{name!r}: target values must lie in 0..{num_classes - 1}, got min {int(target.min())}, "
                         f"max {int(target.max())}")
    conf, pred = probs.max(1)
    return conf, (pred == target).float()


def _bins(conf: Tensor, correct: Tensor, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per-bin accuracy, mean confidence and count (bins as torchmetrics draws them), and the ECE."""
    conf, correct = conf.detach().double().cpu(), correct.detach().double().cpu()
    ece = calibration_error(conf, correct, n_bins)
    # Same edges and right-closed bucketing as torchmetrics; a confidence of exactly 1 joins the last bin.
    index = (torch.bucketize(conf, torch.linspace(0, 1, n_bins + 1, dtype=torch.float64), right=True) - 1).clamp(
        max=n_bins - 1)
    count = torch.bincount(index, minlength=n_bins).double()
    safe = count.clamp(min=1)
    acc = torch.bincount(index, weights=correct, minlength=n_bins) / safe
    mean_conf = torch.bincount(index, weights=conf, minlength=n_bins) / safe
    return acc.numpy(), mean_conf.numpy(), count.numpy(), ece
