"""FiLM-style ablation of σN-Ens: per-member norm layers (own statistics, own affine, as in FiLM's feature-wise
affine modulation) with NO σ gate and NO diversity regularizer. It isolates what σ(γ) and ``L_div`` add.

It reuses the σ layers: the store is switched to ungated (its ``PassPlan(gated=False)``), so layers apply
``w_m ⊙ norm_m(x) + b_m``; γ columns stay in the flat parameter but are unused (zero gradient). Members converted
from one model and fed the same batches would never diverge, so member scales start at the source weight times
``N(1, model.film_init_std)`` (biases at the source bias): the symmetry breaker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import MappingProxyType

import torch
from torch import nn

from sigmanens_dist.config import Config, RegConfig
from sigmanens_dist.errors import UsageError
from sigmanens_dist.methods.sigma import SigmaEnsemble, convert_to_sigma_ensemble

__all__ = ["FiLMEnsemble", "build", "convert_to_film_ensemble"]


class FiLMEnsemble(SigmaEnsemble):
    """A :class:`SigmaEnsemble` without gate or regularizer."""

    name = "film"
    display = "FiLM ablation"
    regularized = False  # σN-Ens without σ gate or L_div
    # default_member_batches is SigmaEnsemble's (independent): the ablation differs from σN-Ens in gate and L_div only
    knobs = MappingProxyType({"model.film_init_std": "init std"})

    def aux_loss(self, reg: RegConfig) -> torch.Tensor:
        return torch.zeros((), device=self.sigma.flat.device)


def convert_to_film_ensemble(model: nn.Module, num_members: int, init_std: float = 0.1,
                             layers: list[str] | None = None, seed: int | None = 0) -> FiLMEnsemble:
    """Per-member norms of ``model`` (in place) with member affines ``w·N(1, init_std)``, ``b``."""
    if not init_std >= 0:
        raise UsageError(f"init_std must be ≥ 0, got {init_std!r}")
    ens = convert_to_sigma_ensemble(model, num_members, gamma_init_std=0.0, layers=layers, seed=seed, inplace=True)
    store = ens.sigma
    gen = torch.Generator().manual_seed(seed + 1) if seed is not None else None
    with torch.no_grad():
        for slot in store.slots:
            gate = torch.sigmoid(store.columns(slot.gamma))  # conversion divided the affine by σ(γ): undo it
            w = store.columns(slot.weight)
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float64).to(w) * init_std + 1
            w.copy_(w * gate * noise)
            if slot.bias is not None:
                b = store.columns(slot.bias)
                b.copy_(b * gate)
    store.plan = dataclasses.replace(store.plan, gated=False)
    film = FiLMEnsemble(ens.backbone, store, ens.summary)
    return film


def build(cfg: Config, make_backbone: Callable[[], nn.Module]) -> FiLMEnsemble:
    m = cfg.model
    return convert_to_film_ensemble(make_backbone(), m.num_members, m.film_init_std, layers=m.layers, seed=cfg.seed)
