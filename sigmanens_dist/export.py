"""A checkpoint of any strategy → its trained model, on one CPU process without a process group: the model behind
``sigmanens export --member K`` (:mod:`sigmanens_dist.cli.export`), and a run's model for use in Python."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["load_model"]


def load_model(path: Path) -> torch.nn.Module:
    """The trained model of a checkpoint, rebuilt from its config and loaded, on CPU."""
    from sigmanens_dist.config import Config
    from sigmanens_dist.models import build_model
    from sigmanens_dist.training.checkpoint import consolidated_state_dict

    weights, state = consolidated_state_dict(path)
    if "model_args" not in state:
        raise ValueError(f"{path} does not record the model's class count and input channels (written by an "
                         "older version); rebuild the model yourself and load the state dict")
    cfg = Config.model_validate(state["config"]).without_source_weights()
    model = build_model(cfg, **state["model_args"])
    model.load_state_dict(weights)
    return model.eval()

