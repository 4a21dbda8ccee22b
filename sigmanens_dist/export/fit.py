"""What a program's post-hoc split gives it: the temperature and the conformal threshold, fitted by eval's own fit
(:func:`~sigmanens_dist.inference.posthoc.fit_posthoc`) on the logits of the split eval fits on (the calibration
split, else the validation split; never the test set), and the threshold a program compares with
(:func:`program_threshold`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.data.loaders import build_data
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.inference.collect import collect_logits
from sigmanens_dist.inference.conformal import RAPS_LAMBDA, in_sets, set_stats
from sigmanens_dist.inference.posthoc import fit_posthoc
from sigmanens_dist.inference.temperature import tempered_log_probs
from sigmanens_dist.program_meta import ConformalFit

__all__ = ["NO_FIT", "SATURATION_BAND", "ProgramFit", "fit_program", "program_threshold"]

# aps/raps: a q̂ this close to a point where the cumulative scores saturate is moved just above it (program_threshold)
SATURATION_BAND = 1e-4


class ProgramFit(NamedTuple):
    """What the post-hoc split gave the program: its temperature, the fit's record (the metadata's ``fitted_on`` …
    ``val_nll_after``; none without calibration) and its conformal set (none without ``--conformal``)."""

    temperature: float
    record: dict[str, Any]
    conformal: ConformalFit | None


NO_FIT = ProgramFit(1.0, {}, None)  # neither --calibration nor --conformal


def program_threshold(score: str, qhat: float) -> float:
    """The q̂ a program compares with: ``qhat``, except that an aps or raps q̂ within :data:`SATURATION_BAND` of a
    point 1 + λ·j (j ≥ 0; aps: j = 0) becomes that point + the band. There the scores of the classes past the
    ensemble's cumulative probability of 1 pile up, equal but for float32 summation error, which torch and
    onnxruntime round differently: a q̂ among them splits that pile differently in the two runtimes (a q̂ one ulp
    below 1 did, on 79 of 256 inputs). Above the pile, both include all of it: the sets only grow, so coverage
    holds (docs/deploy.md, "Conformal sets in both formats")."""
    if score == "thr" or not math.isfinite(qhat):
        return qhat  # 1 − p rounds the same wherever p does: no pile at a threshold
    point = 1 + RAPS_LAMBDA * max(0, round((qhat - 1) / RAPS_LAMBDA)) if score == "raps" else 1.0
    return point + SATURATION_BAND if abs(qhat - point) <= SATURATION_BAND else qhat


def fit_program(cfg: Config, model: nn.Module, calibrate: bool, alpha: float | None, score: str) -> ProgramFit:
    """T and q̂ fitted on the logits of the split eval fits on (``Data.posthoc_split``), collected in one pass, by
    eval's own fit (a function of the logits and labels), and the coverage and size of the program's sets on the
    same logits."""
    device = torch.device("cpu")
    data = build_data(cfg.data, cfg.eval.batch_size or cfg.train.batch_size, cfg.seed, DistEnv(0, 1, 0, device))
    split, batches = data.posthoc_split()
    logits, target = collect_logits(model, batches(), device, f"program: {split}")
    fitted = fit_posthoc(logits, target, "temperature" if calibrate else "none", [] if alpha is None else [alpha],
                         split)
    record = fitted.provenance(fitted.nll_after) if calibrate else {}
    if alpha is None:
        return ProgramFit(fitted.temperature, record, None)
    fitted_qhat = fitted.thresholds[0][score]
    qhat = program_threshold(score, fitted_qhat)  # what the program compares with, and the coverage is of
    probs = tempered_log_probs(logits, fitted.temperature).exp()
    covered, size = set_stats(in_sets(probs, score, qhat), target)
    return ProgramFit(fitted.temperature, record, ConformalFit(
        alpha=alpha, score=score, qhat=qhat if math.isfinite(qhat) else None,
        qhat_fitted=fitted_qhat if math.isfinite(fitted_qhat) else None, fitted_on=split,
        num_calibration=len(target), val_coverage=float(covered.double().mean()),
        val_set_size=float(size.double().mean())))
