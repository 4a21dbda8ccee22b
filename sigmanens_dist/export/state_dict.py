"""A checkpoint of any strategy → its trained model, on one CPU process without a process group: the model behind
``sigmanens export --member K`` (:mod:`sigmanens_dist.cli.export`), and a run's model for use in Python."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sigmanens_dist.evaluation.load import load_for_eval

if TYPE_CHECKING:
    import torch

__all__ = ["load_model"]


def load_model(path: Path) -> torch.nn.Module:
    """The trained model of a checkpoint (its raw weights), on CPU: eval's own rebuild
    (:func:`~sigmanens_dist.evaluation.load.load_for_eval`), without the EMA and without the data, which a state
    dict does not need."""
    return load_for_eval(path, what="checkpoint", with_ema=False, check_data=False).model
