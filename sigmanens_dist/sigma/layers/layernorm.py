"""σLayerNorm (channels-last, any ``normalized_shape``) and σLayerNorm2d (timm's channels-first ``LayerNorm2d``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm, fresh_view

__all__ = ["SigmaLayerNorm", "SigmaLayerNorm2d"]


class SigmaLayerNorm(SigmaNorm):
    """Replaces ``nn.LayerNorm``, timm ``LayerNorm``/``LayerNormFp32``/``LayerNormAct``. Statistics are per sample,
    so members differ only in their gated affine; the normalisation itself is one shared call."""

    kind = "layer"
    joint_affine = True

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
        return self.post(self.norm_affine(x).to(dtype))

    def norm_affine(self, x: torch.Tensor) -> torch.Tensor:
        joint = self.store.pass_affine(self._slot.name)
        if not (self.store.plan.interleaved and x.is_contiguous() and joint is not None and len(joint) == 1):
            return self.member_affine(self.normalize(x), *self.affine(x.dtype))
        # Interleaved rows: ONE native call with the member affine fused. Viewed as (B, M·T·K) (T positions of K
        # features per row), a LayerNorm is a GroupNorm with M·T groups of K channels; its per-channel affine is the
        # member affine spread over the T positions: one (2, M·T·K) copy of weight and bias, 1/B of the activation.
        m, k = self.num_members, self.num_features
        tokens = x[0].numel() // k
        scale, shift = joint[0].to(x.dtype).view(2, m, 1, k).expand(2, m, tokens, k).reshape(2, -1)
        y = F.group_norm(x.view(x.shape[0] // m, -1), m * tokens, scale, shift, self.eps)
        return fresh_view(y, x.shape)


class SigmaLayerNorm2d(SigmaLayerNorm):
    """Channels-first LayerNorm over dim 1 of ``(N, C, H, W)`` (timm ``LayerNorm2d``, ``LayerNormAct2d``…), normalised
    the way timm does (permute to channels-last, normalise, permute back). The member affine then runs on that
    permuted view as a channels-first broadcast: no reshape of a permuted tensor, so no copy of the activation."""

    kind = "layer2d"
    joint_affine = False  # the member affine runs on a permuted view (norm_affine below), never the fused call
    channels_last = False

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return super().normalize(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def norm_affine(self, x: torch.Tensor) -> torch.Tensor:
        return self.member_affine(self.normalize(x), *self.affine(x.dtype))
