"""A plain BatchNorm at prediction time (``PredictionBatchNorm``) against a hand computation: with and without an
affine, a prior mixing B samples, timm's activation after it, training untouched; and ``--norm-stats-prior``'s
rules (checks/mutation.py's survivors in evaluation/norm_stats.py)."""

from __future__ import annotations

import pytest
import torch
from timm.layers import BatchNormAct2d
from torch import nn

from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.norm_stats import PredictionBatchNorm, norm_stats_problem, parse_prior, with_norm_stats


def _bn(affine: bool, eps: float = 1e-5, act: bool = False) -> nn.BatchNorm2d:
    bn = BatchNormAct2d(3, eps=eps, act_layer=nn.ReLU) if act else nn.BatchNorm2d(3, eps=eps, affine=affine)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(3, generator=g))
        bn.running_var.copy_(torch.rand(3, generator=g) + 0.5)
        if affine:
            bn.weight.copy_(torch.randn(3, generator=g))
            bn.bias.copy_(torch.randn(3, generator=g))
    return bn.eval()


def _by_hand(bn: nn.Module, x: torch.Tensor, prior: float) -> torch.Tensor:
    n = x.shape[0]  # the prior weighs against the B samples of the batch
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    mean = (prior * bn.running_mean + n * mean) / (prior + n)
    var = (prior * bn.running_var + n * var) / (prior + n)
    y = (x - mean[:, None, None]) / torch.sqrt(var[:, None, None] + bn.eps)
    if bn.weight is not None:
        y = y * bn.weight[:, None, None] + bn.bias[:, None, None]
    return y


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("prior", [0.0, 5.0])
def test_prediction_batchnorm_by_hand(affine: bool, prior: float) -> None:
    bn = _bn(affine, eps=0.25)  # a large eps: added, not subtracted, shows
    x = 3 * torch.randn(7, 3, 4, 4) + 1  # B = 7 samples, C = 3 channels
    with torch.no_grad():
        torch.testing.assert_close(PredictionBatchNorm(bn, prior)(x), _by_hand(bn, x, prior), rtol=1e-5, atol=1e-5)


def test_timm_activation_follows_and_training_is_the_source() -> None:
    bn = _bn(True, act=True)
    x = torch.randn(6, 3, 4, 4)
    adapted = PredictionBatchNorm(bn, 2.0)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x), torch.relu(_by_hand(bn, x, 2.0)), rtol=1e-5, atol=1e-5)
    adapted.train()
    bn.train()
    reference = _bn(True, act=True).train()
    torch.testing.assert_close(adapted(x), reference(x))  # training: the source layer itself, batch statistics
    torch.testing.assert_close(bn.running_mean, reference.running_mean)  # and it updated its running statistics


def test_a_nested_batchnorm_is_replaced_in_its_parent() -> None:
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 3, 1), _bn(True)), _bn(False)).eval()
    adapted = with_norm_stats(model, "batch", 3.0)
    assert isinstance(adapted[0][1], PredictionBatchNorm) and isinstance(adapted[1], PredictionBatchNorm)
    assert adapted[0][1].prior == 3.0 and isinstance(model[0][1], nn.BatchNorm2d)  # the model itself unchanged


def test_norm_stats_problem_says_why_and_what_to_use() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert norm_stats_problem(plain, "batch", "the run") == (
        "--norm-stats batch: the run has no BatchNorm layer with running statistics (LayerNorm, GroupNorm and RMSNorm "
        "normalise each sample by its own statistics), so there is nothing to re-estimate; use --norm-stats train")
    assert norm_stats_problem(plain, "train", "the run") is None
    assert norm_stats_problem(nn.Sequential(_bn(True)), "batch", "the run") is None


def test_parse_prior_takes_zero_and_fractions_and_only_with_batch() -> None:
    assert parse_prior(None, "train") == 0.0
    assert parse_prior("0", "batch") == 0.0
    assert parse_prior("0.5", "batch") == 0.5
    for bad in ("abc", "-1", "inf", "nan"):
        with pytest.raises(UsageError, match=f"--norm-stats-prior '{bad}': give the prior strength N"):
            parse_prior(bad, "batch")
    with pytest.raises(UsageError, match=r"^--norm-stats-prior 2\.5 goes with --norm-stats batch"):
        parse_prior("2.50", "train")
