"""The training loop: ``torchrun --nproc_per_node=N -m sigmanens_dist.train --config configs/demo.yaml [key=value…]``.

Read it top to bottom: set-up (config → data → model → strategy → optimiser → resume → tracking), then the step loop
(member task losses + λ·L_div, accumulation, clipping, schedule, EMA), with evaluation, checkpoints and preemption
handled between steps. Exit status 0 when done, ``EXIT_PREEMPTED`` (75) after a signal-triggered checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from sigmanens_dist.checkpoint import EXIT_PREEMPTED, CheckpointManager, PreemptionFlag, capture_rng, restore_rng
from sigmanens_dist.config import Config, flatten, load_config, save_config
from sigmanens_dist.data.loaders import Data, TrainStream, build_data
from sigmanens_dist.distributed import DistEnv, all_gather_object, any_rank, init_distributed
from sigmanens_dist.ema import EMA
from sigmanens_dist.ensemble import SigmaEnsemble, map_tensors
from sigmanens_dist.metrics import EnsembleMetrics, reliability_diagram
from sigmanens_dist.models import build_model, param_groups
from sigmanens_dist.strategies import build_strategy
from sigmanens_dist.tracking import Tracker, git_commit

__all__ = ["Position", "main", "run"]

log = logging.getLogger("sigmanens")


@dataclass
class Position:
    """Where the run is: optimiser steps taken, and the next micro-batch as (epoch, batch within the epoch)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def run(cfg: Config) -> int:
    env = init_distributed(cfg.strategy.backend)
    _setup_logging(env)
    run_dir = Path(cfg.run_dir)
    ckpt = CheckpointManager(run_dir, cfg.checkpoint.keep_last)
    if cfg.checkpoint.resume == "none" and ckpt.checkpoints():
        raise FileExistsError(f"run_dir={run_dir} already holds checkpoints of an earlier run; continue it with "
                              "checkpoint.resume=auto (or --resume auto), or start this one in a new run_dir")
    if cfg.train.amp == "fp16" and env.device.type != "cuda":
        raise ValueError("train.amp=fp16 needs a CUDA device (GradScaler); use bf16 or none on CPU")

    # -- data ----------------------------------------------------------------------------------------------------
    data = build_data(cfg, env)
    micro_per_step = cfg.train.grad_accum
    total_steps = cfg.train.max_steps or cfg.train.epochs * len(data.train) // micro_per_step
    if total_steps < 1:
        raise ValueError(f"train.epochs={cfg.train.epochs} gives no optimiser step: an epoch has {len(data.train)} "
                         f"batches per rank and train.grad_accum={micro_per_step}")

    # -- model, strategy, optimiser (model init is identical on every rank; later randomness is per rank) ---------
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data.num_classes, data.in_chans, data.vocab_size)
    torch.manual_seed(cfg.seed + env.rank)
    strategy = build_strategy(cfg.strategy.name, env)
    wrapped = strategy.wrap(model)
    model = strategy.unwrap(wrapped)
    optimizer = _optimizer(cfg, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(cfg, total_steps))
    scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.train.amp == "fp16")
    ema = EMA(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    mixup = _mixup(cfg, data.num_classes)

    # -- resume --------------------------------------------------------------------------------------------------
    # Rank 0 picks the checkpoint (skipping unreadable ones) and every rank loads that very file.
    pos, run_id = Position(), None
    loaded = ckpt.load(cfg.checkpoint.resume) if env.is_main else None
    path = all_gather_object(None if loaded is None else loaded[1], env)[0]
    if path is not None:
        state = loaded[0] if env.is_main else ckpt.read(path)
        try:
            strategy.load_model_state(wrapped, state["model"])
        except RuntimeError as err:
            raise RuntimeError(f"cannot resume from {path}: it does not match this model ({err})") from err
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        if len(state["rng"]) != env.world_size:
            raise RuntimeError(f"{path} was written by {len(state['rng'])} ranks, this run has {env.world_size}; "
                               "exact resume needs the same world size")
        restore_rng(state["rng"][env.rank])
        pos, run_id, ckpt.best_metric = Position(**state["position"]), state.get("mlflow_run_id"), state.get("best")
        if env.is_main:
            log.info("resumed from %s at step %d (epoch %d, batch %d)", path, pos.step, pos.epoch, pos.batch)

    # -- tracking ------------------------------------------------------------------------------------------------
    tracker = Tracker(run_dir, enabled=cfg.tracking.enabled, active=env.is_main, uri=cfg.tracking.uri,
                      experiment=cfg.tracking.experiment)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        n_params = sum(p.numel() for p in model.parameters())
        tags = {"git_commit": git_commit(), "num_members": str(model.num_members), "tau": str(cfg.reg.tau),
                "strategy": cfg.strategy.name, "world_size": str(env.world_size), "params": str(n_params),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "model": cfg.model.name,
                "ensemble": str(cfg.model.ensemble)}
        run_id = tracker.start(cfg.tracking.run_name or run_dir.name, run_id, flatten(cfg), tags)
        tracker.log_artifact(run_dir / "config.yaml")
    run_id = all_gather_object(run_id, env)[0]

    def save(metric: float | None = None) -> None:
        rng = all_gather_object(capture_rng(), env)
        if env.is_main:
            ckpt.save({"model": strategy.model_state(wrapped), "optimizer": optimizer.state_dict(),
                       "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                       "ema": None if ema is None else ema.state_dict(), "rng": rng, "position": asdict(pos),
                       "config": cfg.model_dump(mode="json"), "mlflow_run_id": run_id}, pos.step, metric)
        if env.distributed:
            dist.barrier()

    def evaluate(final: bool = False) -> dict[str, float]:
        scored = ema.module if ema is not None else model
        metrics = _evaluate(scored, data, cfg, env, run_dir if final else None)
        if isinstance(scored, SigmaEnsemble):
            metrics["sharing/members_on"] = scored.sharing()["all"]
        tracker.log_metrics({f"val/{k}": v for k, v in metrics.items()}, pos.step)
        return metrics

    # -- the loop ------------------------------------------------------------------------------------------------
    preempt = PreemptionFlag()
    batches = _micro_batches(data.train, pos)
    autocast = _autocast(cfg, env)
    bar = tqdm(total=total_steps, initial=pos.step, disable=not env.is_main, desc="train", dynamic_ncols=True,
               unit="step")
    seen, window = 0, 0.0  # images and training seconds since the last log line (eval and checkpoints excluded)
    train_seconds, train_samples = 0.0, 0
    wrapped.train()
    while pos.step < total_steps:
        t_step, epoch_at_start = time.perf_counter(), pos.epoch
        stats = torch.zeros(3, device=env.device)
        for micro in range(micro_per_step):
            (x, y), pos.epoch, pos.batch = next(batches)
            x = map_tensors(x, lambda t: t.to(env.device, non_blocking=True))  # images, or tokenizer tensors
            y = y.to(env.device, non_blocking=True)
            if mixup is not None:
                x, y = mixup(x, y)
            sync = contextlib.nullcontext() if micro == micro_per_step - 1 else strategy.no_sync(wrapped)
            with sync:
                with autocast:
                    logits = wrapped(x)  # (M, B, K)
                    task = _member_loss(logits, y, cfg.train.label_smoothing)
                    div = model.diversity_loss(cfg.reg.tau)
                    loss = task + cfg.reg.lam * div
                scaler.scale(loss / micro_per_step).backward()
            stats += torch.stack([loss.detach(), task.detach(), div.detach()]).float() / micro_per_step
            seen += y.shape[0] * env.world_size
        if cfg.train.clip_grad:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]  # the rate this step used
        scheduler.step()
        if ema is not None:
            ema.update(model)
        pos.step += 1
        step_seconds = time.perf_counter() - t_step
        window += step_seconds
        train_seconds += step_seconds
        train_samples += micro_per_step * cfg.train.batch_size * env.world_size

        bar.update(1)
        if pos.step % cfg.train.log_every_steps == 0 or pos.step == total_steps:
            rate = seen / max(window, 1e-9)
            seen, window = 0, 0.0
            if env.distributed:  # report the global-batch loss, not rank 0's share of it
                dist.all_reduce(stats)
                stats /= env.world_size
            loss_v, task_v, div_v = stats.tolist()
            bad = torch.tensor([data.bad.count], dtype=torch.float64, device=env.device)
            if env.distributed:
                dist.all_reduce(bad)
            row = {"data/bad_samples": bad.item(), "train/loss": loss_v, "train/task_loss": task_v,
                   "train/div_loss": div_v,
                   "train/lr": lr, "train/img_per_s": rate, "train/epoch": pos.epoch}
            tracker.log_metrics(row, pos.step)
            bar.set_postfix(loss=f"{row['train/loss']:.3f}", img_s=f"{rate:.0f}")

        if pos.step < total_steps:  # the final step is evaluated and saved after the loop
            epoch_done = pos.epoch != epoch_at_start  # this step crossed an epoch boundary
            nll = None
            if _due(pos.step, cfg.train.eval_every_steps, epoch_done):
                nll = evaluate()["nll"]
                wrapped.train()
            if _due(pos.step, cfg.checkpoint.every_steps, epoch_done):
                save(nll)
        if any_rank(preempt.raised, env):
            save()
            bar.close()
            tracker.finish("KILLED")
            if env.is_main:
                log.warning("checkpointed at step %d after a signal; exiting with status %d", pos.step,
                            EXIT_PREEMPTED)
            return EXIT_PREEMPTED

    bar.close()
    metrics = evaluate(final=True)
    save(metrics.get("nll"))
    if env.is_main:
        metrics["params"] = float(sum(p.numel() for p in model.parameters()))
        metrics["train_img_per_s"] = train_samples / max(train_seconds, 1e-9)
        (run_dir / "final_metrics.json").write_text(json.dumps(metrics, indent=2))
        tracker.log_final(metrics, pos.step)
        tracker.log_artifact(run_dir / "reliability.png")
        _print_summary(metrics, model.num_members)
    tracker.finish("FINISHED")
    return 0


# -- pieces of the loop ------------------------------------------------------------------------------------------
def _due(step: int, every: int | None, epoch_done: bool) -> bool:
    """Every ``every`` steps, or at each epoch end when ``every`` is None."""
    return step % every == 0 if every else epoch_done


def _member_loss(logits: torch.Tensor, y: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Mean over members of each member's task loss (hard labels, or soft labels from mixup)."""
    m = logits.shape[0]
    flat = logits.float().flatten(0, 1)
    if y.ndim == 2:  # soft targets
        return torch.sum(-y.repeat(m, 1) * F.log_softmax(flat, dim=-1), dim=-1).mean()
    return F.cross_entropy(flat, y.repeat(m), label_smoothing=smoothing)


def _micro_batches(stream: TrainStream, pos: Position) -> Iterator[tuple[Any, int, int]]:
    """Micro-batches forever, each with the position of the one after it (what a checkpoint must record)."""
    epoch, start = pos.epoch, pos.batch
    while True:
        for i, batch in enumerate(stream.iter_epoch(epoch, start), start=start + 1):
            yield (batch, epoch + 1, 0) if i == len(stream) else (batch, epoch, i)
        epoch, start = epoch + 1, 0


@torch.no_grad()
def _evaluate(model: nn.Module, data: Data, cfg: Config, env: DistEnv, plot_dir: Path | None) -> dict[str, float]:
    model.eval()
    metrics = EnsembleMetrics(data.num_classes, model.num_members).to(env.device)
    probs, targets = [], []
    with _autocast(cfg, env):
        for x, y in data.val():
            x, y = map_tensors(x, lambda t: t.to(env.device)), y.to(env.device)
            logits = model(x).float()
            metrics.update(logits, y)
            if plot_dir is not None:
                probs.append(logits.softmax(-1).mean(0).cpu())
                targets.append(y.cpu())
    out = metrics.compute()
    if plot_dir is not None:
        # A rank with no validation samples (more ranks than val shards or samples) still joins the gather.
        mine = ((torch.cat(probs), torch.cat(targets)) if probs else
                (torch.empty(0, data.num_classes), torch.empty(0, dtype=torch.int64)))
        gathered = all_gather_object(mine, env)
        if env.is_main:
            p = torch.cat([g[0] for g in gathered])
            t = torch.cat([g[1] for g in gathered])
            torch.save({"probs": p, "targets": t}, plot_dir / "val_predictions.pt")
            reliability_diagram(p, t, plot_dir / "reliability.png", title=f"{cfg.model.name} M={model.num_members}")
    return out


def _optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.optim.weight_decay)
    if cfg.optim.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=cfg.optim.momentum, nesterov=cfg.optim.nesterov)
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))


def _warmup_cosine(cfg: Config, total: int):
    warm, floor = cfg.schedule.warmup_steps, cfg.schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if cfg.schedule.name == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _mixup(cfg: Config, num_classes: int):
    if not (cfg.train.mixup_alpha or cfg.train.cutmix_alpha):
        return None
    from timm.data import Mixup

    return Mixup(mixup_alpha=cfg.train.mixup_alpha, cutmix_alpha=cfg.train.cutmix_alpha,
                 label_smoothing=cfg.train.label_smoothing, num_classes=num_classes)


def _autocast(cfg: Config, env: DistEnv) -> contextlib.AbstractContextManager[Any]:
    if cfg.train.amp == "none":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if cfg.train.amp == "bf16" else torch.float16
    return torch.autocast(env.device.type, dtype=dtype)


def _print_summary(metrics: dict[str, float], m: int) -> None:
    keys = ["acc", "nll", "ece", "brier", "disagreement"]
    print("\nfinal evaluation (ensemble = mean of member softmaxes):")
    print("  " + "  ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))
    for i in range(m if m > 1 else 0):
        print(f"  member {i}: " + "  ".join(f"{k}={metrics[f'member{i}/{k}']:.4f}" for k in ("acc", "nll", "ece")))


def _setup_logging(env: DistEnv) -> None:
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"[%(asctime)s rank{env.rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sigmanens_dist.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, help="YAML recipe (default: built-in defaults)")
    parser.add_argument("--resume", help="'auto', 'none' or a checkpoint path (overrides checkpoint.resume)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_members=8 reg.tau=0.25")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    try:
        return run(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
