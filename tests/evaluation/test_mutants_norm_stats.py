"""A plain BatchNorm at prediction time (``PredictionBatchNorm``) against a hand computation: with and without an
affine, a prior mixing B samples, timm's activation after it, training untouched; and ``--norm-stats-prior``'s
rules (checks/mutation.py's survivors in evaluation/norm_stats.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.layers import BatchNormAct2d
from torch import nn

from sigmanens_dist.cli.options import parse_prior
from sigmanens_dist.errors import UsageError
from sigmanens_dist.inference.norm_stats import PredictionBatchNorm, norm_stats_problem, with_norm_stats


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


def _per_image_by_hand(bn: nn.Module, x: torch.Tensor, prior: float) -> torch.Tensor:
    """Each image's own mean and variance over its positions, mixed with the running ones against one sample."""
    mean, var = x.mean((2, 3)), x.var((2, 3), unbiased=False)  # (B, C)
    if bn.running_mean is not None:
        mean = (prior * bn.running_mean + mean) / (prior + 1)
        var = (prior * bn.running_var + var) / (prior + 1)
    y = (x - mean[:, :, None, None]) / torch.sqrt(var[:, :, None, None] + bn.eps)
    if bn.weight is not None:
        y = y * bn.weight[:, None, None] + bn.bias[:, None, None]
    return y


def test_per_sample_takes_a_fractional_prior_and_a_model_without_member_rows() -> None:
    """with_norm_stats(per_sample=True) takes any prior > 0 (0.5 too) and a plain model, which has no
    ``pools_member_rows``: each image is normalised by its own statistics mixed with the running ones."""
    model = nn.Sequential(nn.Conv2d(3, 3, 1), _bn(True, eps=0.25)).eval()
    assert not hasattr(model, "pools_member_rows")
    adapted = with_norm_stats(model, "batch", 0.5, per_sample=True)
    layer = adapted[1]
    assert isinstance(layer, PredictionBatchNorm) and layer.prior == 0.5 and layer.per_sample
    x = 3 * torch.randn(4, 3, 5, 5) + 1
    with torch.no_grad():
        torch.testing.assert_close(adapted(x), _per_image_by_hand(model[1], model[0](x), 0.5), rtol=1e-5, atol=1e-5)
    assert with_norm_stats(model, "train", 0.5, per_sample=True) is model
    pooled = nn.Sequential(_bn(True))
    pooled.pools_member_rows = True  # BatchEnsemble's mark: its norms pool the members' rows of an image
    with pytest.raises(ValueError, match="norms pool its members' rows of an image"):
        with_norm_stats(pooled, "batch", 0.5, per_sample=True)
    for prior in (0.0, -1.0):
        with pytest.raises(ValueError, match="per-sample statistics need a prior > 0"):
            with_norm_stats(model, "batch", prior, per_sample=True)


@pytest.mark.parametrize("affine", [True, False])
def test_per_sample_without_running_statistics_is_each_image_alone(affine: bool) -> None:
    """A BatchNorm without running statistics, per sample: each image by its own statistics alone (the prior has
    nothing to mix), what instance normalisation computes."""
    bn = nn.BatchNorm2d(3, eps=0.25, affine=affine, track_running_stats=False)
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.tensor([0.5, -1.0, 2.0]))
            bn.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
    adapted = PredictionBatchNorm(bn.eval(), 4.0, per_sample=True)
    x = 3 * torch.randn(4, 3, 5, 5) + 1
    with torch.no_grad():
        got = adapted(x)
        torch.testing.assert_close(got, _per_image_by_hand(bn, x, 4.0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, F.instance_norm(x, weight=bn.weight, bias=bn.bias, eps=0.25), rtol=1e-5,
                                   atol=1e-5)


def test_prediction_batchnorm_repr_names_its_prior_and_per_sample() -> None:
    """PredictionBatchNorm's repr line: the prior as %g, and per_sample only when set."""
    assert PredictionBatchNorm(_bn(True), 16.0).extra_repr() == "prior=16"
    assert PredictionBatchNorm(_bn(True), 0.5, per_sample=True).extra_repr() == "prior=0.5, per_sample=True"
    assert repr(PredictionBatchNorm(_bn(False), 2.0)).startswith("PredictionBatchNorm(\n  prior=2\n  (source): ")


def test_per_sample_statistics_of_a_flat_input_are_each_image_alone() -> None:
    """A BatchNorm1d over (B, C) (a converted MLP head): per-sample statistics of one value per feature are that value
    (no spread), mixed with the running ones, so each image gets what a batch of only itself gets; not the whole
    batch's statistics (``var_mean`` over no dimension reduces over all)."""
    bn = nn.BatchNorm1d(5)
    with torch.no_grad():
        bn.running_mean.copy_(torch.linspace(-1, 1, 5))
        bn.running_var.copy_(torch.linspace(0.5, 2, 5))
    model = nn.Sequential(bn).eval()
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(3)) * 3 + 1
    together = with_norm_stats(model, "batch", prior=4, per_sample=True)(x)
    alone = with_norm_stats(model, "batch", prior=4)
    for b in range(6):
        torch.testing.assert_close(together[b:b + 1], alone(x[b:b + 1]), atol=1e-6, rtol=1e-6)
    mean = (4 * bn.running_mean + x) / 5
    var = 4 * bn.running_var / 5  # one value: no spread of its own
    torch.testing.assert_close(together, (x - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias)
