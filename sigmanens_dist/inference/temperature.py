"""Post-hoc temperature scaling of an ensemble, fitted on the validation split only (docs/eval.md).

One temperature T > 0 divides every member's logits before the member softmaxes are averaged:
``p_T(y | x) = 1/M Σ_m softmax(z_m / T)_y``. The other choice, scaling the pooled prediction (``softmax(log p̄ / T)``,
"pool then calibrate", Rahaman & Thiery 2021), is not used: with T on the member logits the calibrated model is still
an ensemble of M members, so every number ``sigmanens eval`` reports (member scores, disagreement, mutual
information, the OOD scores) stays defined after calibration and comes from the same code (the evaluator's metrics
on ``logits / T``), and a deployed program needs one division. For M = 1 the two are the same.

``--calibration member-temperature`` fits instead one T_m per member, each on that member's own validation NLL, and
averages the tempered members: ``p(y | x) = 1/M Σ_m softmax(z_m / T_m)_y`` (calibrate, then pool). It is scored beside
the one T of the ensemble, so the report compares the two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sigmanens_dist.inference.scores import ensemble_log_probs

__all__ = ["Temperature", "ensemble_nll", "fit_member_temperatures", "fit_temperature", "scale_logits",
           "tempered_log_probs"]

Temperature = float | Tensor | Sequence[float]  # one T for every member (a float or 0-d tensor), or T_m per member


def scale_logits(member_logits: Tensor, temperature: Temperature) -> Tensor:
    """Member logits ``(M, …)`` divided by one temperature, or member m's by ``temperature[m]``: the one place a
    temperature is applied (the fit, the calibrated scores, the conformal sets)."""
    if isinstance(temperature, int | float) or (isinstance(temperature, Tensor) and temperature.ndim == 0):
        return member_logits / temperature
    t = torch.as_tensor(temperature, dtype=member_logits.dtype, device=member_logits.device)
    return member_logits / t.view(-1, *[1] * (member_logits.ndim - 1))


def tempered_log_probs(member_logits: Tensor, temperature: Temperature) -> Tensor:
    """The calibrated ensemble prediction ``log 1/M Σ_m softmax(z_m / T_m)``: what the NLL, the conformal scores and
    a program's probabilities are computed from."""
    return ensemble_log_probs(scale_logits(member_logits, temperature))


def ensemble_nll(member_logits: Tensor, target: Tensor, temperature: Temperature = 1.0) -> Tensor:
    """Mean NLL of the ensemble prediction with every member's logits divided by ``temperature`` (one, or one per
    member): ``member_logits`` ``(M, N, K)``, ``target`` ``(N,)``."""
    log_probs = tempered_log_probs(member_logits, temperature)
    return -log_probs.gather(-1, target[:, None]).mean()


def fit_temperature(member_logits: Tensor, target: Tensor, max_iter: int = 100) -> float:
    """The T minimising :func:`ensemble_nll` on these (validation) logits, by LBFGS on log T (so T > 0 without a
    constraint), starting from T = 1; the strong-Wolfe line search only accepts steps that lower the NLL."""
    logits = member_logits.detach().float()
    log_t = torch.zeros((), dtype=torch.float64, device=logits.device, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = ensemble_nll(logits, target, log_t.exp())
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp())


def fit_member_temperatures(member_logits: Tensor, target: Tensor) -> list[float]:
    """One T per member, each minimising that member's own NLL on these (validation) logits: :func:`fit_temperature`
    on the member alone."""
    return [fit_temperature(member_logits[m : m + 1], target) for m in range(member_logits.shape[0])]
