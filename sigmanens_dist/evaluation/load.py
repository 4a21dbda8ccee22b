"""Reading a training checkpoint back as its trained model, on top of
:func:`sigmanens_dist.checkpoint.read_checkpoint` (any strategy's file or folder): the model is rebuilt from the
config and the model sizes stored with it. The one checkpoint → model rebuild: eval, the end-of-training eval, and
every export (a state dict of one member, a program) start from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from sigmanens_dist.checkpoint import read_checkpoint
from sigmanens_dist.config import Config, config_from_dict
from sigmanens_dist.errors import MissingPathError, UsageError
from sigmanens_dist.models import build_model

__all__ = ["EvalCheckpoint", "load_for_eval", "method_of"]


class EvalCheckpoint(NamedTuple):
    """What evaluation needs from a checkpoint; unpacks as ``cfg, model, ema, run_id, step, model_args = …``."""

    cfg: Config
    model: nn.Module  # the raw weights, in eval mode
    ema: nn.Module | None  # the EMA weights when the run kept an EMA
    run_id: str | None  # the MLflow run that wrote the checkpoint
    step: int  # optimiser steps the checkpoint had taken
    model_args: dict[str, Any]  # the sizes the model was rebuilt with (num_classes, in_chans, vocab_size)


def method_of(cfg: Config) -> str:
    """The training method a config names (``model.method``)."""
    return cfg.model.method


def load_for_eval(path: Path | str, overrides: Sequence[str] = (), *, what: str = "--checkpoint",
                  with_ema: bool = True, check_data: bool = True,
                  check_overrides: Callable[[Config, Config], None] | None = None) -> EvalCheckpoint:
    """Rebuild the model a checkpoint was trained as, from the config stored in it (``overrides``, dotted
    ``key=value`` strings such as ``data.root=/elsewhere``, are applied to that config first), and load the raw and,
    ``with_ema``, the EMA weights. ``check_data``: refuse a config whose data is not here (what needs no data, a
    state dict, passes False). ``check_overrides(trained, cfg)``: called with the config as the run trained and as
    overridden before any model is built, so that refusing an override costs no model. Errors name the file (as
    ``what``): missing, not a checkpoint, weights of another method than its config says."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"{what} {path}: no such file or checkpoint folder")
    ckpt = read_checkpoint(path, what, with_ema=with_ema)
    cfg = _config(ckpt.config, overrides, path, check_data)
    if check_overrides is not None:
        check_overrides(_config(ckpt.config, (), path, False) if overrides else cfg, cfg)
    model = _build(cfg, ckpt.model_args, ckpt.weights, path, "model")
    ema = None if ckpt.ema is None else _build(cfg, ckpt.model_args, ckpt.ema, path, "ema")
    return EvalCheckpoint(cfg, model, ema, ckpt.run_id, ckpt.step, ckpt.model_args)


def _config(stored: dict[str, Any], overrides: Sequence[str], path: Path, check_data: bool) -> Config:
    try:
        return config_from_dict(stored, overrides, source=f"the config stored in {path}", check_data=check_data)
    except ValueError as err:
        raise UsageError(f"the config stored in {path} does not load here (with overrides {list(overrides)}):\n"
                         f"{err}") from err


def _build(cfg: Config, model_args: dict[str, Any], weights: dict[str, Any], path: Path, key: str) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the weights come from the checkpoint: never read pretrained or source ones again
    model = build_model(cfg.without_source_weights(), **model_args)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        raise UsageError(f"{path}: the {key!r} weights are not those of a model.method={method_of(cfg)!r} model as "
                         f"the checkpoint's config says; the file and its config disagree "
                         f"({' '.join(first[:3])[:400]})") from err
    return model.eval()
