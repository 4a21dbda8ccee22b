"""Process-group set-up from torchrun's environment; a single process without torchrun is a world of one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sigmanens_dist.errors import UnsupportedError

__all__ = ["DistEnv", "all_gather_object", "init_distributed"]


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str = "auto", group_of_one: bool = False) -> DistEnv:
    """Join the process group torchrun describes (nccl on GPU, gloo on CPU, unless ``backend`` says otherwise).
    ``group_of_one``: also a single process gets a process group (of one rank, in-memory store), for libraries that
    need one whatever the world size (DeepSpeed's engine)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise UnsupportedError("strategy.backend=nccl needs CUDA GPUs, none is visible; use gloo (or auto) on CPU")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=30),
                                device_id=device if backend == "nccl" else None)
    elif group_of_one and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if backend == "nccl" else None)
    return DistEnv(rank, world, local_rank, device)


def all_gather_object(obj: Any, env: DistEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out
