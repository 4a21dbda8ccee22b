"""Each σ layer with M members must behave exactly like M independent copies of its source layer."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from timm.layers import norm as timm_norm
from timm.layers import norm_act as timm_norm_act
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.sigma.layers import SUPPORTED, SigmaBatchNorm, SigmaNorm
from tests.sigma_cases import CASES, member_copies

M, B = 3, 4

def _build(name: str) -> tuple[nn.Module, SigmaNorm, list[nn.Module]]:
    """The σ layer with random member state, and M plain copies of the source holding each member's state."""
    return member_copies(CASES[name][0], M)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_sigma_layer_equals_member_copies(name: str, mode: str) -> None:
    ens, layer, refs = _build(name)
    _, feat = CASES[name]
    ens.train(mode == "train")
    for r in refs:
        r.train(mode == "train")
    x = torch.randn(M * B, *feat, generator=torch.Generator().manual_seed(4), requires_grad=True)
    xr = [x.detach()[m * B: (m + 1) * B].clone().requires_grad_() for m in range(M)]
    y = layer(x)
    yr = [r(xm) for r, xm in zip(refs, xr, strict=True)]
    torch.testing.assert_close(y, torch.cat(yr), atol=1e-5, rtol=1e-5)

    # Gradients: input, and the member parameters through σ(γ)·w = w_eff (chain rule onto the flat store).
    weight_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y * weight_out).sum().backward()
    for m in range(M):
        (yr[m] * weight_out[m * B: (m + 1) * B]).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([xm.grad for xm in xr]), atol=1e-5, rtol=1e-5)
    grad = ens.sigma.flat.grad
    s = layer._slot
    gate = torch.sigmoid(layer.gamma.detach())
    g_w = torch.stack([r.weight.grad.reshape(-1) for r in refs])
    torch.testing.assert_close(grad[:, s.weight[0]: s.weight[1]], gate * g_w, atol=1e-5, rtol=1e-4)
    dgamma = gate * (1 - gate) * layer.weight.detach() * g_w
    if s.bias is not None:
        g_b = torch.stack([r.bias.grad.reshape(-1) for r in refs])
        torch.testing.assert_close(grad[:, s.bias[0]: s.bias[1]], gate * g_b, atol=1e-5, rtol=1e-4)
        dgamma = dgamma + gate * (1 - gate) * layer.bias.detach() * g_b
    torch.testing.assert_close(grad[:, s.gamma[0]: s.gamma[1]], dgamma, atol=1e-5, rtol=1e-4)

    # Running statistics: each member updated its own with its own batch.
    if isinstance(layer, SigmaBatchNorm) and layer.track_running_stats:
        for m, r in enumerate(refs):
            torch.testing.assert_close(layer.running_mean[m], r.running_mean, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(layer.running_var[m], r.running_var, atol=1e-6, rtol=1e-5)
        assert int(layer.num_batches_tracked) == int(refs[0].num_batches_tracked)


def test_every_supported_type_has_a_case() -> None:
    covered = {type(CASES[n][0]()) for n in CASES}
    # Fp32/Exp/GroupNorm1Act/SyncBatchNormAct variants share their σ class and code path with a covered sibling.
    siblings = {timm_norm.LayerNorm2dFp32, timm_norm.LayerNormExp2d, timm_norm_act.LayerNormAct2dFp32,
                timm_norm_act.LayerNormActFp32, timm_norm_act.GroupNorm1Act, timm_norm_act.SyncBatchNormAct,
                timm_norm.GroupNorm, timm_norm.RmsNormFp32, timm_norm.RmsNorm2dFp32, timm_norm_act.RmsNormActFp32,
                timm_norm_act.RmsNormAct2d, timm_norm_act.RmsNormAct2dFp32}
    assert set(SUPPORTED) - covered - siblings == set()


def test_running_stats_are_views_of_the_flat_buffer_and_survive_moves() -> None:
    ens, layer, _ = _build("BatchNorm2d")
    assert layer.running_mean.untyped_storage().data_ptr() == ens.sigma.running_stats.untyped_storage().data_ptr()
    ens.double()
    assert layer.running_mean.dtype == torch.float64
    assert layer.running_mean.untyped_storage().data_ptr() == ens.sigma.running_stats.untyped_storage().data_ptr()
    before = ens.sigma.running_stats.clone()
    ens.train()(torch.randn(2, 6, 5, 5, dtype=torch.float64))
    assert not torch.equal(before, ens.sigma.running_stats)
    torch.testing.assert_close(layer.running_mean, ens.sigma.stats(layer._slot.stats, 6)[0])
    names = [n for n, _ in ens.named_buffers()]
    assert "backbone.0.running_mean" in names and "backbone.0.running_var" in names
    assert "backbone.0.running_mean" not in ens.state_dict()  # saved once, in the flat buffer


def test_layer_rejects_batch_not_multiple_of_members() -> None:
    _, layer, _ = _build("LayerNorm")
    with pytest.raises(ValueError, match=r"not a multiple of num_members=3"):
        layer(torch.randn(M * B + 1, 5, 8))
    _, bn, _ = _build("BatchNorm2d")
    with pytest.raises(ValueError, match=r"expected 6 channels"):
        bn(torch.randn(M * B, 5, 5, 5))


@pytest.mark.parametrize("gated", [True, False])
def test_forward_pass_computes_the_gated_affines_once_and_equals_the_per_layer_path(gated: bool) -> None:
    """Inside ``forward_members`` every layer reads the store's once-per-pass affines; outside (activation
    a layer called alone, or every layer under activation checkpointing) each computes its own: same logits and
    gradients."""
    import timm

    torch.manual_seed(0)
    ens = convert_to_sigma_ensemble(timm.create_model("resnet10t", num_classes=5), M, gamma_init_mean=0.0,
                                    gamma_init_std=1.0).train()
    ens.sigma.plan = dataclasses.replace(ens.sigma.plan, gated=gated)
    x = torch.randn(M * B, 3, 16, 16)
    twin = copy.deepcopy(ens)
    calls = []
    original = ens.sigma.gated_affines
    ens.sigma.gated_affines = lambda: calls.append(1) or original()
    out = ens.forward_members(x)
    assert len(calls) == 1 and ens.sigma._pass is None  # once per pass, dropped after it
    ref = twin.backbone(x)  # no pass: every layer computes its own gated affine
    torch.testing.assert_close(out.flatten(0, 1), ref, rtol=1e-5, atol=1e-5)  # sigmoid over other spans: ulps
    (out.square().mean() + ens.diversity_loss(0.5)).backward()
    (ref.square().mean() + twin.diversity_loss(0.5)).backward()
    torch.testing.assert_close(ens.sigma.flat.grad, twin.sigma.flat.grad, rtol=1e-4, atol=1e-6)
    for a, b in zip(ens.backbone.parameters(), twin.backbone.parameters(), strict=True):
        # the sigmoid's ulps, carried through ten train-mode norms, are small against the tensor's largest entry
        # (at most 2.8e-5 of it seen, gated, one or two threads), not against each entry
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4 * float(b.grad.abs().max()) + 1e-12)
