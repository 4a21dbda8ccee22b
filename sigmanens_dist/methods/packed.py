"""Packed-Ensembles (Laurent et al., ICLR 2023): M members of width ``α·C/M`` packed into one network of width
``α·C`` with grouped convolutions, so one forward pass runs all members.

A timm ResNet (``timm.models.resnet.ResNet``: resnet18/34/50, resnet10t, wide_resnet, resnext…) is converted in
place, layer by layer, following torch-uncertainty's ``packed_resnet``:

* the first convolution of the network reads the image with one group (``first``: every member sees the input)
  and writes ``α·C`` channels;
* every other convolution ``(C_in, C_out, groups g)`` becomes ``(α·C_in, α·C_out)`` with ``M·γ·g`` groups
  (``γ``: sub-groups per member), except the stem and the first convolution of each block, which use ``γ = 1``
  as the paper's code does; like torch-uncertainty, ``γ`` is lowered for a layer whose groups would hold fewer
  than 64 input channels;
* every ``BatchNorm2d(C)`` becomes ``BatchNorm2d(α·C)`` (each channel belongs to one member);
* the classifier ``Linear(F, K)`` becomes a grouped linear ``α·F → M·K`` with M groups.

A convolution holds ``α²·C_in·C_out·k² / (M·γ·g)`` weights, so ``α = M, γ = 1`` is a Deep Ensemble's M× and
``α = 2, M = 4`` about the single model's count. Members have no plain model of the source architecture. Packed
layers start from PyTorch's default initialisation, as torch-uncertainty's do (packing changes every shape, so
pretrained weights cannot be kept).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import MappingProxyType

import torch
from timm.models.resnet import ResNet
from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.errors import UnsupportedError, UsageError
from sigmanens_dist.methods.base import EnsembleMethod, Inputs, call_backbone

__all__ = ["PackedEnsemble", "PackedFirstConv", "PackedLinear", "build", "convert_to_packed_ensemble",
           "packed_groups"]

MIN_CHANNELS_PER_GROUP = 64  # torch-uncertainty's PackedConv2d default
_BLOCK_FIRST_CONV = re.compile(r"^layer\d+\.\d+\.conv1$")


def packed_groups(in_channels: int, groups: int, num_members: int, gamma: int) -> int:
    """Groups of a packed convolution: ``M·γ·g``, with γ lowered while a group would get < 64 input channels."""
    while (in_channels % (gamma * groups * num_members) or in_channels // (gamma * groups * num_members)
           < MIN_CHANNELS_PER_GROUP) and gamma > 1:
        gamma -= 1
    return gamma * groups * num_members


class PackedFirstConv(nn.Module):
    """The network's first convolution (one group: all members read the image). With member-major input
    ``(M·B, …)`` (members see different samples) it convolves every sample and keeps, for member m, only its own
    output channels on its own samples, returning the packed layout ``(B, α·C, …)``."""

    def __init__(self, conv: nn.Conv2d, num_members: int) -> None:
        super().__init__()
        self.conv = conv
        self.num_members = num_members
        self.member_major = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if not self.member_major:
            return y
        m = self.num_members
        b, c = y.shape[0] // m, y.shape[1] // m
        y = y.reshape(m, b, m, c, *y.shape[2:]).diagonal(dim1=0, dim2=2)  # (B, c, H, W, M): member m's own rows
        return y.movedim(-1, 1).reshape(b, m * c, *y.shape[2:-1])


class PackedLinear(nn.Module):
    """``in_features → M·out`` with M groups (member m reads its ``in/M`` features and writes its ``out`` logits)."""

    def __init__(self, in_features: int, out_features: int, num_members: int, bias: bool) -> None:
        super().__init__()
        if in_features % num_members:
            raise UsageError(f"PackedLinear: {in_features} input features do not split into {num_members} members")
        self.num_members = num_members
        self.conv = nn.Conv1d(in_features, out_features * num_members, 1, groups=num_members, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(-1)).squeeze(-1)


class PackedEnsemble(EnsembleMethod):
    """A packed ResNet: logits ``(B, M·K)`` regrouped to ``(M, B, K)``."""

    name = "packed"
    display = "Packed-Ensembles"
    knobs = MappingProxyType({"model.packed_alpha": "α", "model.packed_gamma": "γ"})

    def __init__(self, backbone: nn.Module, num_members: int, alpha: float, gamma: int) -> None:
        super().__init__()
        self.backbone = backbone
        self._num_members = num_members
        self.alpha, self.gamma = alpha, gamma
        # In a tuple: an attribute holding the module itself would register it a second time (state-dict keys).
        self._first = (next(m for m in backbone.modules() if isinstance(m, PackedFirstConv)),)

    @property
    def num_members(self) -> int:
        return self._num_members

    def forward(self, x: Inputs, *, member_major: bool = False) -> torch.Tensor:
        first = self._first[0]
        first.member_major = member_major
        try:
            out = call_backbone(self.backbone, x)
        finally:
            first.member_major = False
        return out.view(out.shape[0], self.num_members, -1).transpose(0, 1)


def convert_to_packed_ensemble(model: nn.Module, num_members: int, alpha: float = 2.0, gamma: int = 1
                               ) -> PackedEnsemble:
    """Turn a timm ResNet into a Packed-Ensemble in place (fresh weights: packing changes every shape)."""
    if not isinstance(model, ResNet):
        raise UnsupportedError(f"Packed-Ensembles supports the timm ResNet family (timm.models.resnet.ResNet: "
                               f"resnet18, resnet10t, resnet50, wide_resnet50_2, …); got {type(model).__name__}")
    if num_members < 1 or gamma < 1 or not alpha > 0:
        raise UsageError(f"need num_members ≥ 1, gamma ≥ 1 and alpha > 0; got {num_members}, {gamma}, {alpha}")

    def wide(c: int, name: str) -> int:
        if abs(c * alpha - round(c * alpha)) > 1e-9:
            raise UsageError(f"packed_alpha={alpha} × {c} channels of {name!r} is not an integer")
        return round(c * alpha)

    first_done = False
    for name, module in list(model.named_modules()):
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if type(module) is nn.Conv2d:
            out = wide(module.out_channels, name)
            if not first_done:
                new: nn.Module = PackedFirstConv(_conv_like(module, module.in_channels, out, 1), num_members)
                first_done = True
            else:
                in_ = wide(module.in_channels, name)
                in_block = name.startswith("layer")
                g = packed_groups(in_, module.groups, num_members,
                                  gamma if in_block and not _BLOCK_FIRST_CONV.match(name) else 1)
                if in_ % g or out % g:
                    raise UsageError(f"{name!r}: {in_} → {out} channels (α={alpha}) do not split into {g} groups "
                                     f"(M={num_members}); choose α and M so that α·C is a multiple of M·γ")
                new = _conv_like(module, in_, out, g)
            setattr(owner, attr, new)
        elif type(module) is nn.BatchNorm2d:
            setattr(owner, attr, nn.BatchNorm2d(wide(module.num_features, name), module.eps, module.momentum,
                                                module.affine, module.track_running_stats))
        elif type(module) is nn.Linear and name == model.default_cfg.get("classifier", "fc"):
            setattr(owner, attr, PackedLinear(wide(module.in_features, name), module.out_features, num_members,
                                              module.bias is not None))
        elif isinstance(module, nn.Conv2d | nn.Linear | nn.modules.batchnorm._BatchNorm):
            raise UnsupportedError(f"Packed-Ensembles cannot convert {name!r} ({type(module).__name__}); supported: "
                                   "nn.Conv2d, nn.BatchNorm2d and the nn.Linear classifier of a timm ResNet")
    model.num_features = wide(model.num_features, "num_features")
    return PackedEnsemble(model, num_members, alpha, gamma)


def _conv_like(conv: nn.Conv2d, in_channels: int, out_channels: int, groups: int) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation, groups,
                     conv.bias is not None, conv.padding_mode)


def build(cfg: Config, make_backbone: Callable[[], nn.Module]) -> PackedEnsemble:
    m = cfg.model
    return convert_to_packed_ensemble(make_backbone(), m.num_members, m.packed_alpha, m.packed_gamma)


