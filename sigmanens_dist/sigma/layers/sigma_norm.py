"""Base of the member-vectorised σ norms: ``σNorm_m(x) = sigmoid(γ_m) ⊙ norm_m(x)`` for M members in one pass.

The input holds M·B rows in one of two layouts: member-major (rows ``m·B … (m+1)·B − 1`` belong to member m), what
a layer called alone takes, or interleaved (row ``b·M + m``), what the ensemble runs its backbone on (the store says
which, :attr:`PassPlan.interleaved`). Interleaved, a contiguous ``(B·M, C, …)`` activation is the pure view
``(B, M·C, …)``: a native norm over M·C channels is then every member's norm at once. Subclasses normalise; this
base applies member m's affine with ``sigmoid(γ_m)`` folded into it, so the σ gate costs no extra pass over the
activations: ``σ(γ)·(w·x̂ + b) = (σ(γ)w)·x̂ + σ(γ)b``.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
from torch import nn

from sigmanens_dist.sigma.layers.store import LayerSlot, SigmaStore

__all__ = ["SigmaNorm", "fresh_view"]


class SigmaNorm(nn.Module):
    """Common state of every σ norm: its slot in the shared :class:`SigmaStore`, and timm's optional act/drop."""

    kind: str = ""
    # weight and bias as one (2, M·C) tensor in an ensemble pass (σLayerNorm spreads both over the token positions
    # with one copy, see SigmaLayerNorm.norm_affine)
    joint_affine: ClassVar[bool] = False
    channels_last: bool = True  # affine over the last dim (LayerNorm style) or over dim 1 (BatchNorm style)
    has_bias: bool = True  # RMS norms scale only

    def __init__(self, source: nn.Module, num_members: int, num_features: int) -> None:
        super().__init__()
        self.num_members = num_members
        self.num_features = num_features
        self.eps = float(getattr(source, "eps", 1e-5) or 0.0)
        self.fp32 = type(source).__name__.endswith("Fp32")
        self.param_shape = tuple(getattr(source, "normalized_shape", None) or (num_features,))
        # timm's *Act layers apply drop then act after the norm; keep the very same modules.
        self.drop = source.drop if isinstance(getattr(source, "drop", None), nn.Module) else None
        self.act = source.act if isinstance(getattr(source, "act", None), nn.Module) else None
        # A weightless copy of the source layer (meta device), the template to rebuild a plain member layer from.
        self._template = (copy.deepcopy(source).to("meta"),)
        self._store: SigmaStore | None = None
        self._slot: LayerSlot | None = None

    # -- binding to the store ------------------------------------------------------------------------------
    def bind(self, store: SigmaStore, slot: LayerSlot) -> None:
        """Attach to the store (not registered as a child: the store has a single owner, the ensemble)."""
        object.__setattr__(self, "_store", store)
        self._slot = slot

    @property
    def store(self) -> SigmaStore:
        if self._store is None:  # an invariant: convert_to_sigma_ensemble binds every σ layer it makes
            raise RuntimeError(f"{type(self).__name__} is not bound to a SigmaStore; build it with "
                               "convert_to_sigma_ensemble")
        return self._store

    @property
    def gamma(self) -> torch.Tensor:
        """``(M, C)`` importance logits (a view into the flat parameter)."""
        return self.store.columns(self._slot.gamma)

    @property
    def weight(self) -> torch.Tensor:
        return self.store.columns(self._slot.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self._slot.bias is None else self.store.columns(self._slot.bias)

    def flat_affine(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Member affine with the σ gate folded in: ``(σ(γ)·w, σ(γ)·b)`` (``(w, b)`` when the store is ungated),
        each a contiguous ``(M·C,)`` vector, entry ``m·C + c``; within an ensemble's forward pass, the store's
        once-per-pass piece."""
        cached = self.store.pass_affine(self._slot.name)
        if cached is not None:
            return cached if len(cached) == 2 else tuple(cached[0].unbind(0))
        weight, bias = self.weight, self.bias
        if self.store.plan.gated:
            gate = torch.sigmoid(self.gamma)
            weight, bias = gate * weight, None if bias is None else gate * bias
        return weight.reshape(-1), None if bias is None else bias.reshape(-1)

    def gated_affine(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`flat_affine` as ``(M, C)`` views, member m's row m."""
        scale, shift = self.flat_affine()
        m = self.num_members
        return scale.view(m, -1), None if shift is None else shift.view(m, -1)

    def affine(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`flat_affine` in the activations' dtype."""
        scale, shift = self.flat_affine()
        return scale.to(dtype), None if shift is None else shift.to(dtype)

    def keeps_running_stats(self) -> bool:
        """Whether the layer keeps per-member running statistics in the store's stats buffer (σBatchNorm's)."""
        return False

    # -- forward helpers -----------------------------------------------------------------------------------
    def check_batch(self, x: torch.Tensor) -> int:
        """Per-member batch size B of the input, or a clear error."""
        # an invariant of the forward pass: the ensemble feeds member-major batches (a bug if hit)
        if x.ndim < 2 or x.shape[0] % self.num_members:
            raise ValueError(f"{type(self).__name__}: input batch dimension {tuple(x.shape)[:1]} is not a multiple "
                             f"of num_members={self.num_members}; σ layers take member-major batches (M·B, …)")
        return x.shape[0] // self.num_members

    def member_affine(self, y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
        """Apply member m's scale/shift (``(M·C,)``, see :meth:`flat_affine`) to its rows of the normalised ``y``,
        in either row layout, in one broadcast op."""
        m = self.num_members
        interleaved = self.store.plan.interleaved
        rows, members = ((y.shape[0] // m, m), (1, m)) if interleaved else ((m, y.shape[0] // m), (m, 1))
        if self.channels_last:  # the affine covers the trailing param_shape dims
            shape = (*members, *[1] * (y.ndim - 1 - len(self.param_shape)), *self.param_shape)
        else:  # the affine covers dim 1
            shape = (*members, self.num_features, *[1] * (y.ndim - 2))
        out = y.view(*rows, *y.shape[1:]) * scale.view(shape)
        if shift is not None:  # mul then add: addcmul's backward would add two multiplies by its scalar `value`
            out = out + shift.view(shape)
        return fresh_view(out, y.shape)

    def post(self, y: torch.Tensor) -> torch.Tensor:
        if self.drop is not None:
            y = self.drop(y)
        if self.act is not None:
            y = self.act(y)
        return y

    # -- export --------------------------------------------------------------------------------------------
    def plain_member(self, member: int) -> nn.Module:
        """Member ``member`` as an ordinary layer of the source type, with σ(γ) folded into its affine."""
        layer = copy.deepcopy(self._template[0]).to_empty(device=self.weight.device)
        layer.train(self.training)  # the template kept the source's mode at conversion time
        with torch.no_grad():
            scale, shift = self.gated_affine()
            self.fill_plain(layer, member, scale[member], None if shift is None else shift[member])
        if self.drop is not None:
            layer.drop = copy.deepcopy(self.drop)
        if self.act is not None:
            layer.act = copy.deepcopy(self.act)
        return layer

    def fill_plain(self, layer: nn.Module, member: int, scale: torch.Tensor, shift: torch.Tensor | None) -> None:
        """Write member ``member``'s state into ``layer`` (a fresh copy of the source type)."""
        # Always give the plain layer an affine: even a source without one gets σ(γ_m) and member m's shift.
        layer.weight = nn.Parameter(scale.detach().clone().reshape(self.param_shape))
        if shift is not None:
            layer.bias = nn.Parameter(shift.detach().clone().reshape(self.param_shape))
        for flag in ("affine", "elementwise_affine"):
            if hasattr(layer, flag):
                setattr(layer, flag, True)

    def extra_repr(self) -> str:
        return f"{self.num_features}, num_members={self.num_members}, eps={self.eps}"


def fresh_view(t: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """``t.view(shape)`` that autograd treats as a new tensor, not as a view of ``t``. Returned from a σ layer, a plain
    view makes a following in-place op (``ReLU(inplace=True)``, timm's ``*Act`` layers) rewrite the backward of
    ``t``'s producer as CopySlices: three extra full-size copies per layer. Safe here because ``t`` is an output that
    no backward saves (batch/group/layer norm and the affine's mul/addcmul save their inputs, not their outputs)."""
    return torch.ops.aten._unsafe_view(t, shape)
