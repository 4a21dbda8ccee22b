"""The one home of checkpoints: the trainer's part as a typed, versioned record (:mod:`.state`: its one writer and
reader), writing, rotating and finding them (:mod:`.manager`), and reading any strategy's back as a whole model
(:mod:`.read`). Each strategy owns its folder format (``Strategy.check_folder``,
``consolidated``, ``save_checkpoint``); this package never asks which strategy wrote a checkpoint."""

from sigmanens_dist.checkpoint.manager import CheckpointManager
from sigmanens_dist.checkpoint.read import (
    Checkpoint,
    consolidated_ema,
    consolidated_state_dict,
    read_checkpoint,
    resolve_checkpoint,
)
from sigmanens_dist.checkpoint.state import (
    TRAINER_STATE,
    BatchLayout,
    LaterVersionError,
    ModelArgs,
    Position,
    TrainerState,
    check_folder,
    is_checkpoint_file,
)

__all__ = ["TRAINER_STATE", "BatchLayout", "Checkpoint", "CheckpointManager", "LaterVersionError", "ModelArgs",
           "Position", "TrainerState", "check_folder", "consolidated_ema", "consolidated_state_dict",
           "is_checkpoint_file", "read_checkpoint", "resolve_checkpoint"]
