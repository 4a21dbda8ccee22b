"""Run under torchrun: one DDP step of a σN-Ens on rank-specific data; saves the flat σ gradient of each rank,
after DDP's all-reduce and, for comparison, as computed locally without it."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import timm
import torch
import torch.distributed as dist

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.distributed.env import init_distributed
from sigmanens_dist.distributed.strategies import build_strategy

out = Path(sys.argv[1])
env = init_distributed("gloo")
torch.manual_seed(0)
model = convert_to_sigma_ensemble(timm.create_model("resnet10t", num_classes=5), 4, seed=0)
local = copy.deepcopy(model)
wrapped = build_strategy("ddp", env).wrap(model)
g = torch.Generator().manual_seed(100 + env.rank)
x, y = torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)
for m in (wrapped, local):
    logits = m(x)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.repeat(4))
    inner = m.module if hasattr(m, "module") else m
    (loss + 0.01 * inner.diversity_loss(0.5)).backward()
torch.save(model.sigma.flat.grad, out / f"grad_rank{env.rank}.pt")
torch.save(local.sigma.flat.grad, out / f"local_grad_rank{env.rank}.pt")
dist.destroy_process_group()
