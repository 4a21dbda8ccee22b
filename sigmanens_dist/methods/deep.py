"""Deep Ensembles (Lakshminarayanan, Pritzel & Blundell, NeurIPS 2017): M independently initialised copies of the
backbone, each trained as its own single model.

Member k is initialised exactly as a single run with ``seed = cfg.seed + k`` would be (``torch.manual_seed`` then
the backbone constructor), and with ``model.member_batches=independent`` (the default here) it also reads that run's
data order, so a Deep Ensemble of M is M single runs in one job: the member losses are summed (each member's
gradient is its own loss's), and SGD/AdamW with coupled weight decay act per parameter. What still couples members:
``train.clip_grad`` (one global norm) and dropout masks (one RNG stream). The members run in a loop; M× parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.methods.base import EnsembleMethod, Inputs, call_backbone, member_chunks

__all__ = ["DeepEnsemble", "build"]


class DeepEnsemble(EnsembleMethod):
    """``members[k]`` is a complete backbone; nothing is shared."""

    name = "deep"
    display = "Deep Ensemble"
    loss_reduction = "sum"
    default_member_batches = "independent"

    def __init__(self, members: list[nn.Module]) -> None:
        super().__init__()
        if not members:
            raise UsageError("a Deep Ensemble needs at least one member")
        self.members = nn.ModuleList(members)

    @property
    def num_members(self) -> int:
        return len(self.members)

    def forward(self, x: Inputs, *, member_major: bool = False) -> torch.Tensor:
        inputs = member_chunks(x, self.num_members) if member_major else [x] * self.num_members
        return torch.stack([call_backbone(m, xi) for m, xi in zip(self.members, inputs, strict=True)])

    def member(self, index: int) -> nn.Module:
        self.check_index(index)
        return copy.deepcopy(self.members[index])

    def sub_ensemble(self, members: list[int]) -> DeepEnsemble:
        """The ensemble of ``members`` only (copies): what `sigmanens eval` scores as a k-member sub-ensemble."""
        for i in members:
            self.check_index(i)
        return DeepEnsemble([copy.deepcopy(self.members[i]) for i in members])


def build(cfg: Config, make_backbone: Callable[[], nn.Module]) -> DeepEnsemble:
    members = []
    for k in range(cfg.model.num_members):
        torch.manual_seed(cfg.seed + k)  # member k starts as the single run with seed cfg.seed + k
        members.append(make_backbone())
    return DeepEnsemble(members)
