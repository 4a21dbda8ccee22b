"""The one home of checkpoints: writing, rotating and finding them (:mod:`.manager`), and reading any strategy's
back as a whole model (:mod:`.read`). Each strategy owns its folder format (``Strategy.check_folder``,
``consolidated``, ``save_checkpoint``); this package never asks which strategy wrote a checkpoint."""

from sigmanens_dist.checkpoint.manager import TRAINER_STATE, CheckpointManager, check_folder
from sigmanens_dist.checkpoint.read import (
    Checkpoint,
    consolidated_ema,
    consolidated_state_dict,
    is_checkpoint_file,
    read_checkpoint,
    resolve_checkpoint,
)

__all__ = ["TRAINER_STATE", "Checkpoint", "CheckpointManager", "check_folder", "consolidated_ema",
           "consolidated_state_dict", "is_checkpoint_file", "read_checkpoint", "resolve_checkpoint"]
