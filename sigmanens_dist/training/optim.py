"""The optimiser's set-up in one place, as torchtitan keeps ``components/optimizer.py`` and ``lr_scheduler.py``:
parameter groups (what decays, which parameters get their own rate), the σ store's and fast weights' rates, the
optimiser, and the warm-up + cosine schedule."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sigmanens_dist.config import OptimConfig, ScheduleConfig
from sigmanens_dist.sigma.layers import SigmaStore, sigma_class_for

__all__ = ["build_optimizer", "fast_weight_lr", "param_groups", "sigma_lr", "warmup_cosine"]


def param_groups(model: nn.Module, weight_decay: float, sigma_lr: float | None = None,
                 fast_lr: float | None = None) -> list[dict[str, Any]]:
    """Weight decay on shared weights only: none on the σ store (by type: decaying γ would pull every importance to
    σ(0)=½ and fight the regularizer), on plain norm layers, on biases, or on what a module names in its
    ``no_weight_decay()`` (timm ViT's ``pos_embed`` and ``cls_token``, as timm's optimizer factory does).

    ``sigma_lr`` (the peak rate × ``optim.sigma_lr_scale``) puts the σ store in a group of its own with that rate:
    under a member-mean loss each member's γ and affine get 1/M of the gradient, and ``sigma_lr = M·lr`` gives them a
    single model's rate back without touching the shared weights. None keeps the two-group layout (and resumes).
    ``fast_lr`` does the same for what the method names in ``fast_weights()`` (BatchEnsemble's r, s), undecayed.
    """
    store: set[int] = set()
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, SigmaStore):
            store.update(id(p) for p in module.parameters(recurse=False))
        if isinstance(module, SigmaStore) or sigma_class_for(module) is not None:
            no_decay.update(id(p) for p in module.parameters(recurse=False))
        if callable(getattr(module, "no_weight_decay", None)):
            named = dict(module.named_parameters())
            for name in module.no_weight_decay():
                no_decay.update(id(p) for n, p in named.items() if n == name or n.startswith(f"{name}."))
    own = store if sigma_lr is not None else set()
    fast_names = model.fast_weights() if fast_lr is not None and callable(getattr(model, "fast_weights", None)) \
        else set()
    fast_ids = {id(p) for n, p in model.named_parameters() if n in fast_names}
    decay, other, sigma, fast = [], [], [], []
    for p in model.parameters():
        if p.requires_grad:
            (sigma if id(p) in own else fast if id(p) in fast_ids else other if id(p) in no_decay or p.ndim <= 1
             else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    if sigma:
        groups.append({"params": sigma, "weight_decay": 0.0, "lr": sigma_lr})
    if fast:
        groups.append({"params": fast, "weight_decay": 0.0, "lr": fast_lr})
    return groups


def sigma_lr(optim: OptimConfig, model: nn.Module) -> float | None:
    """Peak learning rate of the σ store (``optim.lr × optim.sigma_lr_scale``, ``num_members`` meaning M), or None
    when it is the shared rate or the model has no σ store (it then stays in the common no-decay group)."""
    scale = optim.sigma_lr_scale
    scale = model.num_members if scale == "num_members" else scale
    return None if scale == 1 else optim.lr * scale


def fast_weight_lr(optim: OptimConfig) -> float | None:
    """Peak learning rate of BatchEnsemble's fast weights (``optim.lr × optim.fast_weight_lr_scale``), or None when
    it is the shared rate (the group layout of earlier runs, which therefore still resume)."""
    scale = optim.fast_weight_lr_scale
    return None if scale == 1 else optim.lr * scale


def build_optimizer(optim: OptimConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """``optim.name`` over ``groups`` (:func:`param_groups`), at the peak rate ``optim.lr``; a group's own ``lr``
    wins."""
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, nesterov=optim.nesterov)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas))


def warmup_cosine(schedule: ScheduleConfig, total: int) -> Callable[[int], float]:
    """The factor of the peak rate at each step, for ``LambdaLR``: linear warm-up over ``schedule.warmup_steps``, then
    constant or a cosine down to ``schedule.min_lr_ratio`` at step ``total``. Every group's rate scales by it, so
    the σ store and fast weights keep their ratio to the shared rate."""
    warm, floor = schedule.warmup_steps, schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if schedule.name == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
