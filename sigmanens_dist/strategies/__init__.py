"""How the model is replicated or sharded across ranks. The loop only sees :class:`Strategy`."""

from sigmanens_dist.strategies.base import Strategy
from sigmanens_dist.strategies.ddp import DDPStrategy

__all__ = ["DDPStrategy", "Strategy", "build_strategy"]


def build_strategy(name: str, env) -> Strategy:
    if name == "ddp":
        return DDPStrategy(env)
    raise ValueError(f"strategy.name={name!r} is not available in this version; available: 'ddp'")
