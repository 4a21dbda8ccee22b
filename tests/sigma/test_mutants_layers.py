"""σ layers against M independent copies of their source where the usual cases cannot tell: a large ε (so every call
must pass the layer's own), several training steps of a cumulative BatchNorm, bfloat16 activations, the row layout
after a pass, timm's drop and act kept (checks/mutation.py's survivors in sigma/layers/)."""

from __future__ import annotations

import pytest
import torch
from timm.layers import norm as timm_norm
from timm.layers import norm_act as timm_norm_act
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.sigma.layers import SigmaBatchNorm, SigmaLayerNorm
from tests.sigma_cases import CASES, member_copies, randomised

M, B = 3, 4
EPS = 0.3  # far from every default: a call that drops the layer's ε shows
WIDE_EPS = {
    "BatchNorm2d": (lambda: nn.BatchNorm2d(6, eps=EPS), (6, 5, 5)),
    "BatchNorm2d-cumulative": (lambda: nn.BatchNorm2d(6, eps=EPS, momentum=None), (6, 5, 5)),
    "GroupNorm": (lambda: nn.GroupNorm(3, 6, eps=EPS), (6, 4, 4)),
    "LayerNorm": (lambda: nn.LayerNorm(8, eps=EPS), (5, 8)),
    "LayerNorm-eps0": (lambda: nn.LayerNorm(8, eps=0.0), (5, 8)),  # ε = 0 is kept, not replaced by a default
    "timm.LayerNorm2d": (lambda: timm_norm.LayerNorm2d(6, eps=EPS), (6, 4, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(8, eps=EPS), (5, 8)),
    "timm.RmsNorm": (lambda: timm_norm.RmsNorm(8, eps=EPS), (5, 8)),
    "timm.RmsNorm2d": (lambda: timm_norm.RmsNorm2d(6, eps=EPS), (6, 4, 4)),
}


def _copies(make) -> tuple[nn.Module, nn.Module, list[nn.Module]]:
    return member_copies(make, M)


@pytest.mark.parametrize("name", list(WIDE_EPS))
def test_a_large_eps_reaches_every_path(name: str) -> None:
    make, feat = WIDE_EPS[name]
    g = torch.Generator().manual_seed(4)
    for interleaved in (False, True):
        ens, layer, refs = _copies(make)
        for step in range(3):  # training steps (a cumulative BatchNorm averages them 1/n), then eval
            train = step < 2
            ens.train(train)
            for r in refs:
                r.train(train)
            x = torch.randn(B, *feat, generator=g)
            with torch.no_grad():
                # the ensemble's pass (interleaved rows) or the layer alone on member-major rows
                y = ens(x) if interleaved else layer(x.repeat(M, *[1] * len(feat))).view(M, B, *feat)
                for m, r in enumerate(refs):
                    torch.testing.assert_close(y[m], r(x), atol=1e-5, rtol=1e-5)
        if isinstance(layer, SigmaBatchNorm):
            for m, r in enumerate(refs):
                torch.testing.assert_close(layer.running_mean[m], r.running_mean, atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(layer.running_var[m], r.running_var, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_bfloat16_activations_stay_bfloat16(name: str) -> None:
    make, feat = CASES[name]
    ens, layer, _ = _copies(make)
    x = torch.randn(M * B, *feat, generator=torch.Generator().manual_seed(4)).bfloat16()
    for train in (True, False):
        ens.train(train)
        with torch.no_grad():
            y, want = layer(x), layer(x.float())
        assert y.dtype == torch.bfloat16, (name, train)
        torch.testing.assert_close(y.float(), want, atol=0.1, rtol=0.05)
        with torch.no_grad():
            out = ens(x[:B])
        assert out.dtype == torch.bfloat16, (name, train)


def test_a_pass_leaves_member_major_rows_and_the_regularised_gamma_by_default() -> None:
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4))
    ens = convert_to_sigma_ensemble(net, 2, regularize=["1"])
    with torch.no_grad():
        ens(torch.randn(3, 1, 6, 6))
    assert ens.sigma.plan.interleaved is False and ens.sigma.pass_affine("1") is None
    assert ens.sigma.gamma().shape == (2, 4) and ens.sigma.gamma(regularized_only=False).shape == (2, 8)
    assert torch.equal(ens.sigma.gamma(), ens.sigma.flat[:, :4])


def test_timm_drop_and_act_are_kept() -> None:
    src = timm_norm_act.BatchNormAct2d(6, act_layer=nn.SiLU, drop_layer=nn.Dropout)
    ens = convert_to_sigma_ensemble(nn.Sequential(src), 2)
    layer = ens.backbone[0]
    assert isinstance(layer.drop, nn.Dropout) and layer.drop.p == src.drop.p  # the conversion copies the model
    assert isinstance(layer.act, nn.SiLU)
    assert layer.eps == src.eps and not layer.fp32
    assert convert_to_sigma_ensemble(nn.Sequential(timm_norm.LayerNormFp32(8)), 2).backbone[0].fp32


PLAIN = {**CASES,
         "BatchNorm2d-no-affine": (lambda: nn.BatchNorm2d(6, affine=False), (6, 5, 5)),
         "LayerNorm-no-affine": (lambda: nn.LayerNorm(8, elementwise_affine=False), (5, 8)),
         "timm.BatchNormAct2d-PReLU": (lambda: timm_norm_act.BatchNormAct2d(6, act_layer=nn.PReLU), (6, 5, 5))}


@pytest.mark.parametrize("name", list(PLAIN))
def test_a_plain_member_is_that_member(name: str) -> None:
    make, feat = PLAIN[name]
    src = randomised(make)
    ens = convert_to_sigma_ensemble(nn.Sequential(src), M, seed=3)
    layer = ens.backbone[0]
    with torch.no_grad():
        ens.sigma.flat.add_(torch.randn(ens.sigma.flat.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    x = torch.randn(B, *feat, generator=torch.Generator().manual_seed(4))
    for train in (False, True):
        ens.train(train)
        with torch.no_grad():
            whole = layer(x.repeat(M, *[1] * len(feat))).view(M, B, *feat)
        for m in range(M):
            plain = layer.plain_member(m)
            assert type(plain) is type(src) and plain.training == train
            assert plain.weight is not None and (getattr(plain, "bias", None) is not None) == layer.has_bias
            for flag in ("affine", "elementwise_affine"):
                assert getattr(plain, flag, True) is True
            if isinstance(layer, SigmaBatchNorm) and layer.track_running_stats:
                assert int(plain.num_batches_tracked) == int(layer.num_batches_tracked)
                torch.testing.assert_close(plain.running_var, layer.running_var[m], rtol=0, atol=0)
            with torch.no_grad():
                torch.testing.assert_close(plain(x), whole[m], atol=1e-5, rtol=1e-5)
    assert layer._template[0].weight is None or layer._template[0].weight.is_meta  # the template stays weightless


@pytest.mark.parametrize("stats", [True, False])
@pytest.mark.parametrize("prior", [1.0, 7.0])
def test_prediction_statistics_on_member_major_rows_by_hand(prior: float, stats: bool) -> None:
    ens = convert_to_sigma_ensemble(nn.Sequential(randomised(lambda: nn.BatchNorm2d(6, track_running_stats=stats))),
                                    M, seed=3)
    layer = ens.backbone[0].eval()
    layer.prediction_prior = prior
    x = torch.randn(M * B, 6, 5, 5, generator=torch.Generator().manual_seed(4))  # B = 4 rows, C = 6 channels
    with torch.no_grad():
        y = layer(x)
        scale, shift = layer.gated_affine()
        for m in range(M):
            rows = x[m * B: (m + 1) * B]
            mean, var = rows.mean((0, 2, 3)), rows.var((0, 2, 3), unbiased=False)
            if stats:  # mixed with member m's running statistics, the prior against the B rows
                mean = (prior * layer.running_mean[m] + B * mean) / (prior + B)
                var = (prior * layer.running_var[m] + B * var) / (prior + B)
            want = (rows - mean[:, None, None]) / torch.sqrt(var[:, None, None] + layer.eps)
            want = want * scale[m][:, None, None] + shift[m][:, None, None]
            torch.testing.assert_close(y[m * B: (m + 1) * B], want, atol=1e-5, rtol=1e-5)
        assert layer(x.bfloat16()).dtype == torch.bfloat16


class _Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)  # not contiguous: the LayerNorm after it cannot take the fused view


def test_a_layernorm_on_non_contiguous_rows_equals_its_copies() -> None:
    ens, layer, refs = _copies(lambda: nn.LayerNorm(8))
    ens.backbone = nn.Sequential(_Transpose(), layer)
    ens.eval()
    x = torch.randn(B, 8, 5)
    with torch.no_grad():
        y = ens(x)
        for m, r in enumerate(refs):
            torch.testing.assert_close(y[m], r(x.transpose(1, 2)), atol=1e-5, rtol=1e-5)


def test_an_unbound_layer_says_so() -> None:
    with pytest.raises(RuntimeError, match="is not bound to a SigmaStore"):
        SigmaLayerNorm(nn.LayerNorm(4), 2).store  # noqa: B018


@pytest.mark.parametrize("stats", [True, False])
@pytest.mark.parametrize("feat", [(6, 5, 5), (6, 7), (6,)])  # BatchNorm2d, BatchNorm1d over (C, L) and over C
def test_per_sample_prediction_statistics_by_hand(feat: tuple[int, ...], stats: bool) -> None:
    """prediction_per_sample: each member's image normalised with its own statistics mixed with the member's running
    ones (prior against one sample), the member's affine and γ after; both row layouts; bfloat16 stays bfloat16."""
    make = nn.BatchNorm2d if len(feat) == 3 else nn.BatchNorm1d
    ens, layer, _ = _copies(lambda: make(6, eps=EPS, track_running_stats=stats))
    prior = 3.0
    if stats:  # every member its own running statistics, not the source's copies
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            layer.running_mean.add_(torch.randn(M, 6, generator=g))
            layer.running_var.mul_(torch.rand(M, 6, generator=g) + 0.5)
    ens.eval()
    layer.prediction_prior, layer.prediction_per_sample = prior, True

    def by_hand(rows: torch.Tensor, m: int) -> torch.Tensor:  # member m's rows, each image alone
        flat = rows.reshape(*rows.shape[:2], -1)  # (B, C, positions): one position for a (B, C) input
        mean, var = flat.mean(-1), flat.var(-1, unbiased=False)
        if stats:
            mean = (prior * layer.running_mean[m] + mean) / (prior + 1)
            var = (prior * layer.running_var[m] + var) / (prior + 1)
        spatial = [1] * (rows.ndim - 2)
        scale, shift = layer.gated_affine()
        y = (rows - mean.view(*mean.shape, *spatial)) / torch.sqrt(var.view(*var.shape, *spatial) + EPS)
        return y * scale[m].view(-1, *spatial) + shift[m].view(-1, *spatial)

    g = torch.Generator().manual_seed(4)
    x = 2 * torch.randn(M * B, *feat, generator=g) + 1  # member-major rows: member m's are m·B … (m+1)·B − 1
    with torch.no_grad():
        y = layer(x)
        for m in range(M):
            torch.testing.assert_close(y[m * B: (m + 1) * B], by_hand(x[m * B: (m + 1) * B], m), atol=1e-5, rtol=1e-5)
        for b in range(B):  # image b alone, a batch of one per member: what the whole batch gave it
            torch.testing.assert_close(layer(x[b::B]), y[b::B], atol=1e-6, rtol=1e-6)
        img = x[:B]  # the ensemble's pass: interleaved rows, every member the same images
        out = ens(img)
        for m in range(M):
            torch.testing.assert_close(out[m], by_hand(img, m), atol=1e-5, rtol=1e-5)
        assert layer(x.bfloat16()).dtype == torch.bfloat16
