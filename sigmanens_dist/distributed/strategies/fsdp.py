"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimiser state sharded across ranks.

Units: every block of the families users train (ViT ``blocks``, ResNet ``layer1``–``layer4``, ConvNeXt ``stages``,
Hugging Face ``encoder.layer``), then the root. The root unit owns what no block does, including the σ store's flat
parameter. The σ layers inside blocks read ``store.flat`` at call time (they hold no cached views of it), and the
store's own forward never runs; this works because the root is unsharded by its pre-forward hook before any block
runs and is kept unsharded until backward (``reshard_after_forward=False``), so every σ layer and the trainer's
``L_div`` (computed after the forward) read the whole fp32 parameter, and its gradient is reduce-scattered once, at
the end of backward, like every other root parameter.

Mixed precision (``train.amp=bf16``): blocks get ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
the root is not cast, so σ(γ), the member affines and ``L_div`` stay fp32 (autocast still runs the root's own
layers, patch embedding and head, in bf16). Checkpoints are torch.distributed.checkpoint folders: every rank
writes its shards, and a run on another world size reshards them on load.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from sigmanens_dist.config import Config
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.distributed.strategies.base import FOLDER_KEY, Strategy
from sigmanens_dist.errors import UsageError
from sigmanens_dist.safe_load import SafeDCPReader, dcp_refusals

__all__ = ["FSDPStrategy", "shard_units"]

# Qualified-name patterns of the modules that become FSDP units, matched against the full module name.
_UNIT_PATTERNS = (
    re.compile(r"(^|\.)blocks\.\d+$"),  # timm ViT / DeiT / EVA
    re.compile(r"(^|\.)layer[1-4]$"),  # timm / torchvision ResNet, WideResNet
    re.compile(r"(^|\.)stages\.\d+$"),  # timm ConvNeXt, EfficientNet-style stage lists
    re.compile(r"(^|\.)encoder\.layer\.\d+$"),  # Hugging Face BERT / RoBERTa / ViT
)


def shard_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that become their own FSDP unit (outermost matches only), in module order."""
    units: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(p.search(name) for p in _UNIT_PATTERNS) and not any(name.startswith(u + ".") for u, _ in units):
            units.append((name, module))
    return units


class FSDPStrategy(Strategy):
    name = "fsdp"
    checkpoint_format = "dcp"
    sharded_parameters = True  # the EMA keeps shadows of the local shards, saved in the DCP checkpoint

    @classmethod
    def options_from(cls, cfg: Config, *, elastic: bool = False) -> dict[str, Any]:
        s = cfg.strategy
        return {"reshard_after_forward": s.fsdp_reshard_after_forward is not False, "replicate": s.fsdp_replicate or 1}

    @classmethod
    def check_folder(cls, folder: Path) -> None:
        SafeDCPReader(str(folder)).read_metadata()  # DCP's index, through the allow-list

    @classmethod
    def consolidated(cls, folder: Path, part: str) -> dict[str, torch.Tensor] | None:
        # private torch API: a torch without it fails here only
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        if not any(k.startswith(f"{part}.") for k in SafeDCPReader(str(folder)).read_metadata().state_dict_metadata):
            return None
        with dcp_refusals():
            return _load_state_dict_from_keys(part, storage_reader=SafeDCPReader(str(folder)))[part]

    def __init__(self, env: DistEnv, *, amp: str = "none", reshard_after_forward: bool = True,
                 replicate: int = 1) -> None:
        if amp == "fp16":
            raise UsageError("train.amp=fp16 is not supported with strategy.name=fsdp (it would need a sharded "
                             "GradScaler); use train.amp=bf16")
        if env.world_size % replicate:
            raise UsageError(f"strategy.fsdp_replicate={replicate} does not divide the world size "
                             f"{env.world_size}: the HSDP mesh is replicas × shards")
        super().__init__(env, amp=amp)
        self.reshard_after_forward, self.replicate = reshard_after_forward, replicate
        self.units: list[str] = []

    # -- set-up ----------------------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.model = model.to(self.env.device)
        self.wrapped = self.model
        if not self.env.distributed:  # one rank: nothing to shard; checkpoints stay DCP folders (reshardable)
            return self.wrapped
        world = self.env.world_size
        mesh = (init_device_mesh(self.env.device.type, (self.replicate, world // self.replicate),
                                 mesh_dim_names=("replicate", "shard")) if self.replicate > 1
                else init_device_mesh(self.env.device.type, (world,)))
        block_mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                    if self.amp == "bf16" else MixedPrecisionPolicy())
        units = shard_units(self.model)
        # Every rank starts from rank 0's model, as DDP's constructor and DeepSpeed's engine broadcast it: pretrained
        # weights are read on rank 0 only (the trainer), and fully_shard keeps each rank's own slice of its copy.
        full = self.model.state_dict() if self.env.is_main else {}
        if not units:
            raise UsageError(f"strategy.name=fsdp found no blocks to shard in {type(model).__name__}: it shards "
                             "ViT 'blocks', ResNet 'layer1-4', ConvNeXt 'stages' and Hugging Face 'encoder.layer'")
        for _, unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=block_mp, reshard_after_forward=self.reshard_after_forward)
        # The root (σ store, embeddings, head): kept whole from its pre-forward until backward, and never cast.
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True,
                                                                         broadcast_from_rank0=True))
        self.units = [name for name, _ in units]
        return self.wrapped

    def _fsdp_modules(self) -> Iterator[nn.Module]:
        from torch.distributed.fsdp import FSDPModule  # public from torch 2.6; pyproject allows 2.4

        return (m for m in self.model.modules() if isinstance(m, FSDPModule))

    # -- the step --------------------------------------------------------------------------------------------------
    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        self.sync_buffers()  # rank 0's running statistics before every forward, as DDP does
        if self.env.distributed:
            self.model.set_requires_gradient_sync(last)  # reduce-scatter only on the step's last micro-batch
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        if not self.env.distributed:
            yield
            return
        modules = list(self._fsdp_modules())
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:
                m.reshard()
            for m in modules:
                m.set_reshard_after_forward(m is not self.model and self.reshard_after_forward, recurse=False)

    # -- state -----------------------------------------------------------------------------------------------------
    def _state(self, with_ema: bool = True) -> dict[str, Any]:
        state = {"model": get_model_state_dict(self.model),
                 "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        if self.ema is not None and with_ema:
            state["ema"] = self.ema.state_dict(self.model)
        return state

    def save_shards(self, folder: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(folder))

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("FSDP checkpoints are DCP folders: use save_shards")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        folder = state.get(FOLDER_KEY)
        if folder is None:
            raise UsageError("strategy.name=fsdp resumes from DCP checkpoint folders (step_N/); this checkpoint is "
                             "one file written by strategy.name=ddp: resume it with strategy.name=ddp")
        saved = SafeDCPReader(str(folder)).read_metadata().state_dict_metadata
        target = self._state(with_ema=any(key.startswith("ema.") for key in saved))
        with dcp_refusals():
            dcp.load(target, storage_reader=SafeDCPReader(str(folder)))  # reshards to this world size
        set_model_state_dict(self.model, target["model"])
        set_optimizer_state_dict(self.model, self.optimizer, target["optimizer"])
        if self.ema is not None and "ema" in target:
            self.ema.load_state_dict(target["ema"], self.model)
