"""σN-Ens (the project's method): every norm layer becomes M per-member σ layers over one shared backbone, trained
with ``reg.lam · L_div(reg.tau)``. The ensemble class itself is :class:`sigmanens_dist.sigma.convert.SigmaEnsemble`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from sigmanens_dist.sigma.convert import SigmaEnsemble, convert_to_sigma_ensemble

__all__ = ["SigmaEnsemble", "build"]


def build(cfg: Any, make_backbone: Callable[[], nn.Module]) -> SigmaEnsemble:
    m = cfg.model
    return convert_to_sigma_ensemble(make_backbone(), m.num_members, gamma_init_mean=m.gamma_init_mean,
                                     gamma_init_std=m.gamma_init_std, affine_init=m.affine_init, layers=m.layers,
                                     regularize=cfg.reg.regularize,
                                     seed=cfg.seed, inplace=True)
