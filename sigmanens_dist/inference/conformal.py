"""Split conformal prediction sets for the ensemble's prediction, calibrated on a held-out split (docs/eval.md).

A score gives every class a nonconformity value (lower: more plausible); the set of an input is every class whose
value is at most q̂, the ⌈(n+1)(1−α)⌉-th smallest value of the true class over the n calibration samples. For
exchangeable calibration and test samples the set holds the true class with probability ≥ 1 − α. One entry of
:data:`SCORES` per score:

* ``thr`` (Sadinle et al. 2019): 1 − p_y. The smallest sets on average; coverage can be uneven across inputs.
* ``aps`` (Romano et al. 2020), not randomised: the probability mass of the classes ranked at or above y. Larger
  sets, closer to conditional coverage; deterministic (no random tie-break), so it can over-cover.
* ``raps`` (Angelopoulos et al. 2021): APS plus λ·max(0, rank(y) − k_reg), which keeps long tails out of the set.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from sigmanens_dist.errors import UsageError
from sigmanens_dist.inference.temperature import Temperature, tempered_log_probs

__all__ = ["METHODS", "RAPS_K_REG", "RAPS_LAMBDA", "SCORES", "class_scores", "conformal_quantile", "fit_conformal",
           "in_sets", "set_stats"]

RAPS_LAMBDA, RAPS_K_REG = 0.01, 5  # Angelopoulos et al.'s ImageNet defaults are of this order


def _thr(probs: Tensor) -> Tensor:
    return 1 - probs


def _ranked_mass(probs: Tensor, penalty: float) -> Tensor:
    """The probability mass of the classes ranked at or above each class, plus ``penalty`` per rank past
    :data:`RAPS_K_REG` (aps: none), in class order."""
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    mass = ranked.cumsum(-1)  # the class at rank r gets the mass of ranks 1..r
    if penalty:
        rank = torch.arange(1, probs.shape[-1] + 1, device=probs.device, dtype=probs.dtype)
        mass = mass + penalty * (rank - RAPS_K_REG).clamp_min(0)
    return torch.empty_like(mass).scatter_(-1, order, mass)


def _aps(probs: Tensor) -> Tensor:
    return _ranked_mass(probs, 0.0)


def _raps(probs: Tensor) -> Tensor:
    return _ranked_mass(probs, RAPS_LAMBDA)


SCORES: dict[str, Callable[[Tensor], Tensor]] = {"thr": _thr, "aps": _aps, "raps": _raps}
METHODS = tuple(SCORES)


def class_scores(probs: Tensor, method: str) -> Tensor:
    """The nonconformity score of every class, ``(B, K) -> (B, K)``; the set is ``scores <= q̂``."""
    if method not in SCORES:
        raise UsageError(f"conformal method {method!r}: choose from {', '.join(METHODS)}")
    return SCORES[method](probs)


def in_sets(probs: Tensor, method: str, qhat: float) -> Tensor:
    """Which classes each input's set holds, ``(B, K) -> (B, K)`` bool: what the program outputs and eval scores."""
    return class_scores(probs, method) <= qhat


def set_stats(sets: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Per input: whether its set holds the true class (0/1) and the set's size, both float ``(B,)``."""
    return sets.gather(-1, target[:, None])[:, 0].float(), sets.sum(-1).float()


def conformal_quantile(scores: Tensor, alpha: float) -> float:
    """q̂: the ⌈(n+1)(1−α)⌉-th smallest of the n calibration ``scores`` (the finite-sample quantile); +inf (every
    set is all classes) when α < 1/(n+1) asks for more than n samples can promise."""
    n = len(scores)
    rank = math.ceil((n + 1) * (1 - alpha) - 1e-9)  # the slack keeps (n+1)(1−α) = 900.0000000001 at 900
    return math.inf if rank > n else float(scores.double().sort().values[rank - 1])


def fit_conformal(member_logits: Tensor, target: Tensor, alphas: list[float],
                  temperature: Temperature = 1.0) -> list[dict[str, float]]:
    """q̂ of every score (:data:`SCORES`) at each miscoverage of ``alphas``, from these calibration member logits
    ``(M, N, K)`` (divided by ``temperature`` first: one, or one per member) and labels ``(N,)``: a pure function of
    them, what eval and a program's export fit alike."""
    probs = tempered_log_probs(member_logits, temperature).exp()
    true_class = {m: class_scores(probs, m).gather(-1, target[:, None])[:, 0] for m in METHODS}
    return [{m: conformal_quantile(scores, alpha) for m, scores in true_class.items()} for alpha in alphas]
