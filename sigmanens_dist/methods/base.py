"""The one interface every ensemble method answers, so the trainer, the strategies and ``eval`` never ask which
method they hold.

A method is an ``nn.Module`` that maps a batch to member logits ``(M, B, K)``. Two input layouts exist:

* shared (``forward(x)``): a batch ``(B, …)`` that every member sees;
* member-major (``forward(x, member_major=True)`` or ``forward_members(x)``): ``(M·B, …)`` with rows
  ``m·B … (m+1)·B − 1`` for member m, so members can see different samples (``model.member_batches=independent``).

``member_major`` is a keyword of ``forward`` (not only a separate method) because DDP only hooks ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from sigmanens_dist.config import RegConfig
from sigmanens_dist.errors import UnsupportedError, UsageError

__all__ = ["EnsembleMethod", "Inputs", "call_backbone", "logits_of", "map_tensors", "member_chunks"]

Inputs = torch.Tensor | Mapping[str, Any]


class EnsembleMethod(nn.Module):
    """Base of every method. Subclasses set ``name`` and implement ``num_members``, ``forward`` and
    ``forward_members``; the rest has defaults that fit a method without an auxiliary loss or member export."""

    name: ClassVar[str] = ""
    # How member task losses combine: "mean" (one shared model trained on M heads) or "sum" (independent members:
    # each must train exactly as a single run would, which a mean over members would scale down to lr/M).
    loss_reduction: ClassVar[Literal["mean", "sum"]] = "mean"
    # model.member_batches when the config leaves it unset.
    default_member_batches: ClassVar[Literal["shared", "independent"]] = "shared"
    # What a study grid and `sigmanens compare` need to know (experiments/): whether M is one of the method's axes (a
    # single model has none), whether τ and λ apply (the σ regularizer's L_div), and the method's own config keys
    # (dotted key → short name): runs that set one away from its default are a variant of the method, which compare
    # keeps apart (Packed-Ensembles at α = 2 and α = 3 are two rows, not one).
    member_axis: ClassVar[bool] = True
    regularized: ClassVar[bool] = False
    knobs: ClassVar[Mapping[str, str]] = MappingProxyType({})
    display: ClassVar[str] = ""  # the name people know it by (README, the terminal summaries of compare and eval)
    # Whether a norm layer's statistics pool the M members' rows of one image (BatchEnsemble's shared norms): then
    # one image's prediction-time statistics are not those of its single row (evaluation/norm_stats.py, per_sample).
    pools_member_rows: ClassVar[bool] = False

    @property
    def num_members(self) -> int:
        raise NotImplementedError

    def forward(self, x: Inputs, *, member_major: bool = False) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_members(self, x: Inputs) -> torch.Tensor:
        """Member logits ``(M, B, K)`` for a member-major batch ``(M·B, …)``."""
        return self(x, member_major=True)

    @torch.no_grad()
    def predict(self, x: Inputs) -> torch.Tensor:
        """Ensemble predictive distribution ``(B, K)``: the mean of the member softmaxes."""
        return self(x).float().softmax(dim=-1).mean(dim=0)

    def aux_loss(self, reg: RegConfig) -> torch.Tensor:
        """What the method adds to the task loss, already weighted (σN-Ens: ``reg.lam · L_div``); zero here."""
        return torch.zeros((), device=self._device())

    def member(self, index: int) -> nn.Module:
        """Member ``index`` as a plain model of the source architecture, where the method has one."""
        raise UnsupportedError(f"model.method={self.name!r} has no per-member plain model: its members share "
                               "layers that are not of the source architecture")

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module, timm's convention) of parameters the optimiser must not decay, beyond
        the defaults (norm layers, 1-d tensors, and what submodules such as a timm ViT name themselves)."""
        return set()

    def fast_weights(self) -> set[str]:
        """Names of per-member parameters that ``optim.fast_weight_lr_scale`` applies to (BatchEnsemble's r, s)."""
        return set()

    def extra_metrics(self) -> dict[str, float]:
        """Method-specific numbers logged with every evaluation (σN-Ens: the measured sharing)."""
        return {}

    def sub_ensemble(self, members: list[int]) -> EnsembleMethod:
        """A model of only ``members`` (distinct indices, in that order) that really runs ``len(members)`` members,
        for the k-member scores of ``sigmanens eval``; methods that can override this."""
        raise UnsupportedError(f"model.method={self.name!r} has no sub_ensemble(members); cannot run "
                               f"{len(members)} of its {self.num_members} members")

    def select_members(self, members: Sequence[int]) -> EnsembleMethod:
        """A model of only ``members`` (indices into this model's M), which really runs ``len(members)`` members:
        :meth:`sub_ensemble` after checking the indices; all members in order is the model itself (what eval's
        k-member scores and a program of chosen members run)."""
        m = self.num_members
        members = list(members)
        if not members or len(set(members)) != len(members) or not all(0 <= i < m for i in members):
            raise UsageError(f"members {members} must be distinct indices in 0..{m - 1}")
        if members == list(range(m)):
            return self
        return self.sub_ensemble(members)

    @property
    def supports_sub_ensembles(self) -> bool:
        """Whether :meth:`sub_ensemble` is implemented (a one-member model is its own only sub-ensemble)."""
        return type(self).sub_ensemble is not EnsembleMethod.sub_ensemble or self.num_members == 1

    def sharing(self, threshold: float = 0.5) -> dict[str, float] | None:
        """Measured sharing per layer (σN-Ens: members "on" per feature); None for methods without σ gates."""
        return None

    def layer_importances(self) -> tuple[list[str], torch.Tensor] | None:
        """Per-member importance of each gated layer, ``(M, L)`` with the layer names (the sharing heatmap); None
        for methods without σ gates."""
        return None

    def check_index(self, index: int) -> None:
        if not 0 <= index < self.num_members:  # the sequence type: the commands check --member K first
            raise IndexError(f"member index {index} out of range for num_members={self.num_members}")

    def _device(self) -> torch.device:
        return next(self.parameters()).device


def call_backbone(backbone: nn.Module, x: Inputs) -> torch.Tensor:
    """Logits of a timm / torchvision / Hugging Face backbone (tokenizer dicts are passed as keyword arguments)."""
    return logits_of(backbone(**x) if isinstance(x, Mapping) else backbone(x))


def member_chunks(x: Inputs, num_members: int) -> list[Inputs]:
    """Split a member-major batch ``(M·B, …)`` into the M per-member batches ``(B, …)``."""
    first = x if isinstance(x, torch.Tensor) else next(v for v in x.values() if isinstance(v, torch.Tensor))
    # an invariant of the forward pass: the ensemble builds member-major batches (a bug if hit)
    if first.shape[0] % num_members:
        raise ValueError(f"member-major batch of {first.shape[0]} rows is not a multiple of num_members="
                         f"{num_members}")
    size = first.shape[0] // num_members
    return [map_tensors(x, lambda t, m=m: t[m * size:(m + 1) * size]) for m in range(num_members)]


def map_tensors(x: Inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """``fn`` applied to an input tensor, or to every tensor of a tokenizer-style mapping."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return type(x)({k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in x.items()})
    # an invariant: the loaders yield tensors or tokenizer mappings (a bug if hit)
    raise TypeError(f"inputs must be a Tensor or a mapping of Tensors (e.g. tokenizer output), got {type(x).__name__}")


def logits_of(out: Any) -> torch.Tensor:
    """Logits from a backbone's output: a tensor, a Hugging Face ``ModelOutput`` (``.logits``) or a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    # found in the forward pass: the traceback shows the backbone that returned it
    raise TypeError(f"cannot find logits in the backbone output of type {type(out).__name__}")
