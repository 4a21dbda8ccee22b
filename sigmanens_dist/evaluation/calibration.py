"""Post-hoc temperature scaling of an ensemble, fitted on the validation split only (docs/eval.md).

One temperature T > 0 divides every member's logits before the member softmaxes are averaged:
``p_T(y | x) = 1/M Σ_m softmax(z_m / T)_y``. The other choice, scaling the pooled prediction (``softmax(log p̄ / T)``,
"pool then calibrate", Rahaman & Thiery 2021), is not used: with T on the member logits the calibrated model is still
an ensemble of M members, so every number ``sigmanens eval`` reports (member scores, disagreement, mutual
information, the OOD scores) stays defined after calibration and comes from the same code (:class:`SampleMetrics` on
``logits / T``), and a deployed program needs one division. For M = 1 the two are the same.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sigmanens_dist.evaluation.metrics import SampleMetrics, ensemble_log_probs

__all__ = ["TemperedMetrics", "ensemble_nll", "fit_temperature"]


def ensemble_nll(member_logits: Tensor, target: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """Mean NLL of the ensemble prediction with every member's logits divided by ``temperature``:
    ``member_logits`` ``(M, N, K)``, ``target`` ``(N,)``."""
    log_probs = ensemble_log_probs(member_logits / temperature)
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


class TemperedMetrics(SampleMetrics):
    """:class:`SampleMetrics` of the calibrated model: member logits divided by ``temperature`` before scoring."""

    def __init__(self, temperature: float, num_classes: int, num_members: int, **kwargs: object) -> None:
        super().__init__(num_classes, num_members, **kwargs)
        self.temperature = temperature

    def update(self, member_logits: Tensor, target: Tensor) -> None:
        super().update(member_logits / self.temperature, target)
