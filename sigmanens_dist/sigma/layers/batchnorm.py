"""σBatchNorm: each member normalises with the statistics of its own B samples and keeps its own running stats."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm

__all__ = ["SigmaBatchNorm"]


class SigmaBatchNorm(SigmaNorm):
    """Replaces ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and timm's ``BatchNormAct2d``/``SyncBatchNormAct``.

    Training runs one ``F.batch_norm`` per member on its contiguous chunk (measured faster on CPU than one grouped
    call on a transposed copy); eval folds running stats, σ gate and affine into one broadcast multiply-add.
    Note: a source ``SyncBatchNorm`` keeps per-rank statistics here (stats are not synchronised across ranks).
    """

    kind = "batch"
    channels_last = False

    def __init__(self, source: nn.modules.batchnorm._BatchNorm, num_members: int) -> None:
        super().__init__(source, num_members, source.num_features)
        self.momentum = source.momentum
        self.track_running_stats = source.track_running_stats and source.running_mean is not None
        if self.track_running_stats:
            self.register_buffer("num_batches_tracked", source.num_batches_tracked.detach().clone())

    def bind(self, store, slot) -> None:
        super().bind(store, slot)
        if self.track_running_stats:
            self.rebind_stats()

    def rebind_stats(self) -> None:
        """Expose the running stats as buffers named ``running_mean``/``running_var`` (views, not in state_dict:
        the store's flat buffer is what is saved) so tools that sync BN buffers by name keep working."""
        mean, var = self.store.stats(self._slot.stats, self.num_features)
        self.register_buffer("running_mean", mean, persistent=False)
        self.register_buffer("running_var", var, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_batch(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__}: expected {self.num_features} channels at dim 1, got "
                             f"input of shape {tuple(x.shape)}")
        scale, shift = self.gated_affine()
        mean, var = self.store.stats(self._slot.stats, self.num_features) if self.track_running_stats else (None, None)
        if self.training or not self.track_running_stats:
            factor = 0.0 if self.momentum is None else self.momentum
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    factor = 1.0 / float(self.num_batches_tracked)
            # unbind, not scale[m]: its backward is one stack, where M selects would each write a full-size gradient
            scales = scale.unbind(0)
            shifts = shift.unbind(0)  # σBatchNorm always has a member bias (has_bias)
            chunks = x.chunk(self.num_members)
            y = torch.cat([
                F.batch_norm(chunks[m], None if mean is None else mean[m], None if var is None else var[m],
                             scales[m], shifts[m], True, factor, self.eps)
                for m in range(self.num_members)
            ])
        else:
            a = scale * torch.rsqrt(var + self.eps)
            y = self.member_affine(x, a.to(x.dtype), (shift - mean * a).to(x.dtype))
        return self.post(y)

    def fill_plain(self, layer: nn.Module, member: int, scale: torch.Tensor, shift: torch.Tensor | None) -> None:
        super().fill_plain(layer, member, scale, shift)
        if self.track_running_stats:
            mean, var = self.store.stats(self._slot.stats, self.num_features)
            layer.running_mean = mean[member].detach().clone()
            layer.running_var = var[member].detach().clone()
            layer.num_batches_tracked = self.num_batches_tracked.detach().clone()
