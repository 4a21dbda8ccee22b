"""The strategy matrix, run inside ONE launch per world size (tests/distributed/test_sharded.py compares what it
writes).

    python strategy_matrix.py single OUT          world 1: the reference (batch 2B) and 1-rank FSDP/DDP runs
    torchrun --nproc_per_node 2 strategy_matrix.py two OUT
                                                  every strategy at batch B per rank, straight and resumed from its
                                                  mid-run checkpoint; the 1-rank runs resumed on 2 ranks; a BatchNorm
                                                  ResNet under FSDP: every rank's running statistics
    python strategy_matrix.py elastic OUT         world 1: the 2-rank DDP and FSDP checkpoints resumed on 1 rank
    torchrun --nproc_per_node 4 strategy_matrix.py hsdp OUT
                                                  HSDP: FSDP on a 2 × 2 mesh (2 replicas of 2 shards), batch B/2

Every run trains K=6 steps and checkpoints at step 3; a "resumed" run is a copy of a run directory cut back to its
step-3 checkpoint and continued with ``--resume auto``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sigmanens_dist.config import load_config
from sigmanens_dist.distributed.env import init_distributed
from sigmanens_dist.trainer import Trainer

TINY_VIT = ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=16", "model.kwargs.patch_size=4",
            "model.kwargs.depth=2", "model.kwargs.embed_dim=48", "model.kwargs.num_heads=2"]
# SGD: Adam turns fp-noise gradients into full steps (see tests/training/test_train.py); eval only at the end.
COMMON = [*TINY_VIT, "data.dataset=synthetic", "data.img_size=16", "data.train_subset=256", "data.val_subset=64",
          "data.num_workers=0", "optim.name=sgd", "optim.lr=0.05", "optim.momentum=0.9", "schedule.warmup_steps=2",
          "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=3", "train.log_every_steps=1",
          "reg.lam=0.01", "tracking.enabled=false", "train.clip_grad=5.0", "train.grad_accum=2"]
B = 4  # per-rank micro-batch on 2 ranks; the reference takes 2B on one
STRATEGIES = {
    "ddp": ["strategy.name=ddp"],
    "fsdp": ["strategy.name=fsdp"],
    "zero1": ["strategy.name=deepspeed", "strategy.zero_stage=1"],
    "zero2": ["strategy.name=deepspeed", "strategy.zero_stage=2"],
    "zero3": ["strategy.name=deepspeed", "strategy.zero_stage=3", "strategy.deepspeed_config={zero3}"],
}


def train(run_dir: Path, *overrides: str) -> Trainer:
    cfg = load_config(None, [*COMMON, f"run_dir={run_dir}", *overrides])
    trainer = Trainer(cfg)
    status = trainer.fit()
    assert status == 0, status
    return trainer


def cut_back(src: Path, dst: Path, rank: int) -> None:
    """``dst`` = ``src`` as it was right after its step-3 checkpoint (rank 0 copies; everyone waits)."""
    if rank == 0:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        for ckpt in (dst / "checkpoints").iterdir():
            if not ckpt.name.startswith("step_00000003"):
                shutil.rmtree(ckpt) if ckpt.is_dir() else ckpt.unlink()
    if dist.is_initialized():
        dist.barrier()


def bf16_dtypes(out: Path, rank: int) -> None:
    """FSDP2 with train.amp=bf16: the dtypes a σ layer inside a block sees during the forward, and of L_div."""
    import timm

    from sigmanens_dist import convert_to_sigma_ensemble
    from sigmanens_dist.distributed.strategies import build_strategy

    env = init_distributed("gloo")
    strategy = build_strategy("fsdp", env, amp="bf16")
    model = convert_to_sigma_ensemble(timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2,
                                                        embed_dim=48, num_heads=2, num_classes=10), 4)
    wrapped = strategy.wrap(model)
    seen: dict[str, str] = {}
    norm = model.backbone.blocks[0].norm1

    def hook(module, inputs) -> None:
        seen["flat"] = str(module.store.flat.dtype)
        seen["gate"] = str(module.gated_affine()[0].dtype)
        seen["block_weight"] = str(model.backbone.blocks[0].attn.qkv.weight.dtype)
        seen["block_input"] = str(inputs[0].dtype)

    norm.register_forward_pre_hook(hook)
    with strategy.autocast():
        wrapped(torch.randn(2, 3, 16, 16))
    seen["div"] = str(model.diversity_loss(0.5).dtype)
    if rank == 0:
        (out / "fsdp_bf16_dtypes.json").write_text(json.dumps(seen))


def pretrained_from_rank0(out: Path, rank: int) -> None:
    """``model.pretrained=true`` from a weights file: under each strategy only rank 0 reads it, and after set-up
    every rank holds its weights. Writes ``pretrained_rank<r>.json``: files read, and per strategy whether the
    shared weights equal the file's."""
    import timm
    import timm.models._builder as builder
    from torch.distributed.tensor import DTensor

    weights = out / "pretrained.pth"
    if rank == 0:
        torch.manual_seed(123)
        source = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=48,
                                   num_heads=2, num_classes=10)
        torch.save(source.state_dict(), weights)
    dist.barrier()
    expected = torch.load(weights)["blocks.0.attn.qkv.weight"]
    reads: list[str] = []
    read = builder.load_state_dict
    builder.load_state_dict = lambda path, *a, **k: reads.append(str(path)) or read(path, *a, **k)
    report: dict[str, object] = {}
    for name in ("ddp", "fsdp", *(["zero3"] if "zero3" in STRATEGIES else [])):
        opts = [o.format(zero3=out / "zero3.json") for o in STRATEGIES[name]]
        cfg = load_config(None, [*COMMON, *opts, f"run_dir={out / f'pretrained_{name}'}", f"train.batch_size={B}",
                                 "model.pretrained=true", f"model.kwargs.pretrained_cfg_overlay={{file: {weights}}}"])
        trainer = Trainer(cfg)
        with trainer.strategy.gathered():
            w = trainer.model.backbone.blocks[0].attn.qkv.weight
            w = w.full_tensor() if isinstance(w, DTensor) else w
            report[name] = bool(torch.equal(w.detach().cpu(), expected))
    builder.load_state_dict = read
    report["reads"] = len(reads)
    (out / f"pretrained_rank{rank}.json").write_text(json.dumps(report))


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    if phase == "single":
        train(out / "ref", "strategy.name=ddp", f"train.batch_size={2 * B}")
        train(out / "fsdp_w1", "strategy.name=fsdp", f"train.batch_size={2 * B}")
        return
    if phase == "hsdp":  # 4 ranks, a 2 × 2 mesh (replicas × shards), batch B / 2 per rank: the same global batch
        init_distributed("gloo")
        trainer = train(out / "hsdp", "strategy.name=fsdp", "strategy.fsdp_replicate=2", f"train.batch_size={B // 2}")
        qkv = trainer.model.backbone.blocks[0].attn.qkv.weight  # a DTensor on the 2-D mesh
        if rank == 0:
            (out / "hsdp_mesh.json").write_text(json.dumps({"mesh": list(qkv.device_mesh.shape),
                                                            "placements": [str(p) for p in qkv.placements],
                                                            "local_rows": qkv.to_local().shape[0],
                                                            "rows": qkv.shape[0]}))
        return
    if phase == "elastic":  # 2 ranks → 1: the recipe's per-rank batch B becomes 2B here
        for name in ("ddp", "fsdp"):
            cut_back(out / name, out / f"{name}_2to1", rank)
            train(out / f"{name}_2to1", *STRATEGIES[name], f"train.batch_size={B}", "checkpoint.resume=auto")
        return
    assert phase == "two", phase
    init_distributed("gloo")
    zero3 = out / "zero3.json"
    if rank == 0:
        zero3.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    dist.barrier()
    only = os.environ.get("MATRIX_ONLY")
    for name, opts in STRATEGIES.items():
        if only and name not in only.split(","):
            continue
        opts = [o.format(zero3=zero3) for o in opts]
        trainer = train(out / name, *opts, f"train.batch_size={B}")
        if name == "zero3" and rank == 0:  # the flat σ parameter really is partitioned: this rank holds half
            flat = trainer.model.sigma.flat
            (out / "zero3_flat.json").write_text(json.dumps({"local": flat.ds_tensor.numel(), "all": flat.ds_numel}))
        cut_back(out / name, out / f"{name}_resumed", rank)
        train(out / f"{name}_resumed", *opts, f"train.batch_size={B}", "checkpoint.resume=auto")
    if only:
        return
    for name, strategy in (("ref", "ddp"), ("fsdp_w1", "fsdp")):  # 1 rank → 2
        cut_back(out / name, out / f"{name}_1to2", rank)
        train(out / f"{name}_1to2", f"strategy.name={strategy}", f"train.batch_size={2 * B}",
              "checkpoint.resume=auto")
    bf16_dtypes(out, rank)
    # train.compile under FSDP2: the model is compiled before fully_shard wraps it (aot_eager: no C++ build in CI)
    train(out / "fsdp_compiled", *STRATEGIES["fsdp"], f"train.batch_size={B}", "train.compile=true",
          "train.compile_backend=aot_eager")
    # EMA: DDP's copy of the model, FSDP2's sharded shadows (also resumed from its DCP checkpoint), ZeRO-2's copy.
    ema = ["train.ema_decay=0.5", f"train.batch_size={B}"]
    for name in ("ddp", "fsdp", *(["zero2"] if "zero2" in STRATEGIES else [])):
        train(out / f"{name}_ema", *STRATEGIES[name], *ema)
    cut_back(out / "fsdp_ema", out / "fsdp_ema_resumed", rank)
    train(out / "fsdp_ema_resumed", *STRATEGIES["fsdp"], *ema, "checkpoint.resume=auto")
    pretrained_from_rank0(out, rank)  # last: its ZeRO-3 engine is set up but never trained
    # BatchNorm: running statistics are rank 0's on every rank at evaluation and in checkpoints. The run ends with
    # eval.at_end: `sigmanens eval` of its DCP checkpoint on both ranks, sub-ensembles included.
    bn = out / "fsdp_bn"
    cfg = load_config(None, [*[o for o in COMMON if not o.startswith("model.")], "model.name=resnet10t",
                             "strategy.name=fsdp", f"run_dir={bn}", f"train.batch_size={B}", "train.max_steps=3",
                             "eval.at_end=true", "data.test_subset=45"])
    trainer = Trainer(cfg)
    assert trainer.fit() == 0
    stats = trainer.model.sigma.running_stats.detach().clone()
    gathered = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stats)
    if rank == 0:
        torch.save({"stats": gathered, "units": trainer.strategy.units}, out / "fsdp_bn_stats.pt")


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
