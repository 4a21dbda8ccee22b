"""The evaluation's pictures (PNG, matplotlib's object API: no global pyplot state, safe in any process).

The reliability diagram lives in ``sigmanens_dist.evaluation.metrics`` (the training loop draws it too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

__all__ = ["ood_histograms", "severity_curves", "sharing_heatmap"]

_LABELS = {"msp": "−max softmax", "entropy": "predictive entropy", "mutual_information": "mutual information"}


def severity_curves(shift: dict[str, dict[str, dict[str, float]]], path: Path, title: str = "") -> Path:
    """Accuracy and ECE against corruption severity, one thin line per corruption and a thick mean."""
    fig = Figure(figsize=(9, 3.8), layout="constrained")
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
    fig = Figure(figsize=(4.2 * len(scores), 3.6), layout="constrained")
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
    fig = Figure(figsize=(min(2 + 0.18 * n, 24), 1.5 + 0.35 * m), layout="constrained")
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
