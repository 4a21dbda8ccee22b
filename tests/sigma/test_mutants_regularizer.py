"""The regulariser's edges, each against a hand computation: what λ means under each ``normalize``, the threshold of
``members_on``, the small-τ vertex and the ends of ``optimal_members_on`` (checks/mutation.py's survivors)."""

from __future__ import annotations

import math

import pytest
import torch

from sigmanens_dist.errors import UsageError
from sigmanens_dist.sigma.regularizer import diversity_loss, members_on, optimal_members_on, vertex_loss

GAMMA = [[0.0, 2.0, -1.0], [1.0, -3.0, 0.5]]  # M = 2 members, F = 3 features


def _hand_sum(tau: float) -> float:
    """Σ_i Σ_m log softmax(σ(γ_{·,i})/τ)_m, with math alone."""
    total = 0.0
    for i in range(3):
        s = [1 / (1 + math.exp(-GAMMA[m][i])) / tau for m in range(2)]
        log_z = math.log(sum(math.exp(v) for v in s))
        total += sum(v - log_z for v in s)
    return total


@pytest.mark.parametrize(("normalize", "divisor"), [("none", 1), ("members", 2), ("mean", 6)])
def test_each_normalisation_divides_the_sum_by_hand(normalize: str, divisor: int) -> None:
    gamma = torch.tensor(GAMMA)
    got = diversity_loss(gamma, 0.5, normalize).item()
    assert got == pytest.approx(_hand_sum(0.5) / divisor, rel=1e-6)


def test_an_unknown_normalisation_names_the_choices() -> None:
    with pytest.raises(UsageError) as caught:
        diversity_loss(torch.zeros(2, 3), 0.5, "sum")
    assert str(caught.value) == "normalize must be one of none, members, mean, got 'sum'"


def test_members_on_counts_strictly_above_the_threshold() -> None:
    gamma = torch.tensor([[0.0, 0.1, -0.1], [0.0, 0.2, 5.0], [0.0, -4.0, 0.3]])  # σ(0) = 0.5 exactly
    assert members_on(gamma).tolist() == [0, 2, 2]
    assert members_on(gamma, threshold=0.9).tolist() == [0, 0, 1]


def test_the_vertex_with_no_member_on_is_finite_at_a_tiny_tau() -> None:
    # all off: a uniform softmax, -M·log M, where e^{-1/τ} underflows to 0 (the k > 0 formula would take log 0)
    assert vertex_loss(4, 0, 1e-3) == pytest.approx(-4 * math.log(4))
    assert vertex_loss(4, 4, 1e-3) == pytest.approx(-4 * math.log(4))
    assert vertex_loss(4, 1, 1.0) == pytest.approx(1 - 4 * math.log(math.e + 3))


def test_optimal_members_on_at_its_ends() -> None:
    # one member: every vertex is 0, and the answer is that member (never k = 0, the all-off vertex)
    assert [optimal_members_on(1, tau) for tau in (0.05, 1.0, 20.0)] == [1, 1, 1]
    # two members: one owns the feature (k = M - 1), at a low τ and a high one
    assert optimal_members_on(2, 0.1) == 1
    assert optimal_members_on(2, 10.0) == 1
    for bad in (True, 0, -2, 2.0):
        with pytest.raises(UsageError, match="num_members must be an int ≥ 1"):
            optimal_members_on(bad, 0.5)
