"""How the model is replicated or sharded across ranks. The trainer only sees :class:`Strategy`."""

from __future__ import annotations

from typing import Any

from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.distributed.strategies.base import OptimizerFactory, Strategy
from sigmanens_dist.distributed.strategies.ddp import DDPStrategy
from sigmanens_dist.errors import UsageError

__all__ = ["STRATEGIES", "DDPStrategy", "OptimizerFactory", "Strategy", "build_strategy", "strategy_options"]

STRATEGIES = ("ddp", "fsdp", "deepspeed")


def build_strategy(name: str, env: DistEnv, *, amp: str = "none", options: dict[str, Any] | None = None) -> Strategy:
    """The strategy ``name`` with its ``options`` (``StrategyConfig.options()``); DeepSpeed is imported only when
    asked for (an optional extra)."""
    options = options or {}
    if name == "ddp":
        return DDPStrategy(env, amp=amp, **options)
    if name == "fsdp":
        from sigmanens_dist.distributed.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(env, amp=amp, **options)
    if name == "deepspeed":
        from sigmanens_dist.distributed.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(env, amp=amp, **options)
    raise UsageError(f"strategy.name={name!r} is not available; available: {', '.join(map(repr, STRATEGIES))}")


def strategy_options(cfg: Any, *, elastic: bool = False) -> dict[str, Any]:
    """The keyword options of ``cfg.strategy.name``'s constructor, from a validated ``Config``; ``elastic``: the run
    resumes a checkpoint written at another world size."""
    s = cfg.strategy
    if s.name == "fsdp":
        return {"reshard_after_forward": s.fsdp_reshard_after_forward is not False, "replicate": s.fsdp_replicate or 1}
    if s.name == "deepspeed":
        return {"zero_stage": s.zero_stage or 2, "config_file": s.deepspeed_config,
                "per_rank_batch": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
                "clip_grad": cfg.train.clip_grad, "universal": elastic}
    return {}
