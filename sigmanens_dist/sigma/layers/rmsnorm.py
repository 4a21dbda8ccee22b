"""σRmsNorm: ``nn.RMSNorm`` and timm's ``RmsNorm``/``RmsNorm2d`` (+ Fp32/Act variants); gated scale, no shift."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers.fast_norm import rms_norm2d
from torch import nn

from sigmanens_dist.sigma.layers.layernorm import SigmaLayerNorm

__all__ = ["SigmaRmsNorm", "SigmaRmsNorm2d"]


class SigmaRmsNorm(SigmaLayerNorm):
    """RMS normalisation over the trailing ``normalized_shape``; the member affine is a scale only."""

    kind = "rms"
    has_bias = False

    def __init__(self, source: nn.Module, num_members: int) -> None:
        super().__init__(source, num_members)
        if getattr(source, "eps", None) is None:  # nn.RMSNorm(eps=None) means finfo(dtype).eps at run time
            self.eps = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, None, self.eps)

    def norm_affine(self, x: torch.Tensor) -> torch.Tensor:
        return self.member_affine(self.normalize(x), *self.affine(x.dtype))  # no native grouped RMS norm to fuse


class SigmaRmsNorm2d(SigmaRmsNorm):
    """Channels-first RMS norm over dim 1 of ``(N, C, H, W)``, with timm's eager 2d kernel."""

    kind = "rms2d"
    channels_last = False

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm2d(x, self.normalized_shape, None, self.eps)
