"""Build the trained model from the config: the backbone, then the ensemble method ``model.method`` names.

Every method answers :class:`sigmanens_dist.methods.EnsembleMethod` (``forward(x) -> (M, B, K)``, ``num_members``,
``aux_loss``, ``no_weight_decay``…), so the train loop never asks which one it has. And the one checkpoint → model
rebuild (:func:`load_trained`, on top of :func:`sigmanens_dist.checkpoint.read_checkpoint`, any strategy's file or
folder): the model rebuilt from the config and model sizes stored with it, for eval, every export and the
end-of-training eval.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import timm
import torch
from torch import nn

from sigmanens_dist.checkpoint import is_checkpoint_file, read_checkpoint, resolve_checkpoint
from sigmanens_dist.config import Config, ModelConfig, config_from_dict
from sigmanens_dist.errors import MissingPathError, UsageError
from sigmanens_dist.methods import EnsembleMethod, build_method
from sigmanens_dist.methods.single import SingleModel
from sigmanens_dist.safe_load import load_file, load_safetensors
from sigmanens_dist.sigma.layers import SigmaStore

__all__ = ["SingleModel", "Source", "TrainedModel", "build_model", "enable_grad_checkpointing", "load_trained",
           "source_weights"]

log = logging.getLogger(__name__)


def build_model(cfg: Config, num_classes: int, in_chans: int, vocab_size: int | None = None) -> EnsembleMethod:
    """The ensemble ``model.method`` names (:mod:`sigmanens_dist.methods`), around backbones built by
    ``timm.create_model`` (or, for ``model.source=hf``, a Hugging Face sequence classifier whose embeddings must
    cover the tokenizer's ``vocab_size``). Methods with several backbones (Deep Ensemble) call the factory once per
    member. ``model.init_from``'s weights are loaded (:func:`source_weights`)."""
    return _assemble(cfg, num_classes, in_chans, vocab_size,
                     source_weights(cfg.model.init_from) if cfg.model.init_from else None)


def _assemble(cfg: Config, num_classes: int, in_chans: int, vocab_size: int | None, source: Source | None
              ) -> EnsembleMethod:
    """:func:`build_model` with the source weights given (None: none; a trained model's rebuild never reads them)."""
    model_cfg = cfg.model

    def make_backbone() -> nn.Module:
        if model_cfg.source == "hf":
            backbone = _hf_backbone(model_cfg, model_cfg.num_classes or num_classes, vocab_size)
        else:
            backbone = timm.create_model(model_cfg.name, pretrained=model_cfg.pretrained,
                                         num_classes=model_cfg.num_classes or num_classes,
                                         in_chans=model_cfg.in_chans or in_chans, **model_cfg.kwargs)
        if source is not None and not source.whole_model:
            _load_source(backbone, source, model_cfg)
        if cfg.train.grad_checkpointing:
            enable_grad_checkpointing(backbone, model_cfg.name)
        return backbone

    model = build_method(cfg, make_backbone)
    if cfg.train.grad_checkpointing and isinstance(getattr(model, "sigma", None), SigmaStore):
        model.sigma.plan = dataclasses.replace(model.sigma.plan, per_pass=False)  # recomputed blocks: as first
    if source is not None and source.whole_model:
        _load_source(model, source, model_cfg)
    return model


class Source(NamedTuple):
    """What ``model.init_from`` names: backbone weights (a network to convert) or a whole model's (the same method,
    carried to a new run, e.g. under another strategy), and the method that wrote them when known."""

    weights: dict[str, torch.Tensor]
    whole_model: bool
    method: str | None


def source_weights(init_from: str | Path) -> Source:
    """The weights ``model.init_from`` names: a run directory (best checkpoint, else newest), a checkpoint file or
    folder of any strategy (read by :func:`read_checkpoint`, like export and eval), or a plain state dict (``sigmanens
    export``, a timm weights file). A single model's become backbone weights (a conversion); an ensemble's stay a
    whole model's."""
    path, which = resolve_checkpoint(init_from, "model.init_from")
    method = None
    if path.suffix == ".safetensors":
        weights = _plain_weights(load_safetensors(path, "model.init_from"), path)
    else:
        loaded = None if path.is_dir() else load_file(path, "model.init_from")
        if loaded is None or is_checkpoint_file(loaded):
            ckpt = read_checkpoint(path, "model.init_from", state=loaded)
            weights, method = ckpt.weights, ckpt.config.get("model", {}).get("method", "single")
        else:
            weights = _plain_weights(loaded, path)
    log.info("model.init_from: the model starts from %s", which)
    if weights and all(k.startswith("backbone.") for k in weights):  # a SingleModel's keys
        return Source({k.removeprefix("backbone."): v for k, v in weights.items()}, False, method)
    whole = method not in (None, "single") or any(k.startswith("backbone.") for k in weights)
    return Source(weights, whole, method)


def _plain_weights(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    """A plain state dict (or the common ``{"state_dict": …}`` wrapper of other trainers), refused otherwise."""
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(f"model.init_from {path}: neither a sigmanens checkpoint nor a state dict of tensors")
    return obj


def _load_source(module: nn.Module, source: Source, model_cfg: ModelConfig) -> None:
    """Load the source strictly: a conversion that silently kept random layers would not be one."""
    what = "backbone" if not source.whole_model else f"model.method={model_cfg.method} model"
    if source.whole_model and source.method not in (None, model_cfg.method):
        raise UsageError(f"model.init_from={model_cfg.init_from} holds a whole model.method={source.method} model; "
                         f"it starts a model.method={source.method} run only. To convert one network, write one "
                         f"member with `sigmanens export <checkpoint> OUT --member K` and give OUT")
    try:
        module.load_state_dict(source.weights)
    except RuntimeError as err:
        # torch's "Error(s) in loading state_dict for X:" heads a list of lines; a σ store's refusal is one line
        text = str(err)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        lines = lines[1:4] if text.startswith("Error(s) in loading state_dict") else lines
        raise UsageError(f"model.init_from={model_cfg.init_from} does not fit this {what} (model.name="
                         f"{model_cfg.name!r}; {' '.join(lines)[:400]}); the source must be the same architecture "
                         "with the same class count, input channels"
                         + (" and members" if source.whole_model else "")) from err


def enable_grad_checkpointing(backbone: nn.Module, name: str) -> None:
    """Turn on the backbone's own activation checkpointing (per block, non-reentrant), before any conversion: the
    σ layers that replace its norms sit inside the recomputed blocks. BatchNorm layers (σ or plain) update their
    running statistics again when a block is recomputed, so with checkpointing each step moves them twice."""
    if hasattr(backbone, "gradient_checkpointing_enable"):  # Hugging Face
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(backbone, "set_grad_checkpointing"):  # timm
        try:
            backbone.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError) as err:
            raise UsageError(f"train.grad_checkpointing: model.name={name!r} does not support it ({err or 'timm'})"
                             ) from err
    else:
        raise UsageError(f"train.grad_checkpointing: model.name={name!r} ({type(backbone).__name__}) has neither "
                         "timm's set_grad_checkpointing nor Hugging Face's gradient_checkpointing_enable")
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in backbone.modules()):
        log.warning("train.grad_checkpointing with BatchNorm in %s: a recomputed block updates the running "
                    "statistics a second time, so they move at about twice the momentum", name)


def _hf_backbone(model_cfg: ModelConfig, num_labels: int, vocab_size: int | None) -> nn.Module:
    """A local pretrained folder, or an untrained model from ``bert`` + kwargs or from a folder's config.json.
    Only local folders: runs must not depend on (or wait for) the Hub."""
    # optional extra: text (transformers)
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertConfig

    name, kwargs = model_cfg.name, model_cfg.kwargs
    if (model_cfg.pretrained or name != "bert") and not (Path(name) / "config.json").is_file():
        what = "a local Hugging Face model folder" + ("" if model_cfg.pretrained else " or 'bert'")
        raise MissingPathError(f"model.name={name!r} with model.source=hf must be {what}; {name}/config.json "
                               "is missing (nothing is downloaded)")
    if model_cfg.pretrained:
        backbone = AutoModelForSequenceClassification.from_pretrained(name, num_labels=num_labels, **kwargs)
    else:
        if name == "bert":
            if vocab_size is None:
                raise UsageError("model.name=bert (from scratch) needs the tokenizer's vocabulary size; use a text "
                                 "dataset (data.dataset=sst2)")
            config = BertConfig(vocab_size=vocab_size, num_labels=num_labels, **kwargs)
        else:
            config = AutoConfig.from_pretrained(name, num_labels=num_labels, **kwargs)
        backbone = AutoModelForSequenceClassification.from_config(config)
    model_vocab = getattr(backbone.config, "vocab_size", None)
    if vocab_size is not None and model_vocab is not None and vocab_size > model_vocab:
        raise UsageError(f"the tokenizer has {vocab_size} tokens but model.name={name!r} embeds only {model_vocab}: "
                         "set data.tokenizer to this backbone's own tokenizer folder")
    return backbone


# -- the checkpoint → model rebuild ------------------------------------------------------------------------------
class TrainedModel(NamedTuple):
    """A checkpoint's trained model, rebuilt: what eval, every export and the end-of-training eval start from;
    unpacks as ``cfg, model, ema, run_id, step, model_args, path = …``."""

    cfg: Config
    model: nn.Module  # the raw weights, in eval mode
    ema: nn.Module | None  # the EMA weights when the run kept an EMA
    run_id: str | None  # the MLflow run that wrote the checkpoint
    step: int  # optimiser steps the checkpoint had taken
    model_args: dict[str, Any]  # the sizes the model was rebuilt with (num_classes, in_chans, vocab_size)
    path: Path  # the checkpoint file or folder it was read from


def load_trained(path: Path | str, overrides: Sequence[str] = (), *, what: str = "--checkpoint",
                 with_ema: bool = True, check_data: bool = True,
                 check_overrides: Callable[[Config, Config], None] | None = None) -> TrainedModel:
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
    cfg = _stored_config(ckpt.config, overrides, path, check_data)
    if check_overrides is not None:
        check_overrides(_stored_config(ckpt.config, (), path, False) if overrides else cfg, cfg)
    model = _rebuilt(cfg, ckpt.model_args, ckpt.weights, path, "model")
    ema = None if ckpt.ema is None else _rebuilt(cfg, ckpt.model_args, ckpt.ema, path, "ema")
    return TrainedModel(cfg, model, ema, ckpt.run_id, ckpt.step, ckpt.model_args, path)


def _stored_config(stored: dict[str, Any], overrides: Sequence[str], path: Path, check_data: bool) -> Config:
    try:
        return config_from_dict(stored, overrides, source=f"the config stored in {path}", check_data=check_data)
    except ValueError as err:
        raise UsageError(f"the config stored in {path} does not load here (with overrides {list(overrides)}):\n"
                         f"{err}") from err


def _rebuilt(cfg: Config, model_args: dict[str, Any], weights: dict[str, Any], path: Path, key: str) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the weights come from the checkpoint: never read pretrained or source ones again
    model = _assemble(cfg.without_source_weights(), source=None, **model_args)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        raise UsageError(f"{path}: the {key!r} weights are not those of a model.method={cfg.model.method!r} model as "
                         f"the checkpoint's config says; the file and its config disagree "
                         f"({' '.join(first[:3])[:400]})") from err
    return model.eval()
