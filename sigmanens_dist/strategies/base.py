"""The strategy interface: wrap the model, run backward without/with gradient sync, save and load its state."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

from torch import nn

from sigmanens_dist.distributed import DistEnv


class Strategy(ABC):
    def __init__(self, env: DistEnv) -> None:
        self.env = env

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Move to the device and wrap for distributed training; returns the module to call in the loop."""

    @abstractmethod
    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The plain model (for eval, export, checkpoints)."""

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for micro-batches that accumulate gradients without communicating."""
        return contextlib.nullcontext()

    def model_state(self, wrapped: nn.Module) -> dict[str, Any]:
        return self.unwrap(wrapped).state_dict()

    def load_model_state(self, wrapped: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(wrapped).load_state_dict(state)
