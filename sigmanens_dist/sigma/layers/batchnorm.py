"""σBatchNorm: each member normalises with the statistics of its own B samples and keeps its own running stats."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sigmanens_dist.sigma.layers.prediction_stats import prediction_moments
from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm, fresh_view

__all__ = ["SigmaBatchNorm"]


class SigmaBatchNorm(SigmaNorm):
    """Replaces ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and timm's ``BatchNormAct2d``/``SyncBatchNormAct``.

    In an ensemble pass (interleaved rows) the layer is ONE ``F.batch_norm`` over the view ``(B, M·C, …)``, with the
    member affines and running stats as ``(M·C,)`` vectors: in training, bit for bit the M per-member calls. Called
    alone (member-major rows), training runs one ``F.batch_norm`` per member on its contiguous chunk and eval folds
    running stats, σ gate and affine into one broadcast multiply-add.
    Note: a source ``SyncBatchNorm`` keeps per-rank statistics here (stats are not synchronised across ranks).
    """

    kind = "batch"
    channels_last = False
    # In eval, None normalises with the running statistics; a prior strength N ≥ 0 with each member's statistics of
    # its own rows of this batch, mixed with its running ones (prediction_stats.py; N = 0: the batch's alone). Set on
    # a prediction copy by sigmanens_dist.inference.norm_stats; training ignores it.
    prediction_prior: float | None = None
    # With a prior: each image's statistics alone, as if every image were a batch of its own (what predicting one
    # image at a time computes, for a whole batch in one pass); set by evaluation.norm_stats for --batch-size 1.
    prediction_per_sample: bool = False

    def __init__(self, source: nn.modules.batchnorm._BatchNorm, num_members: int) -> None:
        super().__init__(source, num_members, source.num_features)
        self.momentum = source.momentum
        self.track_running_stats = source.track_running_stats and source.running_mean is not None
        if self.track_running_stats:
            self.register_buffer("num_batches_tracked", source.num_batches_tracked.detach().clone())
        self._flat_stats: tuple[torch.Tensor, torch.Tensor] | tuple[None, None] = (None, None)

    def bind(self, store, slot) -> None:
        super().bind(store, slot)
        if self.track_running_stats:
            self.rebind_stats()

    def keeps_running_stats(self) -> bool:
        return self.track_running_stats

    def rebind_stats(self) -> None:
        """Expose the running stats as buffers named ``running_mean``/``running_var`` (views, not in state_dict:
        the store's flat buffer is what is saved) so tools that sync BN buffers by name keep working; and keep their
        ``(M·C,)`` views for the one-call path, so no forward rebuilds them."""
        mean, var = self.store.stats(self._slot.stats, self.num_features)
        self.register_buffer("running_mean", mean, persistent=False)
        self.register_buffer("running_var", var, persistent=False)
        self._flat_stats = (mean.view(-1), var.view(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_batch(x)
        if x.shape[1] != self.num_features:  # an invariant of the forward pass: the backbone feeds it (a bug if hit)
            raise ValueError(f"{type(self).__name__}: expected {self.num_features} channels at dim 1, got "
                             f"input of shape {tuple(x.shape)}")
        scale, shift = self.flat_affine()  # σBatchNorm always has a member bias (has_bias)
        if self.prediction_prior is not None and not self.training:
            return self.post(self._prediction_stats(x, scale, shift))
        batch_stats = self.training or not self.track_running_stats
        factor = self._momentum_step() if batch_stats else 0.0
        if self.store.plan.interleaved:
            y = self._one_call(x, scale, shift, batch_stats, factor)
        elif batch_stats:
            y = self._per_member(x, scale, shift, factor)
        else:
            mean, var = (t.view(-1) for t in self.store.stats(self._slot.stats, self.num_features))
            a = scale * torch.rsqrt(var + self.eps)
            y = self.member_affine(x, a.to(x.dtype), (shift - mean * a).to(x.dtype))
        return self.post(y)

    def _momentum_step(self) -> float:
        """The running-stat update factor of this training call (counting the batch first, as ``_BatchNorm`` does)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        return factor

    def _one_call(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, batch_stats: bool,
                  factor: float) -> torch.Tensor:
        """Interleaved rows: every member's norm as one native call over M·C channels."""
        # channels_last (or any other stride order) has no (B, M·C, …) view: one NCHW copy keeps it exact.
        x = x.contiguous()
        mean, var = self._flat_stats
        y = F.batch_norm(x.view(x.shape[0] // self.num_members, -1, *x.shape[2:]), mean, var, scale, shift,
                         batch_stats, factor, self.eps)
        return fresh_view(y, x.shape)

    def _prediction_stats(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Eval with each member's statistics re-estimated from its own rows of this batch (never written back to
        the running statistics); differentiable, as a plain BatchNorm in training is."""
        m, prior = self.num_members, float(self.prediction_prior)
        if self.prediction_per_sample:
            return self._per_sample_stats(x, scale, shift, prior)
        if self.store.plan.interleaved:  # the (B, M·C, …) view: channel m·C + c is member m's channel c
            rows, running = x.reshape(x.shape[0] // m, -1, *x.shape[2:]), self._flat_stats
            dims, samples = [0, *range(2, x.ndim)], x.shape[0] // m
        else:  # member-major: (M, B, C, …)
            rows = x.view(m, x.shape[0] // m, *x.shape[1:])
            running = (self.store.stats(self._slot.stats, self.num_features) if self.track_running_stats
                       else (None, None))
            dims, samples = [1, *range(3, rows.ndim)], rows.shape[1]
        mean, var = prediction_moments(rows, dims, *running, prior, samples)
        a = scale * torch.rsqrt(var.reshape(-1) + self.eps)
        return self.member_affine(x, a.to(x.dtype), (shift - mean.reshape(-1) * a).to(x.dtype))

    def _per_sample_stats(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, prior: float
                          ) -> torch.Tensor:
        """Each member's statistics of each image alone (its own row, over the spatial positions), mixed with the
        member's running ones by ``prior``: image b of a batch gets what a batch holding only image b gets."""
        m, c = self.num_members, self.num_features
        interleaved = self.store.plan.interleaved
        rows = x.reshape(x.shape[0] // m, m, c, *x.shape[2:]) if interleaved else x.reshape(
            m, x.shape[0] // m, c, *x.shape[2:])  # (B, M, C, …) or (M, B, C, …)
        members = (1, m, c) if interleaved else (m, 1, c)
        running = (tuple(t.view(members) for t in self.store.stats(self._slot.stats, c))
                   if self.track_running_stats else (None, None))
        mean, var = prediction_moments(rows, range(3, rows.ndim), *running, prior, 1)
        a = scale.view(members) * torch.rsqrt(var + self.eps)
        b = shift.view(members) - mean * a
        spatial = [1] * (rows.ndim - 3)
        y = rows * a.view(*a.shape, *spatial).to(x.dtype) + b.view(*b.shape, *spatial).to(x.dtype)
        return y.reshape(x.shape)

    def _per_member(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, factor: float) -> torch.Tensor:
        """Member-major rows, batch statistics: one call per member on its contiguous chunk."""
        m = self.num_members
        mean, var = self.store.stats(self._slot.stats, self.num_features) if self.track_running_stats else (None, None)
        # unbind, not scale[m]: its backward is one stack, where M selects would each write a full-size gradient
        scales, shifts = scale.view(m, -1).unbind(0), shift.view(m, -1).unbind(0)
        chunks = x.chunk(m)
        return torch.cat([
            F.batch_norm(chunks[i], None if mean is None else mean[i], None if var is None else var[i], scales[i],
                         shifts[i], True, factor, self.eps)
            for i in range(m)
        ])

    def fill_plain(self, layer: nn.Module, member: int, scale: torch.Tensor, shift: torch.Tensor | None) -> None:
        super().fill_plain(layer, member, scale, shift)
        if self.track_running_stats:
            mean, var = self.store.stats(self._slot.stats, self.num_features)
            layer.running_mean = mean[member].detach().clone()
            layer.running_var = var[member].detach().clone()
            layer.num_batches_tracked = self.num_batches_tracked.detach().clone()
