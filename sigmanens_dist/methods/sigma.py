"""σN-Ens (the project's method): every norm layer becomes M per-member σ layers over one shared backbone
(:mod:`sigmanens_dist.sigma`), run as one batched pass and trained with ``reg.lam · L_div(reg.tau)``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from sigmanens_dist.config import Config, RegConfig
from sigmanens_dist.methods.base import EnsembleMethod, Inputs, logits_of, map_tensors
from sigmanens_dist.sigma.convert import ConversionSummary, convert_norms, count_params
from sigmanens_dist.sigma.layers import SigmaBatchNorm, SigmaNorm, SigmaStore
from sigmanens_dist.sigma.regularizer import diversity_loss, members_on

__all__ = ["IMPORTANCE_BINS", "SigmaEnsemble", "build", "convert_to_sigma_ensemble"]

IMPORTANCE_BINS = 10  # bins of the σ(γ) histogram logged with every evaluation


class SigmaEnsemble(EnsembleMethod):
    """A shared backbone whose norms are σ layers of M members; all σ state lives in ``self.sigma``.

    ``forward(x)`` replicates a batch ``(B, …)`` for every member and returns member logits ``(M, B, K)`` from ONE
    batched pass; ``forward_members`` takes an already member-major batch ``(M·B, …)`` (members may see different
    samples); ``predict`` is the mean of member softmaxes.
    """

    name = "sigma"
    display = "σN-Ens"
    # Each member its own batches: the best recipe measured in docs/quality.md (shared batches leave the members one
    # model, since identical members get identical gradients).
    default_member_batches = "independent"
    regularized = True
    knobs = MappingProxyType({"model.gamma_init_mean": "γ₀", "model.gamma_init_std": "γ₀ std",
                              "optim.sigma_lr_scale": "σ lr×", "model.member_batches": "batches",
                              "model.affine_init": "affine"})

    def __init__(self, backbone: nn.Module, sigma: SigmaStore, summary: ConversionSummary | None = None) -> None:
        super().__init__()
        self.sigma = sigma  # first, so a mismatched checkpoint is refused before the backbone is touched
        self.backbone = backbone
        self._bound_ptr = -1
        self.rebind()
        self.summary = summary
        if summary is not None:
            summary.params = count_params(self)

    @property
    def num_members(self) -> int:
        return self.sigma.num_members

    def sigma_layers(self) -> list[tuple[str, SigmaNorm]]:
        return [(name, m) for name, m in self.backbone.named_modules() if isinstance(m, SigmaNorm)]

    # -- views survive .to()/.cuda()/load(assign=True): re-expose them whenever the stats buffer moved -------
    def rebind(self) -> None:
        """Point every σBatchNorm's named ``running_mean``/``running_var`` views at the current stats buffer."""
        for _, layer in self.sigma_layers():
            if isinstance(layer, SigmaBatchNorm) and layer.track_running_stats:
                layer.rebind_stats()
        self._bound_ptr = self.sigma.running_stats.data_ptr()

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.rebind()
        return out

    # -- forward ---------------------------------------------------------------------------------------------
    def forward(self, x: Inputs, *, member_major: bool = False) -> torch.Tensor:
        """Member logits ``(M, B, K)`` for a batch ``(B, …)`` seen by every member (or a member-major one)."""
        if member_major:
            return self.forward_members(x)
        return self._members_pass(map_tensors(x, lambda t: _replicate(t, self.num_members)), _batch_size(x))

    def forward_members(self, x: Inputs) -> torch.Tensor:
        """Member logits ``(M, B, K)`` for a member-major batch ``(M·B, …)``."""
        batch = _batch_size(x)
        # an invariant of the forward pass: callers pass member-major batches (a bug if hit)
        if batch % self.num_members:
            raise ValueError(f"forward_members: batch size {batch} is not a multiple of num_members="
                             f"{self.num_members}; pass (M·B, …) member-major inputs, or use forward((B, …))")
        return self._members_pass(map_tensors(x, lambda t: _interleave(t, self.num_members)),
                                  batch // self.num_members)

    def _members_pass(self, rows: Inputs, batch: int) -> torch.Tensor:
        """Run the backbone on ``M·B`` interleaved rows (row ``b·M + m``, see
        :mod:`sigmanens_dist.sigma.layers.sigma_norm`); member logits ``(M, B, K)``."""
        # (compiled, the check would break the graph; .to() and load_state_dict re-bind through _apply anyway)
        if not torch.compiler.is_compiling() and self.sigma.running_stats.data_ptr() != self._bound_ptr:
            self.rebind()
        self.sigma.begin_pass(interleaved=True)
        try:
            out = logits_of(self.backbone(**rows) if isinstance(rows, Mapping) else self.backbone(rows))
        finally:
            self.sigma.end_pass()
        # back to the member-major contract, as a view (as Packed-Ensembles returns its logits)
        return out.view(batch, self.num_members, *out.shape[1:]).transpose(0, 1)

    # -- σ state ---------------------------------------------------------------------------------------------
    def gamma(self, regularized_only: bool = True) -> torch.Tensor:
        """The ``(M, F)`` importance logits (a view of the flat parameter; differentiable)."""
        return self.sigma.gamma(regularized_only)

    def importances(self, regularized_only: bool = False) -> torch.Tensor:
        """``σ(γ)`` of every converted layer (or only the regularized ones), ``(M, F)``."""
        return torch.sigmoid(self.gamma(regularized_only))

    def diversity_loss(self, tau: float, normalize: str = "none") -> torch.Tensor:
        """``L_div`` over all regularized layers in one op (multiply by λ yourself); ``normalize`` as in
        :func:`sigmanens_dist.sigma.regularizer.diversity_loss`."""
        return diversity_loss(self.gamma(), tau, normalize)

    def aux_loss(self, reg: RegConfig) -> torch.Tensor:
        """``reg.lam · L_div(reg.tau)``, normalised as ``reg.normalize`` says: the regularizer the training loss
        adds."""
        return reg.lam * self.diversity_loss(reg.tau, reg.normalize)

    def extra_metrics(self) -> dict[str, float]:
        """The measured sharing, and the histogram of the regularized importances σ(γ) over
        :data:`IMPORTANCE_BINS` equal bins of [0, 1] (fractions of member × feature entries): logged at every
        evaluation, it is the trajectory that shows τ setting the sharing during training. None without gates (FiLM)."""
        sharing = self.sharing()
        if sharing is None:
            return {}
        hist = torch.histc(self.importances(regularized_only=True).detach().float(), IMPORTANCE_BINS, 0.0, 1.0)
        hist = hist / hist.sum().clamp_min(1)
        return {"sharing/members_on": sharing["all"],
                **{f"sharing/hist/{i}": float(v) for i, v in enumerate(hist.tolist())}}

    def sharing(self, threshold: float = 0.5) -> dict[str, float] | None:
        """Measured sharing: mean number of members "on" (σ(γ) > threshold) per feature, per regularized layer,
        plus ``"all"`` over every regularized feature; None for an ungated store (FiLM: γ means nothing)."""
        if not self.sigma.plan.gated:
            return None
        on = members_on(self.gamma(), threshold).float()
        out = {s.name: on[s.gamma[0]: s.gamma[1]].mean().item() for s in self.sigma.slots if s.regularized}
        out["all"] = on.mean().item() if on.numel() else float("nan")
        return out

    def layer_importances(self) -> tuple[list[str], torch.Tensor] | None:
        """Mean importance σ(γ) per member and σ layer, ``(M, L)``, with the layer names; None for an ungated store."""
        if not self.sigma.plan.gated:
            return None
        with torch.no_grad():
            imp = self.importances(regularized_only=False).float().cpu()
            cols = [imp[:, s.gamma[0]: s.gamma[1]].mean(1) for s in self.sigma.slots]
        return [s.name for s in self.sigma.slots], torch.stack(cols, dim=1)

    def sub_ensemble(self, members: list[int]) -> SigmaEnsemble:
        """Only ``members``, a real ``len(members)``-member model of the same class (σN-Ens or FiLM): the store keeps
        their rows, shared weights are copied unchanged and every σ layer is re-bound to the new store (its views,
        its member count for the interleaved rows)."""
        store = self.sigma.select_members(members)
        backbone = copy.deepcopy(self.backbone, {id(self.sigma): store})
        for slot in store.slots:
            layer = backbone.get_submodule(slot.name)
            layer.num_members = len(members)
            layer.bind(store, slot)
        return type(self)(backbone, store).train(self.training)

    def member(self, index: int) -> nn.Module:
        """Member ``index`` as a plain model of the source architecture (σ(γ) folded into ordinary norms)."""
        self.check_index(index)
        memo: dict[int, Any] = {id(layer): layer.plain_member(index) for _, layer in self.sigma_layers()}
        return copy.deepcopy(self.backbone, memo)


def convert_to_sigma_ensemble(
    model: nn.Module,
    num_members: int,
    *,
    gamma_init_mean: float = 0.0,
    gamma_init_std: float = 1.0,
    affine_init: str = "divide",
    layers: Sequence[str] | None = None,
    regularize: Sequence[str] | None = None,
    seed: int | None = 0,
    inplace: bool = False,
) -> SigmaEnsemble:
    """Replace every normalization layer of ``model`` by an M-member σ layer and return the ensemble
    (:func:`sigmanens_dist.sigma.convert.convert_norms` does the walk).

    Function preserving by default: each member's affine is divided by its random ``σ(γ_m)``, so at conversion every
    member reproduces ``model``'s eval output while γ starts off the symmetric saddle of ``L_div``.

    Args:
        gamma_init_mean, gamma_init_std: γ ~ N(mean, std²). A positive mean with a small std (the trainer's default
            2, 0.1) starts every member "on" (σ(γ) ≈ 0.88) instead of switching about half of them off.
        affine_init: ``divide`` (member affine = source affine / σ(γ_m): function preserving) or ``plain`` (member
            affine = source affine: each member starts at σ(γ_m) × the source). The division makes a member with a
            small σ(γ) learn its effective scale and shift at only ~σ(γ)² of the rate (up to ×100 slower); ``plain``
            avoids that when training from scratch, where there is no function to preserve.
        layers: ``fnmatch`` patterns of module names to convert (default: every norm; an unsupported norm is then an
            error). Norms not matched stay shared.
        regularize: patterns of converted layers whose γ enter ``diversity_loss`` (default: all).
        seed: seed of the γ initialisation (the same on every rank); None draws from torch's global RNG.
        inplace: modify ``model`` itself instead of a deep copy.
    """
    backbone, store, summary = convert_norms(model, num_members, gamma_init_mean=gamma_init_mean,
                                             gamma_init_std=gamma_init_std, affine_init=affine_init, layers=layers,
                                             regularize=regularize, seed=seed, inplace=inplace)
    return SigmaEnsemble(backbone, store, summary)


# The config's names for the library's two affine starts: on a trained source ``plain`` is the perturbed start.
_LIBRARY_AFFINE = {"divide": "divide", "perturb": "plain", "plain": "plain"}


def build(cfg: Config, make_backbone: Callable[[], nn.Module]) -> SigmaEnsemble:
    m = cfg.model
    return convert_to_sigma_ensemble(make_backbone(), m.num_members, gamma_init_mean=m.gamma_init_mean,
                                     gamma_init_std=m.gamma_init_std, affine_init=_LIBRARY_AFFINE[m.affine_init],
                                     layers=m.layers,
                                     regularize=cfg.reg.regularize,
                                     seed=cfg.seed, inplace=True)


# -- inputs of arbitrary backbones ------------------------------------------------------------------------------
def _batch_size(x: Inputs) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    sizes = {v.shape[0] for v in x.values() if isinstance(v, torch.Tensor)}
    if len(sizes) != 1:  # an invariant: a tokenizer's tensors share the batch dimension (a bug if hit)
        raise ValueError(f"input tensors disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def _interleave(t: torch.Tensor, num_members: int) -> torch.Tensor:
    """Member-major rows ``(M·B, …)`` to interleaved rows ``(B·M, …)`` (row ``b·M + m``): one copy."""
    return t.view(num_members, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _replicate(t: torch.Tensor, num_members: int) -> torch.Tensor:
    """A batch ``(B, …)`` seen by every member, as ``M·B`` interleaved rows: one copy."""
    return t.unsqueeze(1).expand(t.shape[0], num_members, *t.shape[1:]).reshape(-1, *t.shape[1:])
