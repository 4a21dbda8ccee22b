"""The strategy interface: everything that differs between DDP, FSDP2 and DeepSpeed ZeRO.

The trainer only calls these methods: it never asks which strategy it has. A strategy wraps the model, builds the
optimiser from parameter groups, runs backward with gradient accumulation (communicating only on the last
micro-batch), unscales + clips + steps, keeps the weight average (EMA) its sharding allows, and saves/loads model
and optimiser state in its checkpoint format.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn

from sigmanens_dist.config import Config
from sigmanens_dist.distributed.env import DistEnv

__all__ = ["FOLDER_KEY", "CheckpointWriter", "OptimizerFactory", "Strategy", "WeightAverage"]

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
# Key of the loaded trainer state that names a folder checkpoint's path: the strategy reads its shards from there.
FOLDER_KEY = "checkpoint_folder"


class WeightAverage(Protocol):
    """What a strategy needs of the run's weight average (``training.ema``, built for it by ``build_ema``): its
    state in the model's state-dict form, which a folder strategy saves and loads with its shards."""

    def state_dict(self, model: nn.Module) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], model: nn.Module) -> None: ...


class CheckpointWriter(Protocol):
    """Where a strategy writes its checkpoints (``checkpoint.CheckpointManager``: atomic, rotated, best kept)."""

    def save(self, state: dict[str, Any], step: int, metric: float | None = None) -> Path: ...

    def save_folder(self, write_shards: Callable[[Path], None], state: dict[str, Any], step: int,
                    metric: float | None, *, is_main: bool, barrier: Callable[[], None]) -> Path: ...


class Strategy(ABC):
    """One instance per run. ``wrap`` first, then ``build_optimizer``; after that ``model`` (the plain module, for
    evaluation and the σ reads), ``wrapped`` (the one to call in training) and ``optimizer`` are set, and every rank
    holds rank 0's parameters (DDP's constructor, FSDP2's ``wrap`` and DeepSpeed's engine broadcast them), so only
    rank 0 needs to read pretrained weights. Buffers follow :meth:`sync_buffers`."""

    name: str = "base"
    #: "file": one ``step_N.pt`` written by rank 0; "dcp" / "deepspeed": a folder every rank writes its shards into.
    checkpoint_format: str = "file"
    #: Parameters live sharded across ranks (FSDP2): a weight average keeps per-shard shadows, not a model copy,
    #: saved with the shards.
    sharded_parameters: ClassVar[bool] = False
    #: The engine needs a process group even on one process (DeepSpeed's): one of one rank is made for it.
    needs_process_group: ClassVar[bool] = False

    # -- the checkpoint format, read without a process group (export, eval, init_from) ----------------------------
    @classmethod
    def check_folder(cls, folder: Path) -> None:
        """Raise if ``folder`` is not a complete checkpoint of this folder format, or would run code when read."""
        raise NotImplementedError(f"strategy {cls.name!r} writes one file (checkpoint_format='file')")

    @classmethod
    def consolidated(cls, folder: Path, part: str) -> dict[str, torch.Tensor] | None:
        """Part ``part`` (``"model"``, ``"ema"``) of a folder checkpoint as one full state dict on one CPU process,
        or None when this format keeps that part elsewhere or the run had none."""
        raise NotImplementedError(f"strategy {cls.name!r} writes one file (checkpoint_format='file')")

    # -- what resume checks, from the strategy section of a config (a saved one or this run's) -------------------
    @classmethod
    def options_from(cls, cfg: Config, *, elastic: bool = False) -> dict[str, Any]:
        """The keyword options of the constructor, from a validated ``Config``; ``elastic``: the run resumes a
        checkpoint written at another world size."""
        return {}

    @classmethod
    def checkpoint_kind(cls, section: dict[str, Any]) -> str:
        """What a checkpoint must have been written as for this strategy to resume it."""
        return cls.checkpoint_format

    @classmethod
    def describe(cls, section: dict[str, Any]) -> str:
        """The config keys that name this strategy and its checkpoint kind, as a user would write them."""
        return f"strategy.name={cls.name}"

    @classmethod
    def reshard_refusal(cls, section: dict[str, Any], saved_world: int, world: int) -> str | None:
        """Why a checkpoint of ``saved_world`` ranks cannot resume on ``world`` ranks, or None when it can."""
        return None

    def __init__(self, env: DistEnv, *, amp: str = "none") -> None:
        self.env, self.amp = env, amp
        self.model: nn.Module | None = None
        self.wrapped: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.ema: WeightAverage | None = None  # set by training.ema.build_ema
        # fp16 needs loss scaling; bf16 and fp32 do not (a disabled scaler is a pass-through).
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=amp == "fp16")

    # -- set-up ----------------------------------------------------------------------------------------------------
    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Move to the device and wrap for distributed training; sets and returns ``self.wrapped``."""

    def build_optimizer(self, groups: list[dict[str, Any]], factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimiser over this strategy's view of the parameters (``groups`` hold the plain model's)."""
        self.optimizer = factory(groups)
        return self.optimizer

    # -- the step --------------------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Mixed precision for forward + loss (parameters stay fp32; σ(γ) and L_div are computed in fp32)."""
        if self.amp == "none":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.amp == "bf16" else torch.float16
        return torch.autocast(self.env.device.type, dtype=dtype)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Gradients accumulate locally, without communication (DDP must see this around forward *and*
        backward; FSDP2 and DeepSpeed only consult it in backward)."""
        return contextlib.nullcontext()

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Wraps forward + backward of one micro-batch: gradients are reduced only on the last one of a step."""
        return contextlib.nullcontext() if last else self.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's (already accumulation-scaled) loss."""
        self.scaler.scale(loss).backward()

    def step(self, clip_grad: float | None) -> float | None:
        """Unscale, clip (returning the total gradient norm before clipping), step, zero the gradients."""
        assert self.optimizer is not None and self.model is not None  # wrap() and build_optimizer() came first
        norm = None
        if clip_grad:
            self.scaler.unscale_(self.optimizer)
            norm = float(self.clip_grad_norm(clip_grad))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    # -- one model on every rank -----------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_buffers(self) -> None:
        """The running-statistics policy of every strategy: rank 0's floating buffers (BatchNorm running stats,
        the σ store's flat stats buffer) on every rank. DDP does this itself before each forward; sharded
        strategies call it before each micro-batch, and the trainer before evaluation and checkpoints, so every
        rank evaluates and saves the same model and a BatchNorm run matches DDP's."""
        if not self.env.distributed or self.model is None:
            return
        for buf in self.model.buffers():
            if buf.is_floating_point() and buf._base is None and buf.numel():  # views follow their base
                dist.broadcast(buf, src=0)

    def gathered(self) -> contextlib.AbstractContextManager[Any]:
        """Inside: every parameter of ``model`` is whole on every rank, so forwards need no collective (ranks may
        run different numbers of evaluation batches) and the σ reads (``sharing()``, ``member(k)``…) see all of
        the flat parameter. Entered by every rank together."""
        return contextlib.nullcontext()

    # -- state -----------------------------------------------------------------------------------------------------
    def save_checkpoint(self, writer: CheckpointWriter, trainer_state: dict[str, Any], step: int,
                        metric: float | None, barrier: Callable[[], None]) -> None:
        """Called on every rank: one checkpoint in this strategy's format. ``file``: rank 0 writes model,
        optimiser and the trainer's state as one file; a folder format: every rank writes its shards and rank 0
        adds the trainer's state (``checkpoint.TrainerState``, whose ``format`` tells readers whose folder it is)."""
        if self.checkpoint_format == "file":
            state = self.state_dict()
            if self.env.is_main:
                writer.save({**state, **trainer_state}, step, metric)
            barrier()
            return
        writer.save_folder(self.save_shards, trainer_state, step, metric, is_main=self.env.is_main, barrier=barrier)

    def save_shards(self, folder: Path) -> None:
        """Folder formats only: every rank writes its part of model + optimiser state into ``folder``."""
        raise NotImplementedError(f"strategy {self.name!r} writes one file (checkpoint_format='file')")

    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser and loss-scaler state, in the form this strategy's checkpoint format stores."""
        assert self.model is not None and self.optimizer is not None  # wrap() and build_optimizer() came first
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.model is not None and self.optimizer is not None  # wrap() and build_optimizer() came first
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
