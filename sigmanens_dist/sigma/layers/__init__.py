"""Member-vectorised σ normalization layers and the flat parameter store they share."""

from sigmanens_dist.sigma.layers.batchnorm import SigmaBatchNorm
from sigmanens_dist.sigma.layers.groupnorm import SigmaGroupNorm
from sigmanens_dist.sigma.layers.layernorm import SigmaLayerNorm, SigmaLayerNorm2d
from sigmanens_dist.sigma.layers.registry import (
    SHARED_BY_DEFAULT,
    SUPPORTED,
    looks_like_norm,
    shared_by_default,
    sigma_class_for,
    supported_names,
)
from sigmanens_dist.sigma.layers.rmsnorm import SigmaRmsNorm, SigmaRmsNorm2d
from sigmanens_dist.sigma.layers.sigma_norm import SigmaNorm
from sigmanens_dist.sigma.layers.store import LayerSlot, PassPlan, SigmaStore

__all__ = [
    "SHARED_BY_DEFAULT",
    "SUPPORTED",
    "LayerSlot",
    "PassPlan",
    "SigmaBatchNorm",
    "SigmaGroupNorm",
    "SigmaLayerNorm",
    "SigmaLayerNorm2d",
    "SigmaNorm",
    "SigmaRmsNorm",
    "SigmaRmsNorm2d",
    "SigmaStore",
    "looks_like_norm",
    "shared_by_default",
    "sigma_class_for",
    "supported_names",
]
