"""A checkpoint of any strategy read back as a whole model on one CPU process, without a process group: what
export, eval, ``model.init_from`` and predict's programs start from. The model sizes come from the ``model_args``
saved with it, the config from the config saved with it; nothing is inferred from the dataset's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from sigmanens_dist.checkpoint.manager import CheckpointManager
from sigmanens_dist.checkpoint.state import TRAINER_STATE, ModelArgs, Position, TrainerState
from sigmanens_dist.distributed.strategies import folder_format
from sigmanens_dist.errors import MissingPathError, UsageError

__all__ = ["Checkpoint", "consolidated_ema", "consolidated_state_dict", "read_checkpoint", "resolve_checkpoint"]


def resolve_checkpoint(path: Path | str, what: str = "checkpoint") -> tuple[Path, str]:
    """A checkpoint as given (a ``step_N.pt`` / ``best.pt`` file or a step folder), or for a run directory its best
    checkpoint, else its newest; returned with a phrase saying which was picked (callers log it). ``what`` names
    the argument in the error (e.g. ``model.init_from``)."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"{what} {path}: no such file or folder")
    if path.is_file() or (path / TRAINER_STATE).is_file():
        return path, f"{path}"
    manager = CheckpointManager(path)
    best = [b for b in (manager.directory / "best.pt", manager.directory / "best") if b.exists()]
    if best:
        return best[0], f"{best[0]} (the run's best checkpoint)"
    steps = manager.checkpoints()
    if steps:
        return steps[-1], f"{steps[-1]} (the run's newest checkpoint; it has no best)"
    raise MissingPathError(f"{what} {path}: a folder that is neither a checkpoint (no {TRAINER_STATE}) nor a run "
                            f"directory with checkpoints (nothing in {manager.directory})")


class Checkpoint(NamedTuple):
    """What a checkpoint holds for everything but resume (export, eval, ``model.init_from``), whatever wrote it."""

    config: dict[str, Any]  # the run's resolved config, as saved
    model_args: ModelArgs  # num_classes, in_chans, vocab_size: what the model is rebuilt with
    weights: dict[str, torch.Tensor]  # the full model state dict, consolidated on one CPU process
    ema: dict[str, torch.Tensor] | None  # the weight average's, when the run kept one and it was asked for
    position: Position  # optimiser steps taken and the next micro-batch
    run_id: str | None  # the MLflow run that wrote it

    @property
    def step(self) -> int:
        return self.position.step


def read_checkpoint(path: Path | str, what: str = "checkpoint", *, with_ema: bool = False,
                    state: Any = None) -> Checkpoint:
    """A checkpoint file or folder of any strategy, consolidated (its EMA too with ``with_ema``); refused in one
    line when it is not complete, not ours, or lacks the config or model sizes it is rebuilt from. ``state``: the
    checkpoint file's content when the caller has read it already (``model.init_from`` tells a checkpoint from a
    plain state dict by it)."""
    path = Path(path)
    if state is None:
        weights, saved = consolidated_state_dict(path)
    else:
        saved = TrainerState.from_dict(state, path)
        weights = saved.weights
    missing = [name for name, value in (("config", saved.config), ("model_args", saved.model_args)) if not value]
    if missing:
        raise UsageError(f"{what} {path} does not record {' and '.join(missing)} (not written by sigmanens train, "
                         "or by a version before 0.1): rebuild the model yourself and load its state dict")
    return Checkpoint(saved.config, saved.model_args, weights, consolidated_ema(path, saved) if with_ema else None,
                      saved.position, saved.run_id)


def consolidated_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], TrainerState]:
    """The full model state dict of a checkpoint and the trainer's state saved with it (config, model args…)."""
    path = Path(path)
    saved = TrainerState.read(path)  # refuses an incomplete, foreign or later-version checkpoint
    fmt = saved.format
    return (saved.weights if fmt == "file" else folder_format(fmt).consolidated(path, "model")), saved


def consolidated_ema(path: Path, saved: TrainerState) -> dict[str, torch.Tensor] | None:
    """The EMA weights of a checkpoint whose run kept an EMA (in the trainer's state, or with the shards), else
    None."""
    if saved.ema is not None or saved.format == "file":
        return saved.ema
    return folder_format(saved.format).consolidated(Path(path), "ema")
