"""DeepSpeed ZeRO stages 1-3 (``strategy.name=deepspeed strategy.zero_stage=1|2|3``), launched by torchrun like the
other strategies.

The engine's config is built from ours: the torch optimiser the trainer builds is handed to the engine (so CPU runs
need no compiled DeepSpeed ops), the trainer's LambdaLR keeps driving its learning rate, accumulation runs through
the engine (``gradient_accumulation_steps``; DeepSpeed's ``no_sync`` asserts under ZeRO-2/3), clipping is the
engine's ``gradient_clipping``. ``strategy.deepspeed_config=FILE.json`` is merged over the built config; a key both
set differently is an error naming both values, never silently won by either.

Mixed precision: ``train.amp=bf16`` runs the forward under autocast with fp32 parameters, like DDP (DeepSpeed's own
``bf16`` mode would cast the flat σ parameter and so σ(γ), the member affines and ``L_div`` to bf16).

ZeRO-3 partitions every parameter, the σ store's flat one included, and gathers a parameter only while the module
that owns it runs its forward; the store's forward never runs, and ``L_div`` reads the flat parameter after the
forward. So each micro-batch (forward, ``L_div`` and backward) runs inside ``GatheredParameters([flat])``: the flat
parameter (a small share of the model) is whole for the step and partitioned at rest, with its gradient and
optimiser state partitioned like any other. Every other read goes through :meth:`gathered`.

Checkpoints are the engine's own (``save_checkpoint`` into the step folder; the common keep-last/best/auto-resume
policy applies). On another world size (``universal=True``, elastic resume) rank 0 converts the step folder once to
DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``, into ``<step>/universal/``, kept for the
next resume) and every rank loads it with the engine's ``checkpoint.load_universal``; the trainer keeps the global
batch. ZeRO stages 1 and 2 (stage 3 is refused from the checkpoint's metadata, ``resume.check_same_run``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sigmanens_dist.atomic import replace_folder
from sigmanens_dist.config import Config
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.distributed.strategies.base import FOLDER_KEY, OptimizerFactory, Strategy
from sigmanens_dist.errors import MissingPathError, UnsupportedError, UsageError
from sigmanens_dist.safe_load import check_torch_file, written_by_us

__all__ = ["DeepSpeedStrategy", "build_ds_config", "merge_config"]

TAG = "zero"  # the engine's checkpoint tag inside each step folder


def build_ds_config(*, per_rank_batch: int, grad_accum: int, world_size: int, zero_stage: int,
                    clip_grad: float | None) -> dict[str, Any]:
    """The engine config our training config implies."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": per_rank_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": per_rank_batch * grad_accum * world_size,
        "gradient_clipping": clip_grad or 0.0,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # the trainer's torch optimiser
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return config


def merge_config(ours: dict[str, Any], theirs: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``theirs`` (the user's JSON) over ``ours``: new keys are added, equal ones kept; a key set to a different
    value is an error naming both (the run must not silently train with other settings than either says)."""
    merged = dict(ours)
    conflicts: list[str] = []
    for key, value in theirs.items():
        name = f"{where}{key}"
        if key not in ours:
            merged[key] = value
        elif isinstance(ours[key], dict) and isinstance(value, dict):
            try:
                merged[key] = merge_config(ours[key], value, f"{name}.")
            except ValueError as err:
                conflicts.append(str(err))
        elif ours[key] != value:
            conflicts.append(f"{name}: ours {ours[key]!r}, strategy.deepspeed_config {value!r}")
    if conflicts:
        raise UsageError("\n".join(conflicts))
    return merged


class _EngineCall(nn.Module):
    """What the trainer calls in training: forwards to the engine once it exists (set-up builds it with the
    optimiser), so the loop never sees DeepSpeed."""

    def __init__(self, strategy: DeepSpeedStrategy) -> None:
        super().__init__()
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._strategy.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> _EngineCall:
        target = self._strategy.engine or self._strategy.model
        target.train(mode)
        return self


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    checkpoint_format = "deepspeed"
    needs_process_group = True

    @classmethod
    def options_from(cls, cfg: Config, *, elastic: bool = False) -> dict[str, Any]:
        s = cfg.strategy
        return {"zero_stage": s.zero_stage or 2, "config_file": s.deepspeed_config,
                "per_rank_batch": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
                "clip_grad": cfg.train.clip_grad, "universal": elastic}

    @classmethod
    def checkpoint_kind(cls, section: dict[str, Any]) -> str:
        return f"{cls.checkpoint_format}/zero{section.get('zero_stage') or 2}"  # stages keep different shards

    @classmethod
    def describe(cls, section: dict[str, Any]) -> str:
        return f"strategy.name={cls.name} strategy.zero_stage={section.get('zero_stage') or 2}"

    @classmethod
    def reshard_refusal(cls, section: dict[str, Any], saved_world: int, world: int) -> str | None:
        if (section.get("zero_stage") or 2) != 3:
            return None
        return (f"the checkpoint is a ZeRO-3 checkpoint of {saved_world} ranks and this run has {world}; the "
                "installed DeepSpeed's universal checkpoint does not reshard ZeRO-3 here (stages 1 and 2 do): resume "
                f"on {saved_world} ranks")

    @classmethod
    def check_folder(cls, folder: Path) -> None:
        if not (folder / TAG).is_dir():
            raise MissingPathError(f"{folder} has no complete DeepSpeed checkpoint (no {TAG}/ folder)")
        # DeepSpeed loads its files (the engine's, and the universal form made for an elastic resume) with
        # weights_only=False: each is vetted as torch would read it
        for file in sorted(p for p in folder.rglob("*.pt") if p.parent != folder):
            check_torch_file(file, written_by_us, "checkpoint")

    @classmethod
    def consolidated(cls, folder: Path, part: str) -> dict[str, torch.Tensor] | None:
        if part != "model":
            return None  # the trainer keeps the EMA in trainer.pt beside the engine's files
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)

    def __init__(self, env: DistEnv, *, amp: str = "none", zero_stage: int = 2, config_file: Path | None = None,
                 per_rank_batch: int = 1, grad_accum: int = 1, clip_grad: float | None = None,
                 universal: bool = False) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if env.device.type == "cuda" else "cpu")
        # the engine reads the launcher's variables, which a plain `python -m sigmanens_dist.train` does not set
        for key, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", env.world_size)):
            os.environ.setdefault(key, str(value))
        try:
            import deepspeed  # noqa: F401
        except ImportError as err:
            raise UnsupportedError("strategy.name=deepspeed needs DeepSpeed, which is not installed: pip install "
                                   "'sigmanens-dist[deepspeed]'") from err
        super().__init__(env, amp=amp)
        self.zero_stage = zero_stage
        self.config = build_ds_config(per_rank_batch=per_rank_batch, grad_accum=grad_accum,
                                      world_size=env.world_size, zero_stage=zero_stage, clip_grad=clip_grad)
        if config_file is not None:
            try:
                self.config = merge_config(self.config, json.loads(Path(config_file).read_text()))
            except ValueError as err:
                raise UsageError(f"strategy.deepspeed_config={config_file} conflicts with the training config:\n"
                                 f"{err}\nremove these keys from the file or change the training config") from err
        zero = self.config["zero_optimization"]
        stage3_only = sorted(k for k in zero if k.startswith("stage3_") or k == "offload_param")
        if zero_stage != 3 and stage3_only:  # DeepSpeed accepts and ignores them: settings that do nothing
            keys = ", ".join(f"zero_optimization.{k}" for k in stage3_only)
            raise UsageError(f"strategy.deepspeed_config sets {keys}, which only ZeRO-3 reads, with "
                             f"strategy.zero_stage={zero_stage}: remove them or use strategy.zero_stage=3")
        for key in ("bf16", "fp16"):
            if self.config.get(key, {}).get("enabled"):
                raise UsageError(f"strategy.deepspeed_config enables {key}: DeepSpeed would cast the flat σ "
                                 "parameter; use train.amp=bf16 (autocast over fp32 parameters) instead")
        self.universal = universal  # resuming a checkpoint of another world size
        if universal:
            self.config["checkpoint"] = {"load_universal": True}
        self.engine: Any = None
        self._last = True

    # -- set-up ----------------------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model.to(self.env.device)
        self.wrapped = _EngineCall(self)
        return self.wrapped

    def build_optimizer(self, groups: list[dict[str, Any]], factory: OptimizerFactory) -> torch.optim.Optimizer:
        import deepspeed  # optional extra: deepspeed

        if self.env.device.type == "cpu":
            # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (minutes of C++ build) that only its
            # inference all-reduce uses; training collectives go through the torch process group (gloo) anyway.
            importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        optimizer = factory(groups)
        # A process group already exists (torchrun + init_distributed): the engine joins it.
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=self.config,
                                                    dist_init_required=False)
        self.optimizer = optimizer  # the trainer's LambdaLR drives the lr of the optimiser the engine steps
        return self.optimizer

    @property
    def _flat(self) -> list[nn.Parameter]:
        sigma = getattr(self.model, "sigma", None)
        return [sigma.flat] if sigma is not None else []

    # -- the step --------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        self.sync_buffers()  # rank 0's running statistics before every forward, as DDP does
        self._last = last
        if self.zero_stage == 3 and self._flat:
            import deepspeed  # optional extra: deepspeed

            with deepspeed.zero.GatheredParameters(self._flat, modifier_rank=None):
                yield
        else:
            yield

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the trainer already divided by grad_accum
        if not self._last:
            self.engine.step()  # not a boundary: the engine only counts the micro-step

    def step(self, clip_grad: float | None) -> float | None:
        self.engine.step()  # the accumulation boundary: reduce, clip (gradient_clipping), step, zero
        norm = self.engine.get_global_grad_norm() if clip_grad else None
        return None if norm is None else float(norm)

    def gathered(self) -> contextlib.AbstractContextManager[Any]:
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed  # optional extra: deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    # -- state -----------------------------------------------------------------------------------------------------
    def save_shards(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder), tag=TAG, save_latest=True)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("DeepSpeed checkpoints are the engine's own folders: use save_shards")

    def _universal(self, folder: Path) -> Path:
        """``folder``'s universal form, ``<folder>/universal`` (same tag): converted by rank 0 the first time (into a
        temporary folder renamed into place, so a crash never leaves half a conversion), then read by every rank."""
        target = folder / "universal"
        if self.env.is_main and not target.is_dir():
            from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal  # optional extra: deepspeed

            tmp = folder / ".universal.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            # inject_missing_state: the engine saved no Megatron-style universal_checkpoint_info; the defaults fit
            # a model without tensor or pipeline parallelism
            ds_to_universal(Namespace(input_folder=str(folder / TAG), output_folder=str(tmp / TAG),
                                      num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                      strict=True, inject_missing_state=True))
            replace_folder(tmp, target)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return target

    def load_state_dict(self, state: dict[str, Any]) -> None:
        folder = state.get(FOLDER_KEY)
        if folder is None or state.get("format") != "deepspeed":
            raise UsageError("strategy.name=deepspeed resumes from its own checkpoint folders; this checkpoint was "
                             "written by another strategy: resume it with that strategy")
        # another ZeRO stage, or stage 3 on another world size, was refused from the checkpoint's metadata
        # (resume.check_same_run)
        if self.universal:
            folder = self._universal(Path(folder))
        path, _ = self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:  # an invariant: check_folder vetted the folder before the engine reads it
            raise RuntimeError(f"DeepSpeed could not load its checkpoint from {folder}")
