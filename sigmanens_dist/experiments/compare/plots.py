"""The comparison's plots (matplotlib, imported with this module: compare's report is its only user): metric vs M,
the accuracy / calibration Pareto front, σN-Ens's sharing over training, NLL vs cost, ECE vs severity."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from sigmanens_dist.experiments.compare.records import Group, _uses


def _series(groups: list[Group]) -> dict[str, list[Group]]:
    """Groups per line in a plot: a method with its τ and λ."""
    lines: dict[str, list[Group]] = defaultdict(list)
    budgeted = {g.method for g in groups if g.budget != 1}
    for g in groups:
        extra = (f" τ={g.tau:g}" if g.tau is not None else "") + (f" λ={g.lam:g}" if g.lam is not None else "")
        if g.method in budgeted:
            extra += " (steps × budget)"  # the equal-compute line: budget b is drawn at M = b
        lines[g.display + extra].append(g)
    return lines


def _errorbar(ax: Any, xs: list[float], groups: list[Group], column: str, label: str, color: Any = None) -> None:
    ys = [g.mean(column) for g in groups]
    es = [0.0 if math.isnan(g.std(column)) else g.std(column) for g in groups]
    ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label, color=color)


def _colors(n: int) -> list[Any]:
    """``n`` distinct colours (matplotlib's default cycle repeats after 10 lines)."""
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _plot_members(groups: list[Group], path: Path) -> Path | None:
    """Accuracy, NLL and ECE against M, one line per method (and τ, λ); needs two or more values of M."""
    if len({g.members * g.budget for g in groups}) < 2:
        return None
    series = _series(groups)
    fig = Figure(figsize=(17, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for (label, gs), color in zip(series.items(), _colors(len(series)), strict=True):
        gs = sorted(gs, key=lambda g: g.members * g.budget)
        for ax, column in zip(axes, ("acc", "nll", "ece"), strict=True):
            _errorbar(ax, [g.members * g.budget for g in gs], gs, column, label, color)
    for ax, title in zip(axes, ("accuracy", "NLL", "ECE"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("members M")
        ax.set_title(f"{title} vs M (mean ± std over seeds)")
        ax.grid(alpha=0.3)
    budgeted = any(g.budget != 1 for g in groups)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title="a single model at b× the steps\nis drawn at M = b (equal compute)" if budgeted else None,
               title_fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto frontier of (ECE, accuracy) points: those no other point beats on both, by increasing ECE."""
    frontier: list[tuple[float, float]] = []
    for ece, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not frontier or acc > frontier[-1][1]:
            frontier.append((ece, acc))
    return frontier


def _plot_pareto(groups: list[Group], path: Path) -> Path | None:
    """The paper's figure: accuracy against ECE, and against ECE under shift (mean of severities 3 and 5) where the
    runs were evaluated on corruptions; one point per grid point, a σN-Ens point labelled with τ and its measured
    members on per feature; the Pareto frontier (no other point is both more accurate and better calibrated) drawn
    as a staircase through the points on it."""
    panels = [(c, t) for c, t in (("ece", "ECE"), ("ece_shift", "ECE under shift (mean of severities 3 and 5)"))
              if sum(not math.isnan(g.mean(c) + g.mean("acc")) for g in groups) >= 2]
    if not panels:
        return None
    fig = Figure(figsize=(7 * len(panels) + 2, 5.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    methods = list(dict.fromkeys(g.display for g in groups))
    colors = dict(zip(methods, _colors(len(methods)), strict=True))
    for ax, (column, title) in zip(axes, panels, strict=True):
        points = [(g.mean(column), g.mean("acc"), g) for g in groups if not math.isnan(g.mean(column) + g.mean("acc"))]
        for method in methods:
            mine = [p for p in points if p[2].display == method]
            if not mine:
                continue
            ax.scatter([p[0] for p in mine], [p[1] for p in mine], label=method, s=40, color=colors[method])
            for x, y, g in mine:
                label = " ".join(
                    ([f"τ={g.tau:g}"] if g.tau is not None else []) + ([f"λ={g.lam:g}"] if g.lam == 0 else [])
                    + ([f"M={g.members}"] if _uses(g.method, "members") and len({p[2].members for p in points}) > 1
                       else []) + ([f"{g.mean('sharing'):.2f} on"] if not math.isnan(g.mean("sharing")) else [])
                    + ([f"{g.budget}× steps"] if g.budget != 1 else []))
                ax.annotate(label, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        frontier = _frontier([(x, y) for x, y, _ in points])
        xs = [frontier[0][0], *(x for x, _ in frontier[1:] for _ in (0, 1))]
        ys = [y for _, y in frontier for _ in (0, 1)][: len(xs)]
        xmax = max(x for x, _, _ in points)
        ax.plot([*xs, xmax], [*ys, frontier[-1][1]], "k--", lw=1, label="Pareto frontier")
        ax.ticklabel_format(useOffset=False)
        ax.set_xlabel(f"{title} (lower is better)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"accuracy vs {title.split(' (')[0]}")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title="σN-Ens points: τ and\nmembers on per feature", title_fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _plot_sharing(groups: list[Group], path: Path) -> Path | None:
    """How τ sets the sharing during training: per σN-Ens grid point (its first seed), the histogram of the
    importances σ(γ) at every validation step as a heat map, with the members on per feature above it."""
    series = [(g, g.runs[min(g.runs)]) for g in groups if g.tau is not None and g.runs[min(g.runs)].sharing_history]
    if not series:
        return None
    from sigmanens_dist.methods.sigma import IMPORTANCE_BINS  # methods import torch: only this plot needs it

    fig = Figure(figsize=(3.2 * len(series) + 1, 5.5), layout="constrained")
    axes = fig.subplots(2, len(series), squeeze=False, sharex="col", height_ratios=[1, 2.2])
    image = None
    for col, (g, run) in enumerate(series):
        steps = sorted(run.sharing_history)
        on = [run.sharing_history[s][0] for s in steps]
        hist = np.array([run.sharing_history[s][1] for s in steps]).T  # bins × steps
        axes[0, col].plot(steps, on, marker=".", color="k")
        axes[0, col].set_ylim(0, g.members + 0.3)
        axes[0, col].set_title(f"τ={g.tau:g} λ={g.lam:g} M={g.members}\n(seed {min(g.runs)})", fontsize=9)
        axes[0, col].grid(alpha=0.3)
        image = axes[1, col].imshow(hist, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1,
                                    extent=(steps[0], steps[-1], 0, 1), interpolation="nearest")
        axes[1, col].set_xlabel("step")
    axes[0, 0].set_ylabel("members on\nper feature")
    axes[1, 0].set_ylabel(f"σ(γ) ({IMPORTANCE_BINS} bins)")
    fig.colorbar(image, ax=axes[1, :].tolist(), label="fraction of member × feature importances")
    fig.suptitle("importance trajectories: σ(γ) over training, per τ")
    fig.savefig(path, dpi=110)
    return path


def _plot_cost(groups: list[Group], path: Path) -> Path | None:
    """NLL against parameter count and against training compute, one line per method (and τ, λ)."""
    if not any("params" in r.values or "train_compute" in r.values for g in groups for r in g.runs.values()):
        return None
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    for label, gs in _series(groups).items():
        for ax, column in zip(axes, ("params", "train_compute"), strict=True):
            mine = sorted((g for g in gs if not math.isnan(g.mean(column))), key=lambda g: g.mean(column))
            if mine:
                _errorbar(ax, [g.mean(column) for g in mine], mine, "nll", label)
    for ax, xlabel in zip(axes, ("parameters", "training compute (images × members through the backbone)"),
                          strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("NLL")
        ax.grid(alpha=0.3)
    axes[0].set_title("NLL vs parameters")
    axes[1].set_title("NLL vs training compute")
    with_lines = [ax for ax in axes if ax.get_legend_handles_labels()[0]]  # runs may lack one of the two columns
    if with_lines:
        with_lines[0].legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _plot_severity(groups: list[Group], path: Path) -> Path | None:
    """ECE against corruption severity per grid point, when the runs logged per-severity ECE metrics."""
    if not any(r.severity_ece for g in groups for r in g.runs.values()):
        return None
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    for g in groups:
        sev = sorted({s for r in g.runs.values() for s in r.severity_ece})
        if sev:
            means = [float(np.mean([r.severity_ece[s] for r in g.runs.values() if s in r.severity_ece])) for s in sev]
            ax.plot(sev, means, marker="o", label=g.label())
    ax.set_xlabel("corruption severity")
    ax.set_ylabel("ECE")
    ax.set_title("ECE vs corruption severity (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path
