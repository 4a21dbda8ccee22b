"""The post-hoc fit of an ensemble as one typed record: what ``--calibration`` and ``--conformal`` fit on a held-out
split (the calibration split, else the validation split), a pure function of that split's member logits and labels.
The evaluator's report wraps it (:class:`sigmanens_dist.evaluation.posthoc.PostHoc`) and the exporter compiles it
into a program, so both apply the same temperature and thresholds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from sigmanens_dist.inference.conformal import fit_conformal
from sigmanens_dist.inference.temperature import (
    Temperature,
    ensemble_nll,
    fit_member_temperatures,
    fit_temperature,
)

__all__ = ["Calibration", "PostHocFit", "fit_posthoc"]

# config's EvalConfig.calibration (below torch, where --calibration reads its choices) must match: tests/evaluation/
# test_mutants_posthoc.py checks
Calibration = Literal["none", "temperature", "member-temperature"]


@dataclass(frozen=True)
class PostHocFit:
    """A fit's parameters and what it was fitted on. ``temperature`` is 1.0 without calibration;
    ``member_temperatures`` one T_m per member with ``member-temperature``; ``thresholds`` one ``score -> q̂`` per
    miscoverage of ``alphas``, on the probabilities after :attr:`applied`; the NLLs are the ensemble's on the fit's
    own logits, before and after (None where that temperature was not fitted)."""

    calibration: Calibration
    temperature: float
    member_temperatures: tuple[float, ...] | None
    alphas: tuple[float, ...]
    thresholds: tuple[dict[str, float], ...]
    fitted_on: str  # the split's name: "calib" or "val"
    num_fit: int
    nll_before: float
    nll_after: float | None
    member_nll_after: float | None

    @property
    def calibrate(self) -> bool:
        """Whether a temperature was fitted (else T = 1)."""
        return self.calibration != "none"

    def provenance(self, nll_after: float | None) -> dict[str, str | int | float | None]:
        """What a temperature was fitted on, as eval's report and a program's metadata record it, with the NLL it
        left (``nll_after``: :attr:`nll_after` for T, :attr:`member_nll_after` for the member temperatures)."""
        return {"fitted_on": self.fitted_on, "num_fit": self.num_fit, "val_nll_before": self.nll_before,
                "val_nll_after": nll_after}

    @property
    def applied(self) -> Temperature:
        """What the conformal sets divide the member logits by: the member temperatures when fitted, else T."""
        return list(self.member_temperatures) if self.member_temperatures is not None else self.temperature


def fit_posthoc(logits: Tensor, target: Tensor, calibration: Calibration, alphas: list[float],
                split: str = "val") -> PostHocFit:
    """Fit ``calibration`` and the conformal thresholds at ``alphas`` on member logits ``(M, N, K)`` and labels
    ``(N,)`` alone: the temperature first (NLL of the ensemble, every member's logits / T), with
    ``member-temperature`` also one T_m per member (each member's own NLL), then the thresholds on the calibrated
    probabilities (member temperatures when fitted). ``split`` names where the logits come from."""
    calibrate = calibration != "none"
    temperature = fit_temperature(logits, target) if calibrate else 1.0
    members = fit_member_temperatures(logits, target) if calibration == "member-temperature" else None
    applied = members if members is not None else temperature
    return PostHocFit(
        calibration=calibration, temperature=temperature,
        member_temperatures=None if members is None else tuple(members), alphas=tuple(alphas),
        thresholds=tuple(fit_conformal(logits, target, alphas, applied) if alphas else ()), fitted_on=split,
        num_fit=len(target), nll_before=float(ensemble_nll(logits, target)),
        nll_after=float(ensemble_nll(logits, target, temperature)) if calibrate else None,
        member_nll_after=None if members is None else float(ensemble_nll(logits, target, members)))
