"""BatchEnsemble (Wen, Tran & Ba, ICLR 2020): one shared weight ``W`` per layer and, per member m, rank-1 fast
weights ``r_m`` (input side) and ``s_m`` (output side) plus its own bias: ``y_m = ((x ⊙ r_m) W^T) ⊙ s_m + b_m``,
i.e. member m's weight is ``W ⊙ s_m r_m^T``.

Every ``nn.Linear`` and ``nn.Conv2d`` of the backbone (timm ResNets, ViTs: patch embedding, attention, MLP, head)
becomes a :class:`BatchEnsembleLayer`; other layers (norms, embeddings, position embeddings) stay shared, as in the
paper. Fast weights start at ``N(1, model.fast_weight_init_std)`` (0.5 by default: uncertainty-baselines'
``random_sign_init=-0.5`` and torch-uncertainty's ``BatchLinear``/``BatchConv2d``), get no weight decay and the rate
``optim.lr × optim.fast_weight_lr_scale``, and the batch is tiled M× so every member sees every sample (train and
eval). Member biases start from the source bias.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.methods.base import EnsembleMethod, Inputs, call_backbone, map_tensors

__all__ = ["BatchEnsemble", "BatchEnsembleLayer", "build", "convert_to_batch_ensemble"]

log = logging.getLogger(__name__)

CONVERTED = (nn.Linear, nn.Conv2d)


class BatchEnsembleLayer(nn.Module):
    """A Linear or Conv2d whose weight is shared and whose M members differ by rank-1 fast weights and a bias.

    ``base`` is the source layer itself (its weight is the shared ``W``; its bias moves into the per-member
    ``bias``). Inputs are member-major ``(M·B, …)``."""

    def __init__(self, base: nn.Linear | nn.Conv2d, num_members: int, r: torch.Tensor, s: torch.Tensor) -> None:
        super().__init__()
        self.num_members = num_members
        self.channels_last = isinstance(base, nn.Linear)
        fan_in, fan_out = (base.in_features, base.out_features) if self.channels_last else (base.in_channels,
                                                                                          base.out_channels)
        self.r = nn.Parameter(r.reshape(num_members, fan_in).to(base.weight))
        self.s = nn.Parameter(s.reshape(num_members, fan_out).to(base.weight))
        bias = base.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().reshape(1, fan_out).repeat(num_members, 1))
        base.bias = None
        self.base = base

    def _per_member(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``(M, C)`` broadcast against a member-major ``x`` viewed as ``(M, B, …)``."""
        m, ones = self.num_members, [1] * (x.ndim - 3)
        return t.view(m, 1, *ones, -1) if self.channels_last else t.view(m, 1, -1, *ones)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.num_members
        if x.shape[0] % m:  # an invariant of the forward pass: the ensemble feeds member-major batches (a bug if hit)
            raise ValueError(f"BatchEnsembleLayer: batch of {x.shape[0]} rows is not a multiple of num_members={m}")
        xv = x.reshape(m, x.shape[0] // m, *x.shape[1:])
        y = self.base((xv * self._per_member(self.r, xv)).reshape(x.shape))
        yv = y.reshape(m, y.shape[0] // m, *y.shape[1:])
        out = yv * self._per_member(self.s, yv)
        if self.bias is not None:
            out = out + self._per_member(self.bias, yv)
        return out.reshape(y.shape)

    def plain_member(self, index: int) -> nn.Module:
        """Member ``index`` as the source layer type, with ``W ⊙ s r^T`` and its bias folded in."""
        layer = copy.deepcopy(self.base)
        with torch.no_grad():
            w, r, s = self.base.weight, self.r[index], self.s[index]
            if self.channels_last:
                folded = w * s[:, None] * r[None, :]
            else:  # weight (out, in/groups, kh, kw): output o reads input channels of its group only
                g = self.base.groups
                r_w = r.view(g, 1, -1).expand(g, w.shape[0] // g, -1).reshape(w.shape[0], -1)
                folded = w * s[:, None, None, None] * r_w[:, :, None, None]
            layer.weight = nn.Parameter(folded.clone())
            layer.bias = None if self.bias is None else nn.Parameter(self.bias[index].clone())
        return layer

    def select(self, members: list[int]) -> BatchEnsembleLayer:
        """A copy with only ``members``' fast weights and biases (the shared weight copied)."""
        layer = copy.deepcopy(self)
        rows = torch.tensor(members, device=self.r.device)
        with torch.no_grad():
            layer.r = nn.Parameter(self.r[rows].clone())
            layer.s = nn.Parameter(self.s[rows].clone())
            layer.bias = None if self.bias is None else nn.Parameter(self.bias[rows].clone())
        layer.num_members = len(members)
        return layer

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}"


class BatchEnsemble(EnsembleMethod):
    """The backbone with its Linear/Conv2d layers replaced by :class:`BatchEnsembleLayer` s."""

    name = "batch"
    display = "BatchEnsemble"
    knobs = MappingProxyType({"model.fast_weight_init_std": "init std", "optim.fast_weight_lr_scale": "fast lr×"})
    pools_member_rows = True  # its norms are shared: they normalise every member's rows of a batch together

    def __init__(self, backbone: nn.Module, num_members: int) -> None:
        super().__init__()
        self.backbone = backbone
        self._num_members = num_members

    @property
    def num_members(self) -> int:
        return self._num_members

    def be_layers(self) -> list[tuple[str, BatchEnsembleLayer]]:
        return [(n, m) for n, m in self.backbone.named_modules() if isinstance(m, BatchEnsembleLayer)]

    def forward(self, x: Inputs, *, member_major: bool = False) -> torch.Tensor:
        m = self.num_members
        if not member_major:  # tile: every member sees the whole batch
            x = map_tensors(x, lambda t: t.unsqueeze(0).expand(m, *t.shape).reshape(-1, *t.shape[1:]))
        out = call_backbone(self.backbone, x)
        return out.view(m, out.shape[0] // m, *out.shape[1:])

    def member(self, index: int) -> nn.Module:
        """Member ``index`` as a plain model (fast weights folded into ordinary layers; shared norms copied, so in
        eval mode it reproduces the member's logits)."""
        self.check_index(index)
        memo: dict[int, Any] = {id(layer): layer.plain_member(index) for _, layer in self.be_layers()}
        return copy.deepcopy(self.backbone, memo)

    def sub_ensemble(self, members: list[int]) -> BatchEnsemble:
        """The BatchEnsemble of ``members`` only (their fast weights and biases; shared layers copied)."""
        for i in members:
            self.check_index(i)
        memo: dict[int, Any] = {id(layer): layer.select(list(members)) for _, layer in self.be_layers()}
        return BatchEnsemble(copy.deepcopy(self.backbone, memo), len(members))

    def no_weight_decay(self) -> set[str]:
        """Fast weights and member biases: decaying ``r``, ``s`` would pull every member towards zero, not towards
        the shared weight (uncertainty-baselines and torch-uncertainty exempt them too)."""
        return {f"backbone.{name}.{p}" for name, layer in self.be_layers()
                for p in ("r", "s", "bias") if getattr(layer, p) is not None}

    def fast_weights(self) -> set[str]:
        """``r`` and ``s``: the authors scale their rate (edward2's ``fast_weight_lr_multiplier``), not the biases'."""
        return {f"backbone.{name}.{p}" for name, _ in self.be_layers() for p in ("r", "s")}


def convert_to_batch_ensemble(model: nn.Module, num_members: int, init_std: float = 0.5,
                              seed: int | None = 0) -> BatchEnsemble:
    """Replace every ``nn.Linear``/``nn.Conv2d`` of ``model`` (in place) by a BatchEnsemble layer."""
    if num_members < 1:
        raise UsageError(f"num_members must be ≥ 1, got {num_members}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    targets, skipped = [], []
    for name, module in model.named_modules():
        if type(module) in CONVERTED:
            targets.append((name, module))
        elif isinstance(module, (*CONVERTED, nn.modules.conv._ConvNd)):
            skipped.append(f"{name} ({type(module).__name__})")
    if not targets:
        raise UsageError(f"no nn.Linear or nn.Conv2d layer to convert in {type(model).__name__}")
    if skipped:
        log.warning("BatchEnsemble leaves these weight layers shared (not plain Linear/Conv2d): %s",
                    ", ".join(skipped))
    for name, module in targets:
        fan_in, fan_out = ((module.in_features, module.out_features) if isinstance(module, nn.Linear)
                           else (module.in_channels, module.out_channels))
        r = torch.randn(num_members, fan_in, generator=gen) * init_std + 1
        s = torch.randn(num_members, fan_out, generator=gen) * init_std + 1
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                BatchEnsembleLayer(module, num_members, r, s))
    return BatchEnsemble(model, num_members)


def build(cfg: Config, make_backbone: Callable[[], nn.Module]) -> BatchEnsemble:
    return convert_to_batch_ensemble(make_backbone(), cfg.model.num_members, cfg.model.fast_weight_init_std,
                                     seed=cfg.seed)
