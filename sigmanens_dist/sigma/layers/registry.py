"""Which source normalization types map to which σ layer, and how an unsupported norm is recognised."""

from __future__ import annotations

import re

from timm.layers import grn as timm_grn
from timm.layers import norm as timm_norm
from timm.layers import norm_act as timm_norm_act
from torch import nn

from sigmanens_dist.sigma.layers.batchnorm import SigmaBatchNorm
from sigmanens_dist.sigma.layers.groupnorm import SigmaGroupNorm
from sigmanens_dist.sigma.layers.layernorm import SigmaLayerNorm, SigmaLayerNorm2d
from sigmanens_dist.sigma.layers.rmsnorm import SigmaRmsNorm, SigmaRmsNorm2d
from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm

__all__ = ["SHARED_BY_DEFAULT", "SUPPORTED", "looks_like_norm", "shared_by_default", "sigma_class_for",
           "supported_names"]

# Exact source type -> σ layer. Subclasses come before their bases (LayerNorm2d before LayerNorm), as in timm's
# converters; a subclass not listed here is only accepted when it keeps its base's forward (same semantics).
SUPPORTED: dict[type[nn.Module], type[SigmaNorm]] = {
    timm_norm_act.BatchNormAct2d: SigmaBatchNorm,
    timm_norm_act.SyncBatchNormAct: SigmaBatchNorm,
    nn.SyncBatchNorm: SigmaBatchNorm,
    nn.BatchNorm1d: SigmaBatchNorm,
    nn.BatchNorm2d: SigmaBatchNorm,
    nn.BatchNorm3d: SigmaBatchNorm,
    timm_norm.LayerNorm2d: SigmaLayerNorm2d,
    timm_norm.LayerNorm2dFp32: SigmaLayerNorm2d,
    timm_norm.LayerNormExp2d: SigmaLayerNorm2d,
    timm_norm_act.LayerNormAct2d: SigmaLayerNorm2d,
    timm_norm_act.LayerNormAct2dFp32: SigmaLayerNorm2d,
    timm_norm.LayerNorm: SigmaLayerNorm,
    timm_norm.LayerNormFp32: SigmaLayerNorm,
    timm_norm_act.LayerNormAct: SigmaLayerNorm,
    timm_norm_act.LayerNormActFp32: SigmaLayerNorm,
    nn.LayerNorm: SigmaLayerNorm,
    timm_norm.GroupNorm: SigmaGroupNorm,
    timm_norm.GroupNorm1: SigmaGroupNorm,
    timm_norm_act.GroupNormAct: SigmaGroupNorm,
    timm_norm_act.GroupNorm1Act: SigmaGroupNorm,
    nn.GroupNorm: SigmaGroupNorm,
    timm_norm.RmsNorm2d: SigmaRmsNorm2d,
    timm_norm.RmsNorm2dFp32: SigmaRmsNorm2d,
    timm_norm_act.RmsNormAct2d: SigmaRmsNorm2d,
    timm_norm_act.RmsNormAct2dFp32: SigmaRmsNorm2d,
    timm_norm.RmsNorm: SigmaRmsNorm,
    timm_norm.RmsNormFp32: SigmaRmsNorm,
    timm_norm_act.RmsNormAct: SigmaRmsNorm,
    timm_norm_act.RmsNormActFp32: SigmaRmsNorm,
    nn.RMSNorm: SigmaRmsNorm,
}

# Norms that keep no statistics and are left shared by every member unless asked otherwise: ConvNeXt-V2's
# GlobalResponseNorm (a per-channel response normalisation with a residual, not a standardisation).
SHARED_BY_DEFAULT: tuple[type[nn.Module], ...] = (timm_grn.GlobalResponseNorm,)

_NORM_NAME = re.compile(r"(Norm(Act)?(\dd)?(Fp32)?|EvoNorm\w*|FilterResponseNorm\w*)$")
_NORM_BASES = (nn.modules.batchnorm._NormBase, nn.LocalResponseNorm, nn.CrossMapLRN2d)


def supported_names() -> list[str]:
    """Public spellings of the supported types (``torch.nn.BatchNorm2d``, ``timm.layers.LayerNorm2d``…)."""
    return sorted(f"{'torch.nn' if t.__module__.startswith('torch.') else 'timm.layers'}.{t.__qualname__}"
                  for t in SUPPORTED)


def sigma_class_for(module: nn.Module) -> type[SigmaNorm] | None:
    """The σ class that replaces ``module``, or None when it is not a supported norm."""
    cls = type(module)
    if cls in SUPPORTED:
        return SUPPORTED[cls]
    for base, sigma in SUPPORTED.items():
        if isinstance(module, base) and cls.forward is base.forward:
            return sigma
    return None


def looks_like_norm(module: nn.Module) -> bool:
    """A normalization layer we do not know how to convert (InstanceNorm, FrozenBatchNorm, EvoNorm, a custom
    ``…RMSNorm``): a norm base class, or a norm-like class name on a leaf module (wrappers such as ``PreNorm`` have
    children and are walked into instead)."""
    if isinstance(module, _NORM_BASES):
        return True
    leaf = all(name in ("act", "drop") for name, _ in module.named_children())
    return leaf and bool(_NORM_NAME.search(type(module).__name__))


def shared_by_default(module: nn.Module) -> bool:
    """A norm the conversion leaves shared by all members (see :data:`SHARED_BY_DEFAULT`)."""
    return isinstance(module, SHARED_BY_DEFAULT)
