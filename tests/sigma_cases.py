"""The normalization layers every σ-layer test runs over (tests/sigma/test_layers.py, tests/sigma/test_interleave.py):
a factory of the source layer and the per-sample input shape it takes."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from timm.layers import norm as timm_norm
from timm.layers import norm_act as timm_norm_act
from torch import nn

CASES = {
    "BatchNorm1d-2d": (lambda: nn.BatchNorm1d(6), (6,)),
    "BatchNorm1d-3d": (lambda: nn.BatchNorm1d(6), (6, 5)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(6), (6, 5, 5)),
    "BatchNorm2d-cumulative": (lambda: nn.BatchNorm2d(6, momentum=None), (6, 5, 5)),
    "BatchNorm2d-no-stats": (lambda: nn.BatchNorm2d(6, track_running_stats=False), (6, 5, 5)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(4), (4, 3, 3, 3)),
    "SyncBatchNorm": (lambda: nn.SyncBatchNorm(6), (6, 5, 5)),  # warns: stats stay per rank
    "timm.BatchNormAct2d": (lambda: timm_norm_act.BatchNormAct2d(6, act_layer=nn.SiLU), (6, 5, 5)),
    "LayerNorm": (lambda: nn.LayerNorm(8), (5, 8)),
    "LayerNorm-2dshape": (lambda: nn.LayerNorm((4, 8)), (4, 8)),
    "timm.LayerNorm": (lambda: timm_norm.LayerNorm(8), (5, 8)),
    "timm.LayerNormFp32": (lambda: timm_norm.LayerNormFp32(8), (5, 8)),
    "timm.LayerNormAct": (lambda: timm_norm_act.LayerNormAct(8, act_layer=nn.GELU), (5, 8)),
    "timm.LayerNorm2d": (lambda: timm_norm.LayerNorm2d(6), (6, 4, 4)),
    "timm.LayerNormAct2d": (lambda: timm_norm_act.LayerNormAct2d(6, act_layer=nn.GELU), (6, 4, 4)),
    "GroupNorm": (lambda: nn.GroupNorm(3, 6), (6, 4, 4)),
    "timm.GroupNorm1": (lambda: timm_norm.GroupNorm1(6), (6, 4, 4)),
    "timm.GroupNormAct": (lambda: timm_norm_act.GroupNormAct(6, num_groups=3, act_layer=nn.ReLU), (6, 4, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(8), (5, 8)),
    "RMSNorm-eps-None": (lambda: nn.RMSNorm(8, eps=None), (5, 8)),
    "timm.RmsNorm": (lambda: timm_norm.RmsNorm(8), (5, 8)),
    "timm.RmsNorm2d": (lambda: timm_norm.RmsNorm2d(6), (6, 4, 4)),
    "timm.RmsNormAct": (lambda: timm_norm_act.RmsNormAct(8, act_layer=nn.GELU), (5, 8)),
}


def randomised(make: Callable[[], nn.Module]) -> nn.Module:
    """A fresh source layer with random affine and running statistics (seeded): members then start different."""
    src = make()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in src.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + 1.0)
        if getattr(src, "running_mean", None) is not None:
            src.running_mean.copy_(torch.randn(src.running_mean.shape, generator=g) * 0.3)
            src.running_var.copy_(torch.rand(src.running_var.shape, generator=g) + 0.5)
    return src


def member_copies(make: Callable[[], nn.Module], members: int) -> tuple[nn.Module, nn.Module, list[nn.Module]]:
    """A σ ensemble of one layer made by ``make`` with random member state, its σ layer, and ``members`` plain copies
    of the source, each holding one member's state: the reference a σ layer must equal."""
    from sigmanens_dist import convert_to_sigma_ensemble
    from sigmanens_dist.sigma.layers import SigmaBatchNorm

    src = randomised(make)
    ens = convert_to_sigma_ensemble(nn.Sequential(src), members, seed=3)
    layer = ens.backbone[0]
    with torch.no_grad():  # make the members really different, beyond the γ compensation
        ens.sigma.flat.add_(torch.randn(ens.sigma.flat.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    scale, shift = layer.gated_affine()
    refs = []
    for m in range(members):
        ref = copy.deepcopy(src)
        with torch.no_grad():
            ref.weight.copy_(scale[m].reshape(ref.weight.shape))
            if shift is not None:
                ref.bias.copy_(shift[m].reshape(ref.bias.shape))
            if isinstance(layer, SigmaBatchNorm) and layer.track_running_stats:
                ref.running_mean.copy_(layer.running_mean[m])
                ref.running_var.copy_(layer.running_var[m])
        refs.append(ref)
    return ens, layer, refs
