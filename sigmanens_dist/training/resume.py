"""What may change between a run and its resumption, and how the batch adapts to a new world size.

A resumed run continues the *same* run: the model, the ensemble, the data and the global batch must be those of the
checkpoint, or the recorded data position and optimiser state would silently mean something else. Everything else
(learning rate, evaluation cadence, the budget…) may change. The world size may change too (elastic resume): the data
order is defined over global batches (``data/sampler.py``), so keeping the micro-batch of all ranks together (per-rank
batch × world size) fixed keeps every sample where it was; only the per-rank random streams restart.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from sigmanens_dist.checkpoint import BatchLayout, TrainerState
from sigmanens_dist.config import Config
from sigmanens_dist.distributed.strategies import strategy_class
from sigmanens_dist.errors import UsageError

__all__ = ["SAME_RUN_KEYS", "check_same_run"]

log = logging.getLogger(__name__)

# Changing any of these makes the checkpoint a different run's: refused, naming the key and both values.
SAME_RUN_KEYS = ("model.source", "model.name", "model.pretrained", "model.kwargs", "model.method",
                 "model.num_members", "model.member_batches", "model.packed_alpha", "model.packed_gamma",
                 "model.fast_weight_init_std", "model.film_init_std", "model.layers", "reg.regularize",
                 "data.dataset", "data.train_subset", "data.val_split", "data.split_seed", "data.calib_split",
                 "data.img_size", "seed")
# Keys a checkpoint written before they existed lacks: its run had the value that keeps the old behaviour.
_BEFORE_THE_KEY = {"data.calib_split": 0}


def check_same_run(state: TrainerState, cfg: Config, layout: BatchLayout) -> BatchLayout:
    """Refuse a checkpoint of another run (every differing key in one error); return the batch layout to resume
    with, adapted to this world size when only the world size changed."""
    saved_cfg, current = state.config, cfg.model_dump(mode="json")
    problems = [f"  - {key}: the checkpoint's run has {_saved(saved_cfg, key)!r}, this config {_get(current, key)!r}"
                for key in SAME_RUN_KEYS if _saved(saved_cfg, key) != _get(current, key)]
    saved = state.layout
    problems += _strategy_problems(state, cfg, saved.world_size, layout.world_size)
    resumed = _adapt(saved, layout, problems)
    if problems:
        raise UsageError("cannot resume: the config describes a different run than the checkpoint\n"
                         + "\n".join(problems) + "\nstart a new run_dir for a different run")
    for key in ("train.max_steps", "train.epochs", "schedule.warmup_steps", "schedule.name"):
        if _get(saved_cfg, key) != _get(current, key):
            warnings.warn(f"{key} changed from {_get(saved_cfg, key)!r} to {_get(current, key)!r} on resume: the "
                          "learning-rate schedule is recomputed for the new budget from this step on", stacklevel=2)
    return resumed


def _strategy_problems(state: TrainerState, cfg: Config, saved_world: int, world: int) -> list[str]:
    """A checkpoint is read by the strategy that wrote it, of the same kind (DeepSpeed's: the same ZeRO stage) and,
    where the strategy cannot reshard it, at the same world size: told from its metadata, before any model, engine
    or process group is built, with the way across."""
    saved = {"name": "ddp", **state.config.get("strategy", {})}
    now = cfg.strategy.model_dump(mode="json")
    saved_cls, now_cls = strategy_class(saved["name"]), strategy_class(now["name"])
    across = ("to change strategy, carry the weights across: `sigmanens export <checkpoint> model.pt` (any "
              "strategy's checkpoint) and start a new run with model.init_from=model.pt")
    fmt = state.format
    if now_cls.checkpoint_format != fmt or now_cls.checkpoint_kind(now) != saved_cls.checkpoint_kind(saved):
        return [f"  - strategy: the checkpoint was written by {saved_cls.describe(saved)} ({fmt} format) and this "
                f"run uses {now_cls.describe(now)}; resume with {saved_cls.describe(saved)}, or {across}"]
    refusal = now_cls.reshard_refusal(saved, saved_world, world) if saved_world != world else None
    return [f"  - world size: {refusal}, or {across}"] if refusal else []


def _adapt(saved: BatchLayout, wanted: BatchLayout, problems: list[str]) -> BatchLayout:
    if wanted.world_size == saved.world_size:
        if wanted != saved:
            problems.append(f"  - train.batch_size × world size × train.grad_accum: the checkpoint's run has "
                            f"{saved.per_rank} × {saved.world_size} × {saved.grad_accum} = {saved.global_batch}, "
                            f"this config {wanted.per_rank} × {wanted.world_size} × {wanted.grad_accum} = "
                            f"{wanted.global_batch}; the global batch must stay the same")
        return saved
    if wanted.micro_global == saved.micro_global and wanted.grad_accum == saved.grad_accum:
        return wanted  # the user already adapted the per-rank batch to the new world size
    if (wanted.per_rank, wanted.grad_accum) != (saved.per_rank, saved.grad_accum):
        problems.append(f"  - train.batch_size / train.grad_accum: changed from {saved.per_rank} / "
                        f"{saved.grad_accum} to {wanted.per_rank} / {wanted.grad_accum} while the world size changed "
                        f"from {saved.world_size} to {wanted.world_size}; keep the recipe's values (the per-rank batch "
                        f"adapts by itself) or set train.batch_size={saved.micro_global // wanted.world_size}")
        return saved
    if saved.micro_global % wanted.world_size:
        problems.append(f"  - world size: the checkpoint's run takes {saved.micro_global} samples per micro-batch "
                        f"({saved.per_rank} on each of {saved.world_size} ranks), which {wanted.world_size} ranks "
                        f"cannot share equally; resume on a world size that divides {saved.micro_global}")
        return saved
    adapted = BatchLayout(saved.micro_global // wanted.world_size, wanted.world_size, saved.grad_accum)
    # info: rank 0 logs at INFO, the others only from WARNING on, so this prints once, not once per rank
    log.info("elastic resume: %d ranks instead of %d; per-rank batch %d → %d keeps the global batch of %d",
                wanted.world_size, saved.world_size, saved.per_rank, adapted.per_rank, saved.global_batch)
    return adapted


def _saved(tree: dict[str, Any], dotted: str) -> Any:
    """``dotted`` in a checkpoint's config, or the value it had before the key existed."""
    value = _get(tree, dotted)
    return _BEFORE_THE_KEY.get(dotted) if value is None else value


def _get(tree: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree
