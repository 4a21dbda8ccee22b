"""How the model is replicated or sharded across ranks. The trainer only sees :class:`Strategy`."""

from __future__ import annotations

import importlib
from typing import Any

from sigmanens_dist.config import Config, StrategyConfig, choices
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.distributed.strategies.base import OptimizerFactory, Strategy
from sigmanens_dist.distributed.strategies.ddp import DDPStrategy
from sigmanens_dist.errors import UsageError

__all__ = ["CHECKPOINT_FORMATS", "STRATEGIES", "DDPStrategy", "OptimizerFactory", "Strategy", "build_strategy",
           "folder_format", "strategy_class", "strategy_options"]

#: name → the module and class of each strategy, imported when asked for (DeepSpeed is an optional extra); its keys
#: are the config's ``strategy.name`` choices (a test holds them equal)
_CLASSES = {"ddp": ("sigmanens_dist.distributed.strategies.ddp", "DDPStrategy"),
            "fsdp": ("sigmanens_dist.distributed.strategies.fsdp", "FSDPStrategy"),
            "deepspeed": ("sigmanens_dist.distributed.strategies.deepspeed", "DeepSpeedStrategy")}
STRATEGIES = choices(StrategyConfig, "name")
#: The checkpoint format each strategy writes and reads (its ``checkpoint_format``), known without importing it: a
#: checkpoint's metadata names its format, and resume tells a strategy's checkpoint from another's by it.
CHECKPOINT_FORMATS = {"ddp": "file", "fsdp": "dcp", "deepspeed": "deepspeed"}


def strategy_class(name: str) -> type[Strategy]:
    if name not in _CLASSES:
        raise UsageError(f"strategy.name={name!r} is not available; available: {', '.join(map(repr, STRATEGIES))}")
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(module), cls)


def folder_format(fmt: str) -> type[Strategy]:
    """The strategy that writes and reads checkpoint folders of format ``fmt`` ("dcp", "deepspeed")."""
    names = [name for name, written in CHECKPOINT_FORMATS.items() if written == fmt and fmt != "file"]
    if not names:
        raise UsageError(f"unknown checkpoint folder format {fmt!r}")
    return strategy_class(names[0])


def build_strategy(name: str, env: DistEnv, *, amp: str = "none", options: dict[str, Any] | None = None) -> Strategy:
    """The strategy ``name`` with its ``options`` (:func:`strategy_options`)."""
    return strategy_class(name)(env, amp=amp, **(options or {}))


def strategy_options(cfg: Config, *, elastic: bool = False) -> dict[str, Any]:
    """The keyword options of ``cfg.strategy.name``'s constructor (each strategy's :meth:`Strategy.options_from`)."""
    return strategy_class(cfg.strategy.name).options_from(cfg, elastic=elastic)
