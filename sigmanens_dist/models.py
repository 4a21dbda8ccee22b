"""Build the trained model from the config: a σN-Ens ensemble, or the plain backbone as a single-model baseline.

Both answer the same interface (``forward(x) -> (M, B, K)``, ``num_members``, ``diversity_loss(tau)``), so the train
loop never asks which one it has.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

from sigmanens_dist.ensemble import Inputs, SigmaEnsemble, convert_to_sigma_ensemble, logits_of
from sigmanens_dist.layers import SigmaStore, sigma_class_for

__all__ = ["SingleModel", "build_model", "param_groups"]


class SingleModel(nn.Module):
    """A plain backbone seen as an ensemble of one member (the baseline σN-Ens is compared with)."""

    num_members = 1

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: Inputs) -> torch.Tensor:
        out = self.backbone(**x) if isinstance(x, Mapping) else self.backbone(x)  # tokenizer dicts are kwargs
        return logits_of(out).unsqueeze(0)

    def diversity_loss(self, tau: float) -> torch.Tensor:
        return torch.zeros((), device=next(self.parameters()).device)


def build_model(cfg: Any, num_classes: int, in_chans: int, vocab_size: int | None = None
                ) -> SigmaEnsemble | SingleModel:
    """The backbone (``timm.create_model``, or a Hugging Face sequence classifier for ``model.source=hf``, whose
    embeddings must cover the tokenizer's ``vocab_size``) then, unless ``model.ensemble`` is false,
    ``convert_to_sigma_ensemble``."""
    model_cfg = cfg.model
    if model_cfg.source == "hf":
        backbone = _hf_backbone(model_cfg, model_cfg.num_classes or num_classes, vocab_size)
    else:
        backbone = timm.create_model(model_cfg.name, pretrained=model_cfg.pretrained,
                                     num_classes=model_cfg.num_classes or num_classes,
                                     in_chans=model_cfg.in_chans or in_chans, **model_cfg.kwargs)
    if not model_cfg.ensemble:
        return SingleModel(backbone)
    return convert_to_sigma_ensemble(backbone, model_cfg.num_members, gamma_init_mean=model_cfg.gamma_init_mean,
                                     gamma_init_std=model_cfg.gamma_init_std, layers=model_cfg.layers,
                                     regularize=cfg.reg.regularize, seed=cfg.seed, inplace=True)


def _hf_backbone(model_cfg: Any, num_labels: int, vocab_size: int | None) -> nn.Module:
    """A local pretrained folder, or an untrained model from ``bert`` + kwargs or from a folder's config.json.
    Only local folders: runs must not depend on (or wait for) the Hub."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertConfig

    name, kwargs = model_cfg.name, model_cfg.kwargs
    if (model_cfg.pretrained or name != "bert") and not (Path(name) / "config.json").is_file():
        what = "a local Hugging Face model folder" + ("" if model_cfg.pretrained else " or 'bert'")
        raise FileNotFoundError(f"model.name={name!r} with model.source=hf must be {what}; {name}/config.json "
                                "is missing (nothing is downloaded)")
    if model_cfg.pretrained:
        backbone = AutoModelForSequenceClassification.from_pretrained(name, num_labels=num_labels, **kwargs)
    else:
        if name == "bert":
            if vocab_size is None:
                raise ValueError("model.name=bert (from scratch) needs the tokenizer's vocabulary size; use a text "
                                 "dataset (data.dataset=sst2)")
            config = BertConfig(vocab_size=vocab_size, num_labels=num_labels, **kwargs)
        else:
            config = AutoConfig.from_pretrained(name, num_labels=num_labels, **kwargs)
        backbone = AutoModelForSequenceClassification.from_config(config)
    model_vocab = getattr(backbone.config, "vocab_size", None)
    if vocab_size is not None and model_vocab is not None and vocab_size > model_vocab:
        raise ValueError(f"the tokenizer has {vocab_size} tokens but model.name={name!r} embeds only {model_vocab}: "
                         "set data.tokenizer to this backbone's own tokenizer folder")
    return backbone


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on shared weights only: none on the σ store (by type: decaying γ would pull every importance to
    σ(0)=½ and fight the regulariser), on plain norm layers, on biases, or on what a module names in its
    ``no_weight_decay()`` (timm ViT's ``pos_embed`` and ``cls_token``, as timm's optimizer factory does)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, SigmaStore) or sigma_class_for(module) is not None:
            no_decay.update(id(p) for p in module.parameters(recurse=False))
        if callable(getattr(module, "no_weight_decay", None)):
            named = dict(module.named_parameters())
            for name in module.no_weight_decay():
                no_decay.update(id(p) for n, p in named.items() if n == name or n.startswith(f"{name}."))
    decay, other = [], []
    for p in model.parameters():
        if p.requires_grad:
            (other if id(p) in no_decay or p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
