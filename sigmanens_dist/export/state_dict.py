"""A checkpoint of any strategy → its trained model, on one CPU process without a process group: the model behind
``sigmanens export --member K`` (:mod:`sigmanens_dist.cli.export`), and a run's model for use in Python."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sigmanens_dist.models import load_trained

if TYPE_CHECKING:
    import torch

__all__ = ["load_model"]


def load_model(path: Path) -> torch.nn.Module:
    """The trained model of a checkpoint (its raw weights), on CPU: the one rebuild
    (:func:`~sigmanens_dist.models.load_trained`), without the EMA and without the data, which a state
    dict does not need."""
    return load_trained(path, what="checkpoint", with_ema=False, check_data=False).model
