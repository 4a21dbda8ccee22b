"""The plain backbone as an ensemble of one member: the single-model baseline every method is compared with."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.methods.base import EnsembleMethod, Inputs, call_backbone

__all__ = ["SingleModel", "build"]


class SingleModel(EnsembleMethod):
    """One network; ``model.num_members`` does not apply."""

    name = "single"
    display = "single model"
    member_axis = False

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    @property
    def num_members(self) -> int:
        return 1

    def forward(self, x: Inputs, *, member_major: bool = False) -> torch.Tensor:
        return call_backbone(self.backbone, x).unsqueeze(0)  # with one member both layouts are the same batch

    def member(self, index: int) -> nn.Module:
        self.check_index(index)
        return copy.deepcopy(self.backbone)


def build(cfg: Config, make_backbone: Callable[[], nn.Module]) -> SingleModel:
    return SingleModel(make_backbone())
