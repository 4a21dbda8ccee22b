"""Reading a training checkpoint back as a model to evaluate: the one place that knows the checkpoint format.

A checkpoint is a file (``step_N.pt`` / ``best.pt``, DDP) or a folder (FSDP2's DCP shards, DeepSpeed's engine
files); ``export.consolidated_state_dict`` turns any of them into one state dict on one CPU process.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from torch import nn

from sigmanens_dist.config import Config, load_config
from sigmanens_dist.training.checkpoint import consolidated_ema, consolidated_state_dict

__all__ = ["EvalCheckpoint", "load_for_eval", "method_of", "model_dims"]


class EvalCheckpoint(NamedTuple):
    """What evaluation needs from a checkpoint; unpacks as ``cfg, model, ema, run_id, step = …``."""

    cfg: Config
    model: nn.Module  # the raw weights, in eval mode
    ema: nn.Module | None  # the EMA weights when the run kept an EMA
    run_id: str | None  # the MLflow run that wrote the checkpoint
    step: int  # optimiser steps the checkpoint had taken


def method_of(cfg: Config) -> str:
    """The training method a config names (``model.method``)."""
    return cfg.model.method


def load_for_eval(path: Path | str, overrides: Sequence[str] = ()) -> EvalCheckpoint:
    """Rebuild the model a checkpoint was trained as, from the config stored in it (``overrides``, dotted
    ``key=value`` strings such as ``data.root=/elsewhere``, are applied to that config first), and load the raw and
    EMA weights. Errors name the file: missing, not a checkpoint, weights of another method than its config says."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such file or checkpoint folder")
    weights, state = consolidated_state_dict(path)  # a file (DDP), a DCP or a DeepSpeed folder
    if not isinstance(state.get("config"), dict):
        raise ValueError(f"{path} holds no resolved config (key 'config'); it was not written by sigmanens train")
    cfg = _config(state["config"], overrides, path)
    num_classes, in_chans, vocab_size = model_dims(cfg)
    model = _build(cfg, num_classes, in_chans, vocab_size, weights, path, "model")
    ema_weights = consolidated_ema(path, state)
    ema = None if ema_weights is None else _build(cfg, num_classes, in_chans, vocab_size, ema_weights, path, "ema")
    return EvalCheckpoint(cfg, model, ema, state.get("mlflow_run_id"), int(state["position"]["step"]))


def _config(raw: dict[str, Any], overrides: Sequence[str], path: Path) -> Config:
    """The stored config through the same validation as a training run (data paths checked, overrides applied)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="ckpt_config_", delete=False) as f:
        yaml.safe_dump(raw, f, sort_keys=False)
        tmp = Path(f.name)
    try:
        return load_config(tmp, overrides)
    except ValueError as err:
        raise ValueError(f"the config stored in {path} does not load here (with overrides {list(overrides)}):\n"
                         f"{err}") from err
    finally:
        tmp.unlink(missing_ok=True)


def model_dims(cfg: Config) -> tuple[int, int, int | None]:
    """``(num_classes, in_chans, vocab_size)`` of the dataset, read from metadata only (no images are loaded)."""
    from sigmanens_dist.data.loaders import CLASSES_FILE

    d, root = cfg.data, cfg.data_root()
    if d.dataset == "sst2":
        from sigmanens_dist.data.sst2 import load_tokenizer

        return 2, 0, len(load_tokenizer(d.tokenizer, Path(root)))
    in_chans = 1 if d.dataset == "fashion_mnist" else 3
    if d.format != "raw":
        classes = json.loads((Path(root) / CLASSES_FILE).read_text())["classes"]
        return len(classes), in_chans, None
    if d.dataset in ("imagenet", "imagefolder"):
        return len([p for p in (Path(root) / "train").iterdir() if p.is_dir()]), 3, None
    return (100 if d.dataset == "cifar100" else 10), in_chans, None


def _build(cfg: Config, num_classes: int, in_chans: int, vocab_size: int | None, weights: dict[str, Any],
           path: Path, key: str) -> nn.Module:
    from sigmanens_dist.models import build_model

    torch.manual_seed(cfg.seed)  # the weights come from the checkpoint: never read pretrained or source ones again
    model = build_model(cfg.without_source_weights(), num_classes, in_chans, vocab_size)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        raise ValueError(f"{path}: the {key!r} weights are not those of a model.method={method_of(cfg)!r} model as "
                         f"the checkpoint's config says; the file and its config disagree "
                         f"({' '.join(first[:3])[:400]})") from err
    return model.eval()
