"""DistributedDataParallel: every rank holds the full model; gradients (one bucket carries the whole flat σ
parameter) are averaged across ranks. Checkpoints are one file written by rank 0."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sigmanens_dist.distributed.strategies.base import Strategy

__all__ = ["DDPStrategy"]


class DDPStrategy(Strategy):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model.to(self.env.device)
        if not self.env.distributed:
            self.wrapped = self.model
            return self.wrapped
        # σBatchNorm exposes its running stats twice (flat buffer + named views): broadcast only the flat one.
        views = [n for n, b in self.model.named_buffers() if b._base is not None]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.model, views)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        self.wrapped = DistributedDataParallel(self.model, device_ids=device_ids)
        return self.wrapped

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        if isinstance(self.wrapped, DistributedDataParallel):
            return self.wrapped.no_sync()
        return contextlib.nullcontext()
