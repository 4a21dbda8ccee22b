"""The trainer's part of a checkpoint as one typed, versioned record: :class:`TrainerState` is its one writer
(:meth:`TrainerState.to_dict`) and its one reader (:meth:`TrainerState.read`, :meth:`TrainerState.from_dict`), so
no other module knows the keys a checkpoint stores them under, and a checkpoint of a later layout is refused in one
line instead of failing on a missing key in the middle of a resume.

A checkpoint is the trainer's state beside the strategy's: one file ``step_N.pt`` holds both (the strategy's
``model``, ``optimizer`` and ``scaler`` next to the keys below), a folder ``step_N/`` holds the trainer's state in
``trainer.pt`` and the strategy's shards beside it. What is not the trainer's is handed back untouched as
:attr:`TrainerState.strategy`, for the strategy that wrote it.

Versions (:data:`VERSION` is the one this code writes; every older one is read):

1. every checkpoint written up to and including release 0.3.0 (those carry no ``version`` key; development
   checkpoints from before 0.1.0 may lack ``batch``, derived from their config, and ``model_args``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from sigmanens_dist.distributed.strategies import folder_format
from sigmanens_dist.distributed.strategies.base import FOLDER_KEY
from sigmanens_dist.errors import UsageError
from sigmanens_dist.safe_load import load_file

if TYPE_CHECKING:
    import torch

__all__ = ["TRAINER_STATE", "VERSION", "BatchLayout", "LaterVersionError", "ModelArgs", "Position", "TrainerState",
           "check_folder", "is_checkpoint_file", "record_best"]

#: The layout of the trainer's state this code writes; a checkpoint of a higher one is refused.
VERSION = 1
#: The trainer's non-tensor state inside a checkpoint folder (position, RNG of all ranks, schedule, config…).
TRAINER_STATE = "trainer.pt"
# The strategy's entry holding a file checkpoint's model weights (Strategy.state_dict's "model").
_WEIGHTS = "model"


class LaterVersionError(UsageError):
    """A checkpoint written by a later sigmanens, in a layout this one does not know: never stepped over by
    ``--resume auto`` as if it were a crash artifact."""


@dataclass
class Position:
    """Where the run is: optimiser steps taken, and the next micro-batch as (epoch, batch within the epoch)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


@dataclass(frozen=True)
class BatchLayout:
    """How one optimiser step's samples are spread: per rank, over ranks, over accumulated micro-batches."""

    per_rank: int
    world_size: int
    grad_accum: int

    @property
    def micro_global(self) -> int:
        """Samples in one micro-batch of all ranks together: the unit the data position counts in."""
        return self.per_rank * self.world_size

    @property
    def global_batch(self) -> int:
        return self.micro_global * self.grad_accum


class ModelArgs(TypedDict):
    """The sizes a model is rebuilt with (``build_model(cfg, **model_args)``): known from the data, not the config."""

    num_classes: int
    in_chans: int
    vocab_size: int | None


@dataclass
class TrainerState:
    """The trainer's part of one checkpoint."""

    config: dict[str, Any]  # the run's resolved config, ``Config.model_dump(mode="json")``
    position: Position
    layout: BatchLayout
    rng: list[dict[str, Any]]  # every rank's random streams (training.rng.capture_rng), rank order
    scheduler: dict[str, Any]  # the learning-rate schedule's state_dict
    model_args: ModelArgs | None  # None only in development checkpoints from before 0.1.0
    ema: dict[str, torch.Tensor] | None = None  # the weight average, unless the run kept none or keeps it sharded
    run_id: str | None = None  # the MLflow run that wrote it
    format: str = "file"  # the strategy's checkpoint format: "file", or the folder format whose shards sit beside
    best: float | None = None  # the best metric so far (the checkpoint manager records it when it writes)
    strategy: dict[str, Any] = field(default_factory=dict, repr=False)  # read back: the strategy's part (module doc)
    version: int = VERSION

    # -- the writer ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """What :meth:`from_dict` reads, at :data:`VERSION`: the strategy adds its part, the manager the best."""
        return {"version": VERSION, "config": self.config, "position": asdict(self.position),
                "batch": asdict(self.layout), "rng": self.rng, "scheduler": self.scheduler,
                "model_args": self.model_args, "ema": self.ema, "mlflow_run_id": self.run_id, "format": self.format}

    # -- the reader ------------------------------------------------------------------------------------------------
    @classmethod
    def read(cls, path: Path | str) -> TrainerState:
        """One checkpoint file or folder, or an error if it is unreadable, not ours or of a later version. A
        folder's shard index is checked (by the strategy that writes the format), its shards stay where they are."""
        path = Path(path)
        if path.is_dir() and not (path / TRAINER_STATE).is_file():  # a run directory, or a folder half written
            raise UsageError(f"{path} is a folder without {TRAINER_STATE}: not a checkpoint folder (a run directory? "
                             "give its checkpoints/best.pt or a step, or resolve it with resolve_checkpoint)")
        raw = load_file(path / TRAINER_STATE if path.is_dir() else path, "checkpoint")
        return cls.from_dict(raw, path)

    @classmethod
    def from_dict(cls, raw: Any, path: Path) -> TrainerState:
        """The record of a loaded checkpoint (``path``: the file or folder it came from, named in the errors)."""
        folder = Path(path).is_dir()
        version = raw.get("version", 1) if isinstance(raw, dict) else None
        if version is not None and (not isinstance(version, int) or version > VERSION):
            raise LaterVersionError(f"{path} is a checkpoint of trainer-state version {version!r}, written by a later "
                                    f"sigmanens; this one reads versions 1 to {VERSION}: upgrade sigmanens-dist to "
                                    "read it")
        needed = ("format", "position") if folder else (_WEIGHTS, "position")
        if version is None or any(key not in raw for key in needed):
            what = "checkpoint folder" if folder else "checkpoint"
            raise UsageError(f"{path} is not a sigmanens {what} (missing {'/'.join(repr(k) for k in needed)})")
        fmt = raw.get("format", "file")
        if folder:
            check_folder(path, fmt)
        config = raw.get("config") or {}
        ours = {"version", "config", "position", "batch", "rng", "scheduler", "model_args", "ema", "mlflow_run_id",
                "format", "best"}
        strategy = {key: value for key, value in raw.items() if key not in ours}
        if folder:
            strategy.update({FOLDER_KEY: path, "format": fmt})
        return cls(config=config, position=Position(**raw["position"]), layout=_layout(raw, config),
                   rng=list(raw.get("rng", [])), scheduler=raw.get("scheduler", {}), model_args=raw.get("model_args"),
                   ema=raw.get("ema"), run_id=raw.get("mlflow_run_id"), format=fmt, best=raw.get("best"),
                   strategy=strategy, version=version)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """A file checkpoint's model weights (a folder's are in its shards: the strategy consolidates them)."""
        return self.strategy[_WEIGHTS]


def _layout(raw: dict[str, Any], config: dict[str, Any]) -> BatchLayout:
    """The recorded batch layout; a development checkpoint from before 0.1.0 has none: its config and the number
    of ranks that wrote it give it."""
    if "batch" in raw:
        return BatchLayout(**raw["batch"])
    train = config.get("train", {})
    return BatchLayout(train.get("batch_size", 0), len(raw.get("rng", [])), train.get("grad_accum", 1))


def check_folder(path: Path, fmt: str) -> None:
    """Raise if a checkpoint folder's shard index is missing, unreadable or could run code when loaded (a truncated,
    foreign or hostile folder): the strategy that writes the format knows how."""
    folder_format(fmt).check_folder(path)


def record_best(state: dict[str, Any], best: float | None) -> dict[str, Any]:
    """``state`` (a :meth:`TrainerState.to_dict` with the strategy's part) with the best metric so far, which only
    the checkpoint manager knows when it writes."""
    return {**state, "best": best}


def is_checkpoint_file(obj: Any) -> bool:
    """Whether a loaded file is a trainer checkpoint (``step_N.pt``) rather than a plain state dict."""
    return isinstance(obj, dict) and _WEIGHTS in obj and "position" in obj
