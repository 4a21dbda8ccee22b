"""Statistics over seeds: runs grouped by grid point, the paired difference to a reference (mean, 95% t interval)
and which reference group a group is paired with (equal epochs or equal training compute)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import stats

from sigmanens_dist.experiments.compare.records import Group, RunRecord, _uses
from sigmanens_dist.experiments.study import method_table

__all__ = ["group_runs", "paired_difference", "reference_for"]

def group_runs(records: list[RunRecord]) -> list[Group]:
    groups: dict[tuple[Any, ...], Group] = {}
    for r in records:
        g = groups.setdefault(r.key, Group(r.method, r.members, r.tau, r.lam, r.budget, {}, r.variant))
        g.runs[r.seed] = r
    order = {m: i for i, m in enumerate(method_table())}

    def sort_key(g: Group) -> tuple[Any, ...]:
        return (order.get(g.method, len(order)), g.method, g.variant, g.budget, g.members,
                -1 if g.tau is None else g.tau, -1 if g.lam is None else g.lam)

    return sorted(groups.values(), key=sort_key)


def paired_difference(group: Group, ref: Group, column: str) -> tuple[float, float, float, int]:
    """Mean of (group − reference) over the seeds both have, and its 95% t interval; NaN interval below 2 pairs."""
    seeds = sorted(s for s in group.runs.keys() & ref.runs.keys()
                   if column in group.runs[s].values and column in ref.runs[s].values)
    d = np.array([group.runs[s].values[column] - ref.runs[s].values[column] for s in seeds], dtype=float)
    if len(d) == 0:
        return math.nan, math.nan, math.nan, 0
    if len(d) == 1:
        return float(d[0]), math.nan, math.nan, 1
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    return float(d.mean()), float(d.mean()) - half, float(d.mean()) + half, len(d)


def reference_for(group: Group, groups: list[Group], reference: str, pair: str = "epochs") -> Group | None:
    """The reference method's group to pair ``group`` with (``PAIRINGS``); None if not exactly one. ``members``:
    the group's own configuration at the next smaller M (the reference method plays no part). Where the reference
    method comes in several variants, its default one is the reference (a variant is paired against it)."""
    if pair == "members":
        same = (group.method, group.variant, group.tau, group.lam, group.budget)
        smaller = [g for g in groups if (g.method, g.variant, g.tau, g.lam, g.budget) == same
                   and g.members < group.members]
        return max(smaller, key=lambda g: g.members, default=None)
    candidates = [g for g in groups if g.method == reference]
    axes = [("reg", "tau"), ("reg", "lam")] + ([("members", "members")] if pair == "epochs" else [])
    for axis, attr in axes:
        if _uses(reference, axis) and _uses(group.method, axis):
            candidates = [g for g in candidates if getattr(g, attr) == getattr(group, attr)]
    if pair == "epochs":
        candidates = [g for g in candidates if g.budget == group.budget]
    else:
        compute = group.mean("train_compute")
        candidates = [g for g in candidates if math.isclose(g.mean("train_compute"), compute, rel_tol=0.01)]
    if len(candidates) > 1:  # the reference method in several variants (e.g. two γ starts): its defaults
        candidates = [g for g in candidates if not g.variant]
    return candidates[0] if len(candidates) == 1 else None
