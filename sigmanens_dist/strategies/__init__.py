"""How the model is replicated or sharded across ranks. The trainer only sees :class:`Strategy`."""

from __future__ import annotations

from sigmanens_dist.distributed import DistEnv
from sigmanens_dist.strategies.base import OptimizerFactory, Strategy
from sigmanens_dist.strategies.ddp import DDPStrategy

__all__ = ["STRATEGIES", "DDPStrategy", "OptimizerFactory", "Strategy", "build_strategy"]

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDPStrategy}


def build_strategy(name: str, env: DistEnv, *, amp: str = "none") -> Strategy:
    if name not in STRATEGIES:
        raise ValueError(f"strategy.name={name!r} is not available; available: {', '.join(map(repr, STRATEGIES))}")
    return STRATEGIES[name](env, amp=amp)
