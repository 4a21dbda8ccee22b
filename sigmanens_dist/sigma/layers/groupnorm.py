"""σGroupNorm: per-sample group statistics (shared call), member-specific gated affine over channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.sigma.layers.layernorm import SigmaLayerNorm
from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm

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
