"""Split conformal prediction sets for the ensemble's prediction, calibrated on the validation split (docs/eval.md).

A method gives every class a nonconformity score (lower: more plausible); the set of an input is every class whose
score is at most q̂, the ⌈(n+1)(1−α)⌉-th smallest score of the true class over the n calibration samples. For
exchangeable calibration and test samples the set holds the true class with probability ≥ 1 − α.

* ``thr`` (Sadinle et al. 2019): 1 − p_y. The smallest sets on average; coverage can be uneven across inputs.
* ``aps`` (Romano et al. 2020), not randomised: the probability mass of the classes ranked at or above y. Larger
  sets, closer to conditional coverage; deterministic (no random tie-break), so it can over-cover.
* ``raps`` (Angelopoulos et al. 2021): APS plus λ·max(0, rank(y) − k_reg), which keeps long tails out of the set.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.calibration import Temperature, scale_logits
from sigmanens_dist.evaluation.metrics import ensemble_log_probs

__all__ = ["METHODS", "ConformalSets", "class_scores", "conformal_quantile", "fit_conformal", "parse_alphas"]

METHODS = ("thr", "aps", "raps")
RAPS_LAMBDA, RAPS_K_REG = 0.01, 5  # Angelopoulos et al.'s ImageNet defaults are of this order


def parse_alphas(text: str | None, *, single: bool = False) -> list[float]:
    """``--conformal``'s miscoverages (eval's and export's): one α, or unless ``single`` several separated by commas,
    each strictly between 0 and 1; none when not asked for."""
    if text is None:
        return []
    alphas = []
    for part in text.split(","):
        try:
            alphas.append(float(part))
        except ValueError:
            alphas.append(math.nan)  # fails the range check below, naming the whole text
    wanted = ("one miscoverage α in (0, 1), e.g. 0.1" if single else "the miscoverage α as a number strictly between "
              "0 and 1 (e.g. 0.1), or several separated by commas (0.1,0.05)")
    if not all(0 < a < 1 for a in alphas) or (single and len(alphas) > 1):  # NaN fails the range too
        raise UsageError(f"--conformal {text!r}: give {wanted}")
    if len(set(alphas)) != len(alphas):
        raise UsageError(f"--conformal {text!r}: an α is given twice")
    return alphas


def class_scores(probs: Tensor, method: str) -> Tensor:
    """The nonconformity score of every class, ``(B, K) -> (B, K)``; the set is ``scores <= q̂``."""
    if method == "thr":
        return 1 - probs
    if method not in METHODS:
        raise UsageError(f"conformal method {method!r}: choose from {', '.join(METHODS)}")
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    mass = ranked.cumsum(-1)  # the class at rank r gets the mass of ranks 1..r
    if method == "raps":
        rank = torch.arange(1, probs.shape[-1] + 1, device=probs.device, dtype=probs.dtype)
        mass = mass + RAPS_LAMBDA * (rank - RAPS_K_REG).clamp_min(0)
    return torch.empty_like(mass).scatter_(-1, order, mass)


def conformal_quantile(scores: Tensor, alpha: float) -> float:
    """q̂: the ⌈(n+1)(1−α)⌉-th smallest of the n calibration ``scores`` (the finite-sample quantile); +inf (every
    set is all classes) when α < 1/(n+1) asks for more than n samples can promise."""
    n = len(scores)
    rank = math.ceil((n + 1) * (1 - alpha) - 1e-9)  # the slack keeps (n+1)(1−α) = 900.0000000001 at 900
    return math.inf if rank > n else float(scores.double().sort().values[rank - 1])


def fit_conformal(member_logits: Tensor, target: Tensor, alphas: list[float],
                  temperature: Temperature = 1.0) -> list[dict[str, float]]:
    """q̂ of every method (:data:`METHODS`) at each miscoverage of ``alphas``, from these calibration member logits
    ``(M, N, K)`` (divided by ``temperature`` first: one, or one per member) and labels ``(N,)``: a pure function of
    them, what eval and a program's export fit alike."""
    probs = ensemble_log_probs(scale_logits(member_logits, temperature)).exp()
    true_class = {m: class_scores(probs, m).gather(-1, target[:, None])[:, 0] for m in METHODS}
    return [{m: conformal_quantile(scores, alpha) for m, scores in true_class.items()} for alpha in alphas]


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
        probs = ensemble_log_probs(scale_logits(member_logits, self.temperature)).exp()
        covered, size = [], []
        for method, q in self.thresholds.items():
            in_set = class_scores(probs, method) <= q
            covered.append(in_set.gather(-1, target[:, None])[:, 0].float())
            size.append(in_set.sum(-1).float())
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
