"""The σ converter: walk any timm / torchvision / Hugging Face model and replace each normalization layer by an
M-member σ layer over one flat store (γ, member affines, running statistics), initialised from the source layer."""

from __future__ import annotations

import copy
import fnmatch
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sigmanens_dist.errors import UnsupportedError, UsageError
from sigmanens_dist.sigma.layers import (
    LayerSlot,
    SigmaNorm,
    SigmaStore,
    looks_like_norm,
    shared_by_default,
    sigma_class_for,
    supported_names,
)

__all__ = ["AFFINE_INITS", "ConversionSummary", "check_num_members", "convert_norms", "count_params"]


@dataclass
class ConversionSummary:
    """What a conversion did: which norm layers became σ layers, which stayed shared by all members (GRN by
    default, or norms not matched by ``layers=``), and the parameter count against the source model's."""

    converted: list[str]
    shared: list[str]
    source_params: int
    params: int = 0
    shared_types: dict[str, str] = field(default_factory=dict)  # name -> type of every shared norm

    @property
    def param_ratio(self) -> float:
        return self.params / max(self.source_params, 1)

    def __str__(self) -> str:
        shared = ", ".join(f"{n} ({self.shared_types.get(n, '?')})" for n in self.shared[:6])
        more = f" … (+{len(self.shared) - 6})" if len(self.shared) > 6 else ""
        return (f"{len(self.converted)} norm layers converted, {len(self.shared)} left shared"
                f"{': ' + shared + more if self.shared else ''}; parameters {self.params:,} = "
                f"{self.param_ratio:.4f}x the source's {self.source_params:,}")


AFFINE_INITS = ("divide", "plain")


def count_params(model: nn.Module) -> int:
    """Parameter count; lazy parameters not yet materialised (``nn.LazyLinear`` before its first call) count 0."""
    return sum(p.numel() for p in model.parameters() if not nn.parameter.is_lazy(p))


def check_num_members(num_members: int) -> int:
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
        raise UsageError(f"num_members must be an int ≥ 1, got {num_members!r}")
    return num_members


def convert_norms(model: nn.Module, num_members: int, *, gamma_init_mean: float = 0.0, gamma_init_std: float = 1.0,
                  affine_init: str = "divide", layers: Sequence[str] | None = None,
                  regularize: Sequence[str] | None = None, seed: int | None = 0, inplace: bool = False
                  ) -> tuple[nn.Module, SigmaStore, ConversionSummary]:
    """Replace every normalization layer of ``model`` by an M-member σ layer bound to one new flat store; return
    the backbone, the store and what was converted. The options are
    :func:`sigmanens_dist.methods.sigma.convert_to_sigma_ensemble`'s (documented there), which wraps the result as
    the ensemble."""
    num_members = check_num_members(num_members)
    if not gamma_init_std >= 0:
        raise UsageError(f"gamma_init_std must be ≥ 0, got {gamma_init_std!r}")
    if affine_init not in AFFINE_INITS:
        raise UsageError(f"affine_init must be one of {', '.join(AFFINE_INITS)}, got {affine_init!r}")
    if any(isinstance(m, SigmaNorm) for m in model.modules()):
        raise UsageError("model already contains σ layers: it was converted before")
    backbone = model if inplace else copy.deepcopy(model)
    source_params = count_params(model)
    targets, shared = _find_norms(backbone, layers)
    if not targets:
        raise UsageError(f"no normalization layer to convert in {type(model).__name__}; supported types: "
                         + ", ".join(supported_names()))
    names = [name for name, _ in targets]
    reg = set(_match(names, regularize, "regularize")) if regularize is not None else set(names)

    sigma_layers = [(name, sigma_class_for(src)(src, num_members), src) for name, src in targets]
    slots, num_columns, num_stats = _layout(sigma_layers, reg, num_members)
    store = SigmaStore(num_members, slots, num_columns, num_stats)
    ref = next((p for p in model.parameters() if p.is_floating_point()), store.flat)
    store.to(device=ref.device, dtype=ref.dtype)
    _initialise(store, sigma_layers, slots, gamma_init_mean, gamma_init_std, seed, affine_init == "divide")
    for (name, layer, _), slot in zip(sigma_layers, slots, strict=True):
        layer.bind(store, slot)
        parent, _, attr = name.rpartition(".")
        setattr(backbone.get_submodule(parent) if parent else backbone, attr, layer)
    summary = ConversionSummary(names, [n for n, _ in shared], source_params,
                                shared_types={n: type(m).__name__ for n, m in shared})
    return backbone, store, summary


# -- conversion helpers ----------------------------------------------------------------------------------------
def _find_norms(model: nn.Module, patterns: Sequence[str] | None
                ) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The norms to convert, and the norms left shared by every member (statistics-free norms such as ConvNeXt-V2's
    GlobalResponseNorm by default, plus anything ``patterns`` leaves out)."""
    found: list[tuple[str, nn.Module]] = []
    unsupported: list[tuple[str, nn.Module]] = []
    shared: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = prefix + child_name
            if shared_by_default(child):
                shared.append((name, child))
            elif sigma_class_for(child) is not None:
                found.append((name, child))
            elif looks_like_norm(child):
                unsupported.append((name, child))
            else:
                walk(child, name + ".")

    walk(model, "")
    if patterns is not None:
        keep = set(_match([n for n, _ in found + unsupported], patterns, "layers"))
        shared += [(n, m) for n, m in found + unsupported if n not in keep]
        found = [(n, m) for n, m in found if n in keep]
        unsupported = [(n, m) for n, m in unsupported if n in keep]
    if unsupported:
        raise UnsupportedError("unsupported normalization layer(s): "
                               + ", ".join(f"{n!r} ({type(m).__name__})" for n, m in unsupported)
                               + ". Supported types: " + ", ".join(supported_names()) + ". Pass layers=[patterns] to "
                               "convert only the others (unconverted norms stay shared by all members).")
    if any(isinstance(m, nn.SyncBatchNorm) for _, m in found):
        warnings.warn("SyncBatchNorm layers become σBatchNorm with per-rank statistics (each member normalises "
                      "over its own samples on each rank; statistics are not synchronised across ranks)",
                      stacklevel=3)
    return found, shared


def _match(names: list[str], patterns: Sequence[str], what: str) -> list[str]:
    if isinstance(patterns, str):
        raise UnsupportedError(f"{what} must be a list of name patterns, got the string {patterns!r}")
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise UsageError(f"{what} pattern {pat!r} matches no normalization layer; layers are: "
                             + ", ".join(names[:20]) + (" …" if len(names) > 20 else ""))
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _layout(layers: list[tuple[str, SigmaNorm, nn.Module]], reg: set[str], m: int
            ) -> tuple[list[LayerSlot], int, int]:
    """Columns: γ of regularized layers first (one contiguous ``(M, F)`` block), then other γ, then affines."""
    gamma_cols: dict[str, tuple[int, int]] = {}
    col = 0
    for want in (True, False):
        for name, layer, _ in layers:
            if (name in reg) == want:
                gamma_cols[name] = (col, col + layer.num_features)
                col += layer.num_features
    slots, stats = [], 0
    for name, layer, _ in layers:
        c = layer.num_features
        weight = (col, col + c)
        col += c
        bias = None
        if layer.has_bias:
            bias = (col, col + c)
            col += c
        stat = None
        if layer.keeps_running_stats():
            stat, stats = stats, stats + 2 * m * c
        slots.append(LayerSlot(name, layer.kind, c, gamma_cols[name], weight, bias, stat, name in reg,
                               joint=layer.joint_affine and bias is not None))
    return slots, col, stats


@torch.no_grad()
def _initialise(store: SigmaStore, layers: list[tuple[str, SigmaNorm, nn.Module]], slots: list[LayerSlot],
                mean: float, std: float, seed: int | None, divide: bool) -> None:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    gamma = torch.randn(store.num_members, store.num_gamma, generator=gen, dtype=torch.float64) * std + mean
    flat = torch.zeros(store.flat.shape, dtype=torch.float64)
    flat[:, : store.num_gamma] = gamma
    stats = torch.zeros(store.running_stats.shape, dtype=torch.float64)
    for (_, layer, src), slot in zip(layers, slots, strict=True):
        gate = torch.sigmoid(gamma[:, slot.gamma[0]: slot.gamma[1]]) if divide else torch.ones(1, dtype=torch.float64)
        c = layer.num_features
        w = getattr(src, "weight", None)
        w = torch.ones(c, dtype=torch.float64) if w is None else w.detach().double().reshape(c).cpu()
        flat[:, slot.weight[0]: slot.weight[1]] = w / gate  # divide: σ(γ_m)·w_m == w (function preserving)
        if slot.bias is not None:
            b = getattr(src, "bias", None)
            b = torch.zeros(c, dtype=torch.float64) if b is None else b.detach().double().reshape(c).cpu()
            flat[:, slot.bias[0]: slot.bias[1]] = b / gate
        if slot.stats is not None:
            n = store.num_members * c
            stats[slot.stats: slot.stats + n] = src.running_mean.detach().double().cpu().repeat(store.num_members)
            stats[slot.stats + n: slot.stats + 2 * n] = src.running_var.detach().double().cpu().repeat(
                store.num_members)
    store.flat.copy_(flat)
    store.running_stats.copy_(stats)
