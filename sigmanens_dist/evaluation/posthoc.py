"""What ``sigmanens eval --calibration temperature|member-temperature`` and ``--conformal α[,α…]`` add to a report:
fitted on the calibration split (``data.calib_split``), else the validation split (one pass, before any scored batch
is read), then scored alongside every test and shift pass of the K-member ensemble (the same forward pass feeds
:class:`TemperedMetrics` and :class:`ConformalSets`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from sigmanens_dist.config import EvalConfig
from sigmanens_dist.evaluation.calibration import (
    Temperature,
    TemperedMetrics,
    ensemble_nll,
    fit_member_temperatures,
    fit_temperature,
)
from sigmanens_dist.evaluation.conformal import ConformalSets, fit_conformal
from sigmanens_dist.evaluation.report import SHIFT_KEYS, shift_mean
from sigmanens_dist.evaluation.scoring import collect_logits

__all__ = ["PostHoc", "fit_posthoc", "fit_posthoc_on"]

CONFORMAL_KEYS = ("coverage", "set_size")


@dataclass
class PostHoc:
    """The fitted temperature (1.0 when not asked for), the member temperatures (with ``member-temperature``) and
    conformal thresholds (one ``method -> q̂`` per asked α, none when not asked for), and the report parts they fill:
    ``part["calibration"]``, ``part["member_calibration"]`` and ``part["conformal"]`` (a list, one entry per α)."""

    temperature: float
    calibrate: bool
    thresholds: list[dict[str, float]]
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)
    member_temperatures: list[float] | None = None

    @property
    def applied(self) -> Temperature:
        """What the conformal sets divide the member logits by: the member temperatures when fitted, else T."""
        return self.member_temperatures if self.member_temperatures is not None else self.temperature

    def metrics(self, num_classes: int, num_members: int, sync: bool) -> dict[str, Metric]:
        """Fresh metrics for one pass of the K-member ensemble."""
        out: dict[str, Metric] = {}
        if self.calibrate:
            out["calibration"] = TemperedMetrics(self.temperature, num_classes, num_members, sync_on_compute=sync)
        if self.member_temperatures is not None:
            out["member_calibration"] = TemperedMetrics(self.member_temperatures, num_classes, num_members,
                                                        sync_on_compute=sync)
        for j, thresholds in enumerate(self.thresholds):
            out[f"conformal/{j}"] = ConformalSets(thresholds, num_classes, self.applied, sync_on_compute=sync)
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
    """:func:`fit_posthoc` on the logits of one pass of ``batches`` (of the validation split, or of the calibration
    split: ``split`` names it in the report), the only pass it reads."""
    logits, target = collect_logits(model, batches(), device, f"{desc} fit on {split}")
    return fit_posthoc(logits, target, options, split)


def fit_posthoc(logits: Tensor, target: Tensor, options: EvalConfig, split: str = "val") -> PostHoc:
    """Fit what ``options`` asks for on these member logits ``(M, N, K)`` and labels ``(N,)`` alone, a pure function
    of them (eval and a program's export call it alike): the temperature first (NLL of the ensemble, every member's
    logits / T), with ``member-temperature`` also one T_m per member (each member's own NLL), then the conformal
    thresholds on the calibrated probabilities (member temperatures when fitted). ``split`` names where the logits
    come from in the report."""
    calibrate = options.calibration != "none"
    temperature = fit_temperature(logits, target) if calibrate else 1.0
    members = fit_member_temperatures(logits, target) if options.calibration == "member-temperature" else None
    parts: dict[str, dict[str, Any]] = {}
    fitted = {"fitted_on": split, "num_fit": len(target), "val_nll_before": float(ensemble_nll(logits, target))}
    if calibrate:
        parts["calibration"] = {"method": "temperature", "temperature": temperature, **fitted,
                                "val_nll_after": float(ensemble_nll(logits, target, temperature)), "shift": {}}
    if members is not None:
        parts["member_calibration"] = {"method": "member-temperature", "temperatures": members, **fitted,
                                       "val_nll_after": float(ensemble_nll(logits, target, members)), "shift": {}}
    applied = members if members is not None else temperature
    thresholds: list[dict[str, float]] = []
    if options.conformal:
        thresholds = fit_conformal(logits, target, options.conformal, applied)
        parts["conformal"] = [{"alpha": alpha, "calibrated_on": split, "num_calibration": len(target),
                               "temperature": applied if calibrate else None,
                               "methods": {m: {"qhat": q, "shift": {}} for m, q in qs.items()}}
                              for alpha, qs in zip(options.conformal, thresholds, strict=True)]
    return PostHoc(temperature, calibrate, thresholds, parts, members)
