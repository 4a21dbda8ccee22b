"""Build the trained model from the config: a σN-Ens ensemble, or the plain backbone as a single-model baseline.

Both answer the same interface (``forward(x) -> (M, B, K)``, ``num_members``, ``diversity_loss(tau)``), so the train
loop never asks which one it has.
"""

from __future__ import annotations

from typing import Any

import timm
import torch
from torch import nn

from sigmanens_dist.ensemble import SigmaEnsemble, convert_to_sigma_ensemble
from sigmanens_dist.layers import SigmaStore, sigma_class_for

__all__ = ["SingleModel", "build_model", "param_groups"]


class SingleModel(nn.Module):
    """A plain backbone seen as an ensemble of one member (the baseline σN-Ens is compared with)."""

    num_members = 1

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x).unsqueeze(0)

    def diversity_loss(self, tau: float) -> torch.Tensor:
        return torch.zeros((), device=next(self.parameters()).device)


def build_model(cfg: Any, num_classes: int, in_chans: int) -> SigmaEnsemble | SingleModel:
    """``timm.create_model`` then, unless ``model.ensemble`` is false, ``convert_to_sigma_ensemble``."""
    model_cfg = cfg.model
    backbone = timm.create_model(model_cfg.name, pretrained=model_cfg.pretrained,
                                 num_classes=model_cfg.num_classes or num_classes,
                                 in_chans=model_cfg.in_chans or in_chans, **model_cfg.kwargs)
    if not model_cfg.ensemble:
        return SingleModel(backbone)
    return convert_to_sigma_ensemble(backbone, model_cfg.num_members, gamma_init_mean=model_cfg.gamma_init_mean,
                                     gamma_init_std=model_cfg.gamma_init_std, layers=model_cfg.layers,
                                     regularize=cfg.reg.regularize, seed=cfg.seed, inplace=True)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on shared weights only: none on the σ store (by type: decaying γ would pull every importance to
    σ(0)=½ and fight the regulariser), on plain norm layers, or on biases."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, SigmaStore) or sigma_class_for(module) is not None:
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, other = [], []
    for p in model.parameters():
        if p.requires_grad:
            (other if id(p) in no_decay or p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
