"""A checkpoint of any strategy → its trained model, on one CPU process without a process group: the model behind
``sigmanens export --member K`` (:mod:`sigmanens_dist.cli.export`), and a run's model for use in Python."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["load_model"]


def load_model(path: Path) -> torch.nn.Module:
    """The trained model of a checkpoint, rebuilt from its config and model sizes and loaded, on CPU."""
    from sigmanens_dist.checkpoint import read_checkpoint
    from sigmanens_dist.config import Config
    from sigmanens_dist.models import build_model

    ckpt = read_checkpoint(path)
    model = build_model(Config.model_validate(ckpt.config).without_source_weights(), **ckpt.model_args)
    model.load_state_dict(ckpt.weights)
    return model.eval()
