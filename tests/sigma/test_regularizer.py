"""The diversity regulariser: value, fused == per-layer loop, known optimum, and sharing that grows with τ."""

from __future__ import annotations

import math

import pytest
import timm
import torch

from sigmanens_dist import convert_to_sigma_ensemble, diversity_loss, members_on, optimal_members_on
from sigmanens_dist.sigma.regularizer import vertex_loss


def _naive(gammas: list[torch.Tensor], tau: float) -> torch.Tensor:
    """The formula as written: Σ_ℓ Σ_i Σ_m log softmax(σ(γ_{·,ℓ,i})/τ)_m, one feature at a time."""
    total = torch.zeros((), dtype=torch.float64)
    for g in gammas:
        for i in range(g.shape[1]):
            s = torch.sigmoid(g[:, i].double()) / tau
            z = sum(math.exp(v) for v in s.tolist())
            total = total + sum(v - math.log(z) for v in s.tolist())
    return total


def test_fused_loss_equals_naive_per_layer_loop() -> None:
    ens = convert_to_sigma_ensemble(timm.create_model("resnet18", num_classes=3), 4, seed=7)
    per_layer = [layer.gamma.detach() for _, layer in ens.sigma_layers()][:5]
    subset = convert_to_sigma_ensemble(timm.create_model("resnet18", num_classes=3), 4, seed=7,
                                       regularize=[n for n, _ in ens.sigma_layers()][:5])
    for tau in (0.1, 0.5, 2.0):
        fused = subset.diversity_loss(tau)
        torch.testing.assert_close(fused.double(), _naive(per_layer, tau), rtol=1e-5, atol=1e-3)


def test_gradient_flows_only_into_regularised_gamma() -> None:
    ens = convert_to_sigma_ensemble(timm.create_model("resnet18", num_classes=3), 4, regularize=["layer4.*"])
    ens.diversity_loss(0.5).backward()
    grad = ens.sigma.flat.grad
    n_reg = ens.gamma().shape[1]
    assert grad[:, :n_reg].abs().sum() > 0
    assert grad[:, n_reg:].abs().sum() == 0


@pytest.mark.parametrize(("m", "tau", "k"), [(8, 0.1, 1), (8, 0.5, 3), (8, 0.05, 1), (16, 0.5, 6)])
def test_optimal_members_on_matches_the_closed_form(m: int, tau: float, k: int) -> None:
    assert optimal_members_on(m, tau) == k
    approx = m * (tau - 1 / (math.exp(1 / tau) - 1))
    assert abs(optimal_members_on(m, tau) - approx) <= 1.0


def test_vertex_loss_matches_diversity_loss_at_vertices() -> None:
    m, tau = 6, 0.3
    for k in range(m + 1):
        gamma = torch.full((m, 1), -50.0)
        gamma[:k] = 50.0
        assert diversity_loss(gamma, tau).item() == pytest.approx(vertex_loss(m, k, tau), rel=1e-5)


def test_sharing_grows_with_tau_from_the_same_init() -> None:
    m, f = 8, 512
    init = torch.randn(m, f, generator=torch.Generator().manual_seed(0))
    on = []
    for tau in (0.05, 0.1, 0.25, 0.5, 1.0, 2.0):
        gamma = init.clone().requires_grad_()
        opt = torch.optim.Adam([gamma], lr=0.1)
        for _ in range(300):
            opt.zero_grad()
            (diversity_loss(gamma, tau) / f).backward()
            opt.step()
        on.append(members_on(gamma).float().mean().item())
    assert on == sorted(on), on
    assert on[-1] > on[0] + 1.0, on
    assert on[1] < m / 2 - 1, on  # τ = 0.1: features end up owned by few members


def test_single_member_has_zero_loss_and_bad_input_errors() -> None:
    assert diversity_loss(torch.randn(1, 10), 0.5).item() == 0.0
    for bad in (0, -0.5, float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="tau must be a finite number > 0"):
            diversity_loss(torch.randn(4, 3), bad)
    with pytest.raises(ValueError, match=r"gamma must be \(num_members, num_features\)"):
        diversity_loss(torch.randn(4), 0.5)
    with pytest.raises(ValueError, match="num_members must be an int"):
        optimal_members_on(0, 0.5)
