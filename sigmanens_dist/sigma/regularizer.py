"""The σN-Ens diversity regularizer and the sharing it produces.

``L_div(γ) = Σ_i Σ_m log softmax(σ(γ_{·,i}) / τ)_m`` over the ``(M, F)`` importance logits, to be **minimised**
(λ is applied by the caller). Writing ``s = σ(γ_{·,i}) ∈ [0,1]^M``, one feature contributes
``Σ_m s_m/τ − M·logsumexp(s/τ)``: linear minus convex, so it is concave in ``s`` and every minimum sits on a
vertex where some ``k`` members are fully on (s=1) and the rest off. The vertex value is
``k/τ − M·log(k·e^{1/τ} + M − k)``; its best ``k`` is :func:`optimal_members_on`, about
``M(τ − 1/(e^{1/τ} − 1))``: low τ → one owner per feature, high τ → many members share it. Every vertex is a
local minimum, so gradient descent lands on one that depends on the γ initialisation; what holds is that from a
fixed init the number of members on grows with τ (see ``tests/sigma/test_regularizer.py``).

``normalize`` sets what λ means. ``none`` (the sum above): the pull on each γ_{m,i} is O(1/τ) whatever M and F are,
while a task loss *averaged* over members pulls each member's γ with 1/M of a single model's gradient, so at fixed λ
the regularizer's weight against the task grows with M. ``members`` divides by M, which restores that balance for
``train.member_loss=mean`` (with ``member_loss=sum`` use ``none``). ``mean`` divides by M·F: the value is then
O(log M) for any network, but the pull on each γ shrinks as 1/F, so λ must grow with the number of features.
"""

from __future__ import annotations

import math

import torch

from sigmanens_dist.errors import UsageError

__all__ = ["NORMALIZATIONS", "check_tau", "diversity_loss", "members_on", "optimal_members_on", "vertex_loss"]


def check_tau(tau: float) -> float:
    """τ as a float, or a clear error: it must be a finite number > 0."""
    if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau) or tau <= 0:
        raise UsageError(f"tau must be a finite number > 0 (the softmax temperature), got {tau!r}")
    return float(tau)


NORMALIZATIONS = ("none", "members", "mean")


def diversity_loss(gamma: torch.Tensor, tau: float, normalize: str = "none") -> torch.Tensor:
    """Σ over features and members of ``log softmax(σ(γ)/τ)`` along the member axis: one fused op for all layers.

    ``gamma`` is ``(M, F)``: members by features, e.g. :meth:`SigmaEnsemble.gamma`. ``normalize``: ``none`` (the
    sum), ``members`` (sum / M) or ``mean`` (sum / (M·F)); see the module docstring. Returns a scalar.
    """
    tau = check_tau(tau)
    if normalize not in NORMALIZATIONS:
        raise UsageError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
    if gamma.ndim != 2:  # an invariant: the σ store hands its (M, F) parameter (a bug if hit)
        raise ValueError(f"gamma must be (num_members, num_features), got shape {tuple(gamma.shape)}")
    total = torch.log_softmax(torch.sigmoid(gamma.float()) / tau, dim=0).sum()
    if normalize == "members":
        return total / gamma.shape[0]
    if normalize == "mean":
        return total / max(1, gamma.numel())
    return total


def members_on(gamma: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """How many members have importance σ(γ) above ``threshold``, per feature: ``(F,)`` integers."""
    return (torch.sigmoid(gamma.detach().float()) > threshold).sum(dim=0)


def vertex_loss(num_members: int, k: int, tau: float) -> float:
    """Per-feature ``L_div`` at a vertex with ``k`` members fully on and the others off."""
    tau = check_tau(tau)
    m = num_members
    # log(k e^{1/τ} + m − k) computed stably for small τ.
    log_z = 1.0 / tau + math.log(k + (m - k) * math.exp(-1.0 / tau)) if k else math.log(m)
    return k / tau - m * log_z


def optimal_members_on(num_members: int, tau: float) -> int:
    """The number of members on, per feature, at the best vertex of ``L_div`` (1 ≤ k ≤ M)."""
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
        raise UsageError(f"num_members must be an int ≥ 1, got {num_members!r}")
    return min(range(1, num_members + 1), key=lambda k: (vertex_loss(num_members, k, tau), k))
