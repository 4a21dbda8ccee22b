"""σLayerNorm (channels-last, any ``normalized_shape``) and σLayerNorm2d (timm's channels-first ``LayerNorm2d``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm

__all__ = ["SigmaLayerNorm", "SigmaLayerNorm2d"]


class SigmaLayerNorm(SigmaNorm):
    """Replaces ``nn.LayerNorm``, timm ``LayerNorm``/``LayerNormFp32``/``LayerNormAct``. Statistics are per sample,
    so members differ only in their gated affine; the normalisation itself is one shared call."""

    kind = "layer"

    def __init__(self, source: nn.Module, num_members: int) -> None:
        shape = tuple(source.normalized_shape)
        super().__init__(source, num_members, int(torch.Size(shape).numel()))
        self.normalized_shape = shape

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_batch(x)
        dtype = x.dtype
        if self.fp32:
            x = x.float()
        scale, shift = self.gated_affine()
        y = self.norm_affine(x, scale.to(x.dtype), None if shift is None else shift.to(x.dtype))
        return self.post(y.to(dtype))

    def norm_affine(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        return self.member_affine(self.normalize(x), scale, shift)


class SigmaLayerNorm2d(SigmaLayerNorm):
    """Channels-first LayerNorm over dim 1 of ``(N, C, H, W)`` (timm ``LayerNorm2d``, ``LayerNormAct2d``…), computed
    the way timm does: permute to channels-last, normalise, permute back."""

    kind = "layer2d"

    def norm_affine(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        return super().norm_affine(x.permute(0, 2, 3, 1), scale, shift).permute(0, 3, 1, 2)
