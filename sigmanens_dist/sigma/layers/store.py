"""The flat store: every σNorm parameter of every member in one ``nn.Parameter``.

Why one tensor: the whole ensemble state (importances γ, member affines) then travels as a single gradient
through DDP buckets, FSDP shards and ZeRO partitions, and the diversity regularizer is one op over one view.

Layout of the parameter, shape ``(M, D)``, one row per member::

    row m = [ γ of regularized layers | γ of other layers | weight, bias of layer 0 | weight, bias of layer 1 | … ]

so ``flat[:, :G_reg]`` is the ``(M, F)`` matrix the regularizer needs and ``flat[m]`` is member m's whole state.
During a forward pass of the ensemble (:meth:`SigmaStore.begin_pass`) every layer's gated affine ``σ(γ)·w, σ(γ)·b``
comes from one gather, one sigmoid and one multiply over the whole store, split into per-layer contiguous ``(M·C,)``
pieces (member-major: entry ``m·C + c``): a few kernels per pass instead of a few per layer, which is what a GPU pays
for (each launch costs as much as a small norm's math), and pieces a native norm over M·C channels takes as they are.
How the layers run is one immutable :class:`PassPlan` the store holds (:attr:`SigmaStore.plan`): where the members
sit in the batch (set by the ensemble's forward, so no layer guesses), whether σ(γ) gates the affine (not for FiLM),
and whether the affines are computed once per pass (not under activation checkpointing).
Running statistics live in one flat buffer too, with every layer's ``(M, C)`` mean and var contiguous so the
per-member rows can be updated in place by ``F.batch_norm``.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerSlot", "PassPlan", "SigmaStore"]


@dataclass(frozen=True)
class PassPlan:
    """How the σ layers run, replaced whole (never mutated) by whoever decides it."""

    # the rows are interleaved (row b·M + m): the ensemble's pass (SigmaEnsemble.forward_members) sets it; a layer
    # called alone takes member-major rows
    interleaved: bool = False
    # σ(γ) gates the member affine; False for the FiLM-style ablation (methods/film.py), where γ is unused
    gated: bool = True
    # the gated affines are computed once per pass; False under activation checkpointing (models.build_model): a
    # recomputed block must save exactly the tensors its first forward saved, so each layer computes its own
    per_pass: bool = True


@dataclass(frozen=True)
class LayerSlot:
    """Where one σ layer's tensors sit inside the store (column ranges of the parameter, offsets of the stats)."""

    name: str
    kind: str
    num_features: int
    gamma: tuple[int, int]
    weight: tuple[int, int]
    bias: tuple[int, int] | None
    stats: int | None  # offset of running_mean in the stats buffer; running_var follows; None: no running stats
    regularized: bool
    # weight and bias travel as one (2, M·C) tensor in a pass (the layer class's joint_affine, with a bias): not
    # part of the signature, which only names what the saved columns mean
    joint: bool = False

    def signature(self) -> str:
        return (f"{self.name}:{self.kind}:{self.num_features}:{int(self.bias is not None)}:"
                f"{int(self.stats is not None)}:{int(self.regularized)}")


class SigmaStore(nn.Module):
    """Owns the flat parameter and the flat running-stat buffer; σ layers only read views of them."""

    # Written into the state dict so a checkpoint of another M or architecture is refused with a clear message.
    _LAYOUT_FIELDS = ("num_members", "num_layers", "num_gamma", "num_regularized", "num_columns", "num_stats", "crc")

    def __init__(self, num_members: int, slots: list[LayerSlot], num_columns: int, num_stats: int) -> None:
        super().__init__()
        self.num_members = num_members
        self.plan = PassPlan()
        self.slots = slots
        self.num_gamma = sum(s.num_features for s in slots)
        self.num_regularized = sum(s.num_features for s in slots if s.regularized)
        self.flat = nn.Parameter(torch.zeros(num_members, num_columns))
        self.register_buffer("running_stats", torch.zeros(num_stats))
        self.register_buffer("layout", torch.tensor(self._layout_values(), dtype=torch.int64))
        # The affine columns follow the γ block, layer by layer (weight, then bias): for each, the γ column gating it.
        spans = [(span, s.gamma[0]) for s in slots for span in (s.weight, s.bias) if span is not None]
        starts = [lo for (lo, _), _ in spans]
        # an invariant of the layout built just above (a bug if hit)
        if starts != [self.num_gamma, *(hi for (_, hi), _ in spans[:-1])]:
            raise ValueError("SigmaStore: the affine columns must follow the γ block contiguously, layer by layer")
        # One gather from the flat (M, D) parameter reads, for every affine entry in the per-layer (M·C,) order,
        # first the γ that gates it, then the entry itself.
        gates = _member_major_index(num_members, num_columns, spans, [g0 for _, g0 in spans])
        self.register_buffer("gather_index", torch.cat([gates, _member_major_index(num_members, num_columns, spans,
                                                                                   starts)]), persistent=False)
        self._piece_sizes = [num_members * (hi - lo) for s in slots
                             for lo, hi in ([(s.weight[0], s.bias[1])] if s.joint else
                                            [span for span in (s.weight, s.bias) if span is not None])]
        self._pass: dict[str, tuple[torch.Tensor, ...]] | None = None

    def _layout_values(self) -> list[int]:
        crc = zlib.crc32("|".join(s.signature() for s in self.slots).encode())
        return [
            self.num_members,
            len(self.slots),
            self.num_gamma,
            self.num_regularized,
            getattr(self.flat, "ds_shape", self.flat.shape)[1],  # ZeRO-3 partitions it: its real shape is ds_shape
            self.running_stats.numel(),
            crc,
        ]

    # -- views --------------------------------------------------------------------------------------------
    def gamma(self, regularized_only: bool = True) -> torch.Tensor:
        """The ``(M, F)`` importance logits, a view into the flat parameter."""
        return self.flat[:, : self.num_regularized if regularized_only else self.num_gamma]

    def columns(self, span: tuple[int, int]) -> torch.Tensor:
        return self.flat[:, span[0] : span[1]]

    def gated_affines(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Every layer's ``(σ(γ)·w, σ(γ)·b)`` (``(w, b)`` ungated) by layer name, from one gather over the flat
        parameter (its backward is one gather-add): two contiguous ``(M·C,)`` pieces (entry ``m·C + c``), or, for the
        layers with a joint affine (:attr:`LayerSlot.joint`), one ``(2, M·C)`` tensor whose rows they are."""
        gamma, affine = self.flat.reshape(-1).index_select(0, self.gather_index).chunk(2)
        if self.plan.gated:
            affine = torch.sigmoid(gamma) * affine
        pieces = iter(affine.split(self._piece_sizes))
        return {s.name: (next(pieces).view(2, -1),) if s.joint else
                (next(pieces), next(pieces) if s.bias is not None else None) for s in self.slots}

    def begin_pass(self, interleaved: bool = False) -> None:
        """Compute every gated affine once for the forward pass that follows (the layers read them by name), and
        publish the pass's row layout in the plan."""
        self._pass = self.gated_affines() if self.plan.per_pass else None
        self.plan = dataclasses.replace(self.plan, interleaved=interleaved)

    def end_pass(self) -> None:
        """Drop them: a layer run outside a pass (export, a layer called alone) computes its own, on member-major
        rows. Under activation checkpointing (``per_pass`` off) the blocks recomputed in backward run after the pass
        and must read their rows as their first forward did: the layout then stays published until the next pass."""
        self._pass = None
        if self.plan.per_pass:
            self.plan = dataclasses.replace(self.plan, interleaved=False)

    def pass_affine(self, name: str) -> tuple[torch.Tensor, ...] | None:
        return None if self._pass is None else self._pass.get(name)

    def stats(self, offset: int, num_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Running mean and var of one layer as contiguous ``(M, C)`` views of the stats buffer."""
        n = self.num_members * num_features
        buf = self.running_stats
        return buf[offset : offset + n].view(self.num_members, -1), buf[offset + n : offset + 2 * n].view(
            self.num_members, -1
        )

    def select_members(self, members: Sequence[int]) -> SigmaStore:
        """A new store of only ``members``' rows, in that order: their σ parameters and running statistics (re-packed
        as ``(k, C)`` blocks), its pass plan carried over. Layers bound to this store must be re-bound to the
        new one (:meth:`SigmaEnsemble.sub_ensemble` does)."""
        k, flat = len(members), self.flat
        slots, num_stats = [], 0
        for slot in self.slots:
            offset = None
            if slot.stats is not None:
                offset, num_stats = num_stats, num_stats + 2 * k * slot.num_features
            slots.append(dataclasses.replace(slot, stats=offset))
        store = SigmaStore(k, slots, flat.shape[1], num_stats).to(device=flat.device, dtype=flat.dtype)
        store.plan = self.plan
        rows = torch.tensor(list(members), device=flat.device)
        with torch.no_grad():
            store.flat.copy_(flat.index_select(0, rows))
            for before, after in zip(self.slots, slots, strict=True):
                if before.stats is not None:
                    for src, dst in zip(self.stats(before.stats, before.num_features),
                                        store.stats(after.stats, after.num_features), strict=True):
                        dst.copy_(src.index_select(0, rows))
        return store

    # -- checkpoint compatibility ---------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        key = prefix + "layout"
        if key in state_dict:
            theirs = [int(v) for v in state_dict[key].tolist()]
            ours = self._layout_values()
            if theirs != ours:  # torch's load_state_dict type: models.py (build and load_trained) catches it at once
                raise RuntimeError(self._describe_mismatch(theirs, ours))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _describe_mismatch(self, theirs: list[int], ours: list[int]) -> str:
        t = dict(zip(self._LAYOUT_FIELDS, theirs, strict=False))
        o = dict(zip(self._LAYOUT_FIELDS, ours, strict=False))
        if t["num_members"] != o["num_members"]:
            return (f"cannot load σN-Ens state: the checkpoint has num_members={t['num_members']}, this ensemble has "
                    f"num_members={o['num_members']}; convert the model with the checkpoint's M")
        diffs = [f"{k}: checkpoint {t[k]} vs model {o[k]}" for k in self._LAYOUT_FIELDS[1:] if t[k] != o[k]]
        if diffs == [f"crc: checkpoint {t['crc']} vs model {o['crc']}"]:
            diffs = ["same sizes but the σ layers differ in name, kind or order (layout checksum differs)"]
        return "cannot load σN-Ens state: the checkpoint comes from a different architecture or conversion (" + \
            "; ".join(diffs) + ")"


def _member_major_index(num_members: int, row_len: int, spans: list[tuple[tuple[int, int], int]],
                        firsts: list[int]) -> torch.Tensor:
    """Indices into a flattened row-major ``(M, row_len)`` tensor that read, span after span, the ``hi - lo`` columns
    starting at ``first`` for member 0, then member 1, …: each span's ``(M·C,)`` piece in member-major order."""
    rows = torch.arange(num_members, dtype=torch.int64)[:, None] * row_len
    return torch.cat([(rows + torch.arange(first, first + hi - lo, dtype=torch.int64)).reshape(-1)
                      for ((lo, hi), _), first in zip(spans, firsts, strict=True)])
