"""σGroupNorm: per-sample group statistics, member-specific gated affine over channels; on interleaved rows one
native call with M·G groups over the view ``(B, M·C, …)`` (a group never spans two members' channels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.sigma.layers.layernorm import SigmaLayerNorm
from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm, fresh_view

__all__ = ["SigmaGroupNorm"]


class SigmaGroupNorm(SigmaLayerNorm):
    """Replaces ``nn.GroupNorm`` and timm ``GroupNorm``, ``GroupNorm1``, ``GroupNormAct``, ``GroupNorm1Act``."""

    kind = "group"
    channels_last = False

    def __init__(self, source: nn.GroupNorm, num_members: int) -> None:
        SigmaNorm.__init__(self, source, num_members, source.num_channels)
        self.num_groups = source.num_groups
        self.param_shape = (source.num_channels,)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.num_groups, None, None, self.eps)

    def norm_affine(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.affine(x.dtype)
        if not self.store.plan.interleaved:
            return self.member_affine(self.normalize(x), scale, shift)
        x = x.contiguous()  # channels_last has no (B, M·C, …) view: one NCHW copy keeps it exact
        m = self.num_members
        y = F.group_norm(x.view(x.shape[0] // m, -1, *x.shape[2:]), m * self.num_groups, scale, shift, self.eps)
        return fresh_view(y, x.shape)
