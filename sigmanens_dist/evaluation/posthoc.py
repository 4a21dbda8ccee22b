"""What ``sigmanens eval --calibration temperature|member-temperature`` and ``--conformal α[,α…]`` add to a report:
fitted (:mod:`sigmanens_dist.inference.posthoc`) on the calibration split (``data.calib_split``), else the
validation split (one pass, before any scored batch is read), then scored alongside every test and shift pass of the
K-member ensemble (the same forward pass feeds :class:`TemperedMetrics` and :class:`ConformalSets`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from sigmanens_dist.config import EvalConfig
from sigmanens_dist.evaluation.metrics import SampleMetrics
from sigmanens_dist.evaluation.report import SHIFT_KEYS, shift_mean
from sigmanens_dist.inference.collect import collect_logits
from sigmanens_dist.inference.conformal import in_sets, set_stats
from sigmanens_dist.inference.posthoc import PostHocFit, fit_posthoc
from sigmanens_dist.inference.temperature import Temperature, scale_logits, tempered_log_probs

__all__ = ["ConformalSets", "PostHoc", "TemperedMetrics", "fit_posthoc_on"]

CONFORMAL_KEYS = ("coverage", "set_size")


class TemperedMetrics(SampleMetrics):
    """:class:`SampleMetrics` of the calibrated model: member logits divided by ``temperature`` (one, or one per
    member) before scoring."""

    def __init__(self, temperature: Temperature, num_classes: int, num_members: int, **kwargs: object) -> None:
        super().__init__(num_classes, num_members, **kwargs)
        self.temperature = temperature

    def update(self, member_logits: Tensor, target: Tensor) -> None:
        super().update(scale_logits(member_logits, self.temperature), target)


class ConformalSets(Metric):
    """Coverage and size of the sets at ``thresholds`` (method -> q̂) of the ensemble prediction, member logits
    divided by ``temperature`` (one, or one per member) first (1: uncalibrated); per sample, so per class too, synced
    like SampleMetrics."""

    full_state_update = False

    def __init__(self, thresholds: dict[str, float], num_classes: int, temperature: Temperature = 1.0,
                 **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.thresholds, self.num_classes, self.temperature = thresholds, num_classes, temperature
        for name in ("covered", "size", "target"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, member_logits: Tensor, target: Tensor) -> None:
        probs = tempered_log_probs(member_logits, self.temperature).exp()
        covered, size = zip(*(set_stats(in_sets(probs, method, q), target) for method, q in self.thresholds.items()),
                            strict=True)
        self.covered.append(torch.stack(covered, -1))
        self.size.append(torch.stack(size, -1))
        self.target.append(target)

    def compute(self) -> dict[str, dict]:
        """Per method: ``coverage``, mean ``set_size`` and ``per_class`` (coverage, set size, samples per class)."""
        covered, size = dim_zero_cat(self.covered).double(), dim_zero_cat(self.size).double()
        target = dim_zero_cat(self.target).long()
        count = torch.bincount(target, minlength=self.num_classes).double()
        out = {}
        for j, method in enumerate(self.thresholds):
            by_cov = torch.zeros(self.num_classes, dtype=torch.float64, device=count.device)
            by_size = torch.zeros_like(by_cov)
            by_cov.index_add_(0, target, covered[:, j])
            by_size.index_add_(0, target, size[:, j])
            out[method] = {"coverage": float(covered[:, j].mean()), "set_size": float(size[:, j].mean()),
                           "per_class": [{"class": c, "n": int(count[c]), "coverage": float(by_cov[c] / count[c]),
                                          "set_size": float(by_size[c] / count[c])} if count[c] else
                                         {"class": c, "n": 0, "coverage": math.nan, "set_size": math.nan}
                                         for c in range(self.num_classes)]}
        return out


@dataclass
class PostHoc:
    """A post-hoc fit (:class:`~sigmanens_dist.inference.posthoc.PostHocFit`) and the report parts its scores fill:
    ``part["calibration"]``, ``part["member_calibration"]`` and ``part["conformal"]`` (a list, one entry per α)."""

    fit: PostHocFit
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, fit: PostHocFit) -> PostHoc:
        """The report parts of ``fit``, each with what it was fitted on and an empty shift table to fill."""
        parts: dict[str, dict[str, Any]] = {}
        if fit.calibrate:
            parts["calibration"] = {"method": "temperature", "temperature": fit.temperature,
                                    **fit.provenance(fit.nll_after), "shift": {}}
        if fit.member_temperatures is not None:
            parts["member_calibration"] = {"method": "member-temperature",
                                           "temperatures": list(fit.member_temperatures),
                                           **fit.provenance(fit.member_nll_after), "shift": {}}
        if fit.alphas:
            parts["conformal"] = [{"alpha": alpha, "calibrated_on": fit.fitted_on, "num_calibration": fit.num_fit,
                                   "temperature": fit.applied if fit.calibrate else None,
                                   "methods": {m: {"qhat": q, "shift": {}} for m, q in qs.items()}}
                                  for alpha, qs in zip(fit.alphas, fit.thresholds, strict=True)]
        return cls(fit, parts)

    def metrics(self, num_classes: int, num_members: int, sync: bool) -> dict[str, Metric]:
        """Fresh metrics for one pass of the K-member ensemble."""
        fit, out = self.fit, {}
        if fit.calibrate:
            out["calibration"] = TemperedMetrics(fit.temperature, num_classes, num_members, sync_on_compute=sync)
        if fit.member_temperatures is not None:
            out["member_calibration"] = TemperedMetrics(list(fit.member_temperatures), num_classes, num_members,
                                                        sync_on_compute=sync)
        for j, thresholds in enumerate(fit.thresholds):
            out[f"conformal/{j}"] = ConformalSets(thresholds, num_classes, fit.applied, sync_on_compute=sync)
        return out

    def record(self, metrics: dict[str, Metric], corruption: str | None = None, severity: int = 0) -> None:
        """Put a pass's results into the parts: the clean test pass (``corruption`` None) or one shift pass."""
        for name, metric in metrics.items():
            values = metric.compute()
            if name in ("calibration", "member_calibration"):
                if corruption is None:
                    self.parts[name]["metrics"] = values
                else:
                    self.parts[name]["shift"].setdefault(corruption, {})[str(severity)] = {
                        k: values[k] for k in SHIFT_KEYS}
                continue
            entry = self.parts["conformal"][int(name.split("/")[1])]
            for method, result in values.items():
                target = entry["methods"][method]
                if corruption is None:
                    target |= result
                else:
                    target["shift"].setdefault(corruption, {})[str(severity)] = {k: result[k] for k in CONFORMAL_KEYS}

    def record_stream(self, metrics: dict[str, Metric], which: str) -> None:
        """Put a mixed stream's results (``which``: its clean images, or all of them) into the parts' ``stream``."""
        for name, metric in metrics.items():
            values = metric.compute()
            if name in ("calibration", "member_calibration"):
                self.parts[name].setdefault("stream", {})[which] = {k: values[k] for k in SHIFT_KEYS}
                continue
            entry = self.parts["conformal"][int(name.split("/")[1])]
            for method, result in values.items():
                entry["methods"][method].setdefault("stream", {})[which] = {k: result[k] for k in CONFORMAL_KEYS}

    def finish_shift(self, severities: list[int]) -> None:
        """The mean over corruptions per severity, as ``part["shift"]["mean"]``."""
        tables = [self.parts[name]["shift"] for name in ("calibration", "member_calibration") if name in self.parts] + [
            m["shift"] for entry in self.parts.get("conformal", []) for m in entry["methods"].values()]
        for table in tables:
            if table:
                table["mean"] = shift_mean(table, severities)


def fit_posthoc_on(model: nn.Module, batches: Callable[[], Iterable[Any]], options: EvalConfig,
                   device: torch.device, desc: str, split: str = "val") -> PostHoc:
    """What ``options`` asks for (:func:`~sigmanens_dist.inference.posthoc.fit_posthoc`) fitted on the logits of
    one pass of ``batches`` (of the validation split, or of the calibration split: ``split`` names it in the
    report), the only pass it reads."""
    logits, target = collect_logits(model, batches(), device, f"{desc} fit on {split}")
    return PostHoc.of(fit_posthoc(logits, target, options.calibration, options.conformal, split))
