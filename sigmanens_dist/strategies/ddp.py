"""DistributedDataParallel: every rank holds the full model; gradients (one bucket carries the whole flat σ
parameter) are averaged across ranks."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sigmanens_dist.strategies.base import Strategy


class DDPStrategy(Strategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.env.device)
        if not self.env.distributed:
            return model
        # σBatchNorm exposes its running stats twice (flat buffer + named views): broadcast only the flat one.
        views = [n for n, b in model.named_buffers() if b._base is not None]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, views)
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        return wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else contextlib.nullcontext()

