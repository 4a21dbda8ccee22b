"""The trainer, run by ``sigmanens train`` or ``torchrun --nproc_per_node=N -m sigmanens_dist.train --config
configs/demo.yaml [key=value…]`` (:mod:`sigmanens_dist.train`, the command's module: this one imports nothing from
``cli/``).

Read :class:`Trainer` top to bottom: ``__init__`` sets up (distributed env → checkpoint to resume → data → model →
strategy → optimiser and schedule → restored state → tracking), ``train_step`` runs one optimiser step over
``grad_accum`` micro-batches, ``evaluate`` scores the validation set, ``save`` writes a checkpoint, ``fit`` loops
until the budget is spent or a signal arrives. What differs between DDP, FSDP2 and ZeRO (wrapping, the optimiser,
backward with accumulation, unscale + clip + step, model/optimiser state) belongs to the :class:`Strategy`.

Exit status 0 when done, ``EXIT_PREEMPTED`` (75) after a signal-triggered checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from timm.data import Mixup
from torch import nn

from sigmanens_dist.atomic import write_text
from sigmanens_dist.checkpoint import BatchLayout, CheckpointManager, Position, TrainerState, resolve_checkpoint
from sigmanens_dist.config import Config, flatten, save_config
from sigmanens_dist.data.loaders import Data, TrainStream, build_data
from sigmanens_dist.data.member_streams import member_major, member_train_stream
from sigmanens_dist.distributed.env import DistEnv, all_gather_object, init_distributed
from sigmanens_dist.distributed.strategies import build_strategy, strategy_class, strategy_options
from sigmanens_dist.errors import USAGE_MARKER, RunExistsError, UsageError
from sigmanens_dist.evaluation import run_eval
from sigmanens_dist.evaluation.metrics import EnsembleMetrics
from sigmanens_dist.evaluation.plots import reliability_diagram
from sigmanens_dist.methods import map_tensors
from sigmanens_dist.models import build_model, load_trained
from sigmanens_dist.progress import progress
from sigmanens_dist.storage.traffic import TRAFFIC
from sigmanens_dist.training.ema import build_ema
from sigmanens_dist.training.objective import loss_reduction, member_loss
from sigmanens_dist.training.optim import build_optimizer, fast_weight_lr, param_groups, sigma_lr, warmup_cosine
from sigmanens_dist.training.preemption import (
    EXIT_PREEMPTED,
    PreemptionCheck,
    PreemptionFlag,
    clear_marker,
    write_marker,
)
from sigmanens_dist.training.resume import check_same_run
from sigmanens_dist.training.rng import capture_rng, restore_rng
from sigmanens_dist.training.run_lock import own_run_dir
from sigmanens_dist.training.throughput import Throughput
from sigmanens_dist.training.tracking import Tracker, git_commit

__all__ = ["USAGE_MARKER", "Trainer", "fit"]

log = logging.getLogger("sigmanens")


class Trainer:
    """One training run, from a validated :class:`Config`."""

    def __init__(self, cfg: Config) -> None:
        self.env = env = init_distributed(cfg.strategy.backend,
                                          group_of_one=strategy_class(cfg.strategy.name).needs_process_group)
        _setup_logging(env)
        _quiet_known_warnings()
        self.run_dir = Path(cfg.run_dir)
        self.lock = own_run_dir(self.run_dir, env)  # before anything in the run directory is read or written
        try:
            self._set_up(cfg)
        except BaseException:
            self.release()
            raise

    def _set_up(self, cfg: Config) -> None:
        env = self.env
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last)
        if cfg.checkpoint.resume == "none" and self.ckpt.checkpoints():
            raise RunExistsError(f"run_dir={self.run_dir} already holds checkpoints of an earlier run; continue it "
                                  "with checkpoint.resume=auto (or --resume auto), or start this one in a new run_dir")
        if cfg.train.amp == "fp16" and env.device.type != "cuda":
            raise UsageError("train.amp=fp16 needs a CUDA device (GradScaler); use bf16 or none on CPU")

        # -- the checkpoint to resume, read before anything is built: it may change the per-rank batch ------------
        resumed, resumed_path = self._pick_checkpoint(cfg)
        self.layout = BatchLayout(cfg.train.batch_size, env.world_size, cfg.train.grad_accum)
        if resumed is not None:
            self.layout = check_same_run(resumed, cfg, self.layout)
            cfg = cfg.model_copy(update={"train": cfg.train.model_copy(
                update={"batch_size": self.layout.per_rank, "grad_accum": self.layout.grad_accum})})
        self.cfg = cfg

        # -- data ------------------------------------------------------------------------------------------------
        self.data: Data = build_data(cfg.data, cfg.train.batch_size, cfg.seed, env, cfg.train.randaugment,
                                     cfg.train.augmix)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * len(self.data.train) // cfg.train.grad_accum
        if self.total_steps < 1:
            raise UsageError(f"train.epochs={cfg.train.epochs} gives no optimiser step: an epoch has "
                             f"{len(self.data.train)} batches per rank and train.grad_accum={cfg.train.grad_accum}")

        # -- model, strategy, optimiser (model init is identical on every rank; later randomness is per rank) -------
        torch.manual_seed(cfg.seed)
        # Pretrained or source weights are read on rank 0 only: wrapping gives every rank rank 0's model (Strategy).
        # A resumed run's weights come from its checkpoint.
        if cfg.model.init_from and resumed is None:
            resolve_checkpoint(cfg.model.init_from, "model.init_from")  # every rank: a missing source fails on all
        built = cfg if env.is_main and resumed is None else cfg.without_source_weights()
        model = build_model(built, self.data.num_classes, self.data.in_chans, self.data.vocab_size)
        self.data = member_train_stream(cfg, env, self.data, model)  # member-major when members read their own data
        self.member_major = member_major(cfg, model)
        if cfg.eval.at_end:  # hook: refuse bad eval options now, not after training (sigmanens_dist/evaluation)
            from sigmanens_dist.evaluation.run import check_options
            check_options(cfg, model, cfg.eval)
        torch.manual_seed(cfg.seed + env.rank)
        if cfg.train.compile:
            model.compile(backend=cfg.train.compile_backend)  # in place: the module, its keys and hooks stay
            log.info("model compiled with torch.compile(backend=%r)", cfg.train.compile_backend)
        elastic = resumed is not None and len(resumed.rng) != env.world_size  # written at another world size
        self.strategy = build_strategy(cfg.strategy.name, env, amp=cfg.train.amp,
                                       options=strategy_options(cfg, elastic=elastic))
        self.wrapped = self.strategy.wrap(model)
        self.model = self.strategy.model
        groups = param_groups(self.model, cfg.optim.weight_decay, sigma_lr(cfg.optim, self.model),
                              fast_weight_lr(cfg.optim))
        self.optimizer = self.strategy.build_optimizer(groups, lambda groups: build_optimizer(cfg.optim, groups))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           warmup_cosine(cfg.schedule, self.total_steps))
        self.ema = build_ema(self.strategy, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.mixup = _mixup(cfg, self.data.num_classes)
        self.pos, run_id = Position(), None
        if resumed is not None:
            run_id = self._load(resumed, resumed_path)

        # -- tracking --------------------------------------------------------------------------------------------
        self.tracker = Tracker(self.run_dir, enabled=cfg.tracking.enabled, active=env.is_main, uri=cfg.tracking.uri,
                               experiment=cfg.tracking.experiment)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            clear_marker(self.run_dir)  # a marker from an earlier preemption is stale once this run starts
            (self.run_dir / USAGE_MARKER).unlink(missing_ok=True)  # so is an earlier attempt's refusal
            save_config(cfg, self.run_dir / "config.yaml")
            self.tracker.keep_records_to(self.pos.step)  # an earlier attempt's steps after the checkpoint go
            run_id = self.tracker.start(cfg.tracking.run_name or self.run_dir.name, run_id, flatten(cfg),
                                        self._tags())
            if resumed is not None:
                self.tracker.resumed(self.pos.step)
            self.tracker.log_artifact(self.run_dir / "config.yaml")
        self.run_id = all_gather_object(run_id, env)[0]

    def release(self) -> None:
        """Give the run directory up (the end of :meth:`fit`, or a failed set-up)."""
        if self.lock is not None:
            self.lock.release()

    # -- resume ----------------------------------------------------------------------------------------------------
    def _pick_checkpoint(self, cfg: Config) -> tuple[TrainerState | None, Path | None]:
        """Rank 0 picks the checkpoint (skipping unreadable ones) and every rank loads that very file."""
        loaded = self.ckpt.load(cfg.checkpoint.resume) if self.env.is_main else None
        path = all_gather_object(None if loaded is None else loaded[1], self.env)[0]
        if path is None:
            return None, None
        return (loaded[0] if self.env.is_main else TrainerState.read(path)), path

    def _load(self, state: TrainerState, path: Path) -> str | None:
        try:
            self.strategy.load_state_dict(state.strategy)
        except RuntimeError as err:  # a bug: check_same_run refused any checkpoint of another config before
            raise RuntimeError(f"cannot resume from {path}: it does not match this model ({err})") from err
        self.scheduler.load_state_dict(state.scheduler)
        if self.ema is not None and state.ema is not None:  # a folder strategy restores it with the shards
            self.ema.load_state_dict(state.ema, self.model)
        if len(state.rng) == self.env.world_size:
            restore_rng(state.rng[self.env.rank])
        elif self.env.is_main:
            warnings.warn(f"{path} was written by {len(state.rng)} ranks and this run has {self.env.world_size}: "
                          "the data continues at the same global sample, but per-rank random streams (dropout, "
                          "drop-path) restart and BatchNorm normalises each rank's share of the batch (now of "
                          "another size), so the continuation is not identical to an uninterrupted run; with "
                          "LayerNorm/GroupNorm backbones and no dropout it is equal to float precision",
                          stacklevel=1)
        self.pos, self.ckpt.best_metric = state.position, state.best
        if self.env.is_main:
            log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.pos.step, self.pos.epoch,
                     self.pos.batch)
        return state.run_id

    def _tags(self) -> dict[str, str]:
        cfg, env = self.cfg, self.env
        return {"git_commit": git_commit(), "num_members": str(self.model.num_members), "tau": str(cfg.reg.tau),
                "strategy": cfg.strategy.name, "world_size": str(env.world_size),
                "params": str(_num_params(self.model)),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID", ""), "model": cfg.model.name,
                "method": cfg.model.method}

    # -- one optimiser step ----------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator[tuple[Any, int, int]]) -> torch.Tensor:
        """``grad_accum`` micro-batches, then one optimiser step; returns (loss, task, div) averaged over them."""
        cfg, env, accum = self.cfg, self.env, self.cfg.train.grad_accum
        stats = torch.zeros(3, device=env.device)
        for micro in range(accum):
            (x, y), self.pos.epoch, self.pos.batch = next(batches)
            x = map_tensors(x, lambda t: t.to(env.device, non_blocking=True))  # images, or tokenizer tensors
            y = y.to(env.device, non_blocking=True)
            if self.mixup is not None:
                x, y = self.mixup(x, y)
            with self.strategy.micro_batch(last=micro == accum - 1):
                with self.strategy.autocast():
                    logits = self.wrapped(x, member_major=self.member_major)  # (M, B, K)
                    task = member_loss(logits, y, cfg.train.label_smoothing, loss_reduction(cfg.train, self.model))
                div = self.model.aux_loss(cfg.reg)  # σN-Ens: λ·L_div (fp32, out of autocast); other methods: 0
                loss = task + div
                self.strategy.backward(loss / accum)
            stats += torch.stack([loss.detach(), task.detach(), div.detach()]).float() / accum
        self.strategy.step(cfg.train.clip_grad)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.model)
        self.pos.step += 1
        return stats

    # -- evaluation and checkpoints --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, final: bool = False) -> dict[str, float]:
        """Ensemble and per-member metrics on the validation pass (the EMA weights when EMA is on); on the final
        evaluation also the predictions and the reliability diagram."""
        self.strategy.sync_buffers()  # every rank scores the same running statistics
        probs, targets = [], []
        weights = self.ema.scored(self.model) if self.ema is not None else contextlib.nullcontext(self.model)
        with weights as scored, self.strategy.gathered(), self.strategy.autocast():
            scored.eval()
            metrics = EnsembleMetrics(self.data.num_classes, scored.num_members).to(self.env.device)
            for x, y in self.data.val():
                x, y = map_tensors(x, lambda t: t.to(self.env.device)), y.to(self.env.device)
                logits = scored(x).float()
                metrics.update(logits, y)
                if final:
                    probs.append(logits.softmax(-1).mean(0).cpu())
                    targets.append(y.cpu())
            extra = scored.extra_metrics()  # reads the σ parameters: inside gathered()
        out = metrics.compute()
        out.update(extra)
        if final:
            self._write_predictions(probs, targets, scored.num_members)
        self.tracker.log_metrics({f"val/{k}": v for k, v in out.items()}, self.pos.step)
        self.wrapped.train()
        return out

    def _write_predictions(self, probs: list[torch.Tensor], targets: list[torch.Tensor], members: int) -> None:
        # A rank with no validation samples (more ranks than val shards or samples) still joins the gather.
        mine = ((torch.cat(probs), torch.cat(targets)) if probs else
                (torch.empty(0, self.data.num_classes), torch.empty(0, dtype=torch.int64)))
        gathered = all_gather_object(mine, self.env)
        if self.env.is_main:
            p, t = torch.cat([g[0] for g in gathered]), torch.cat([g[1] for g in gathered])
            torch.save({"probs": p, "targets": t}, self.run_dir / "val_predictions.pt")
            reliability_diagram(p, t, self.run_dir / "reliability.png", title=f"{self.cfg.model.name} M={members}")

    def save(self, metric: float | None = None) -> float:
        """Checkpoint model, optimiser, schedule, EMA, every rank's RNG, the data position and the batch layout;
        returns the seconds it took (users size their preemption margin with it)."""
        start = time.perf_counter()
        rng = all_gather_object(capture_rng(), self.env)
        self.strategy.sync_buffers()
        state = TrainerState(
            config=self.cfg.model_dump(mode="json"), position=self.pos, layout=self.layout, rng=rng,
            scheduler=self.scheduler.state_dict(),
            # what `sigmanens export` rebuilds the model with
            model_args={"num_classes": self.data.num_classes, "in_chans": self.data.in_chans,
                        "vocab_size": self.data.vocab_size},
            # sharded parameters (FSDP2) keep their EMA shadows with the shards; the others here
            ema=None if self.ema is None or self.strategy.sharded_parameters else self.ema.state_dict(self.model),
            run_id=self.run_id, format=self.strategy.checkpoint_format)
        self.strategy.save_checkpoint(self.ckpt, state.to_dict(), self.pos.step, metric, self._barrier)
        return time.perf_counter() - start

    def _barrier(self) -> None:
        if self.env.distributed:
            dist.barrier()

    # -- the loop --------------------------------------------------------------------------------------------------
    def fit(self) -> int:
        """Train to the budget; returns 0, or ``EXIT_PREEMPTED`` after a signal-triggered checkpoint."""
        try:
            with PreemptionFlag() as flag:
                status = self._loop(PreemptionCheck(flag, self.env))
        except BaseException:
            self.tracker.finish("FAILED")
            raise
        finally:
            self.release()
        self.tracker.finish("KILLED" if status == EXIT_PREEMPTED else "FINISHED")
        return status

    def _loop(self, preempt: PreemptionCheck) -> int:
        cfg, env, pos = self.cfg, self.env, self.pos
        batches = _micro_batches(self.data.train, pos)
        bar = progress(total=self.total_steps, initial=pos.step, disable=not env.is_main, desc="train", unit="step")
        window = Throughput(env.device)  # on a GPU, steps timed by CUDA events: to their kernels' end
        if pos.step == 0:  # where the trajectories start: the method's extras (σN-Ens: the sharing) at init
            with self.strategy.gathered():
                start = self.model.extra_metrics()
            if start:
                self.tracker.log_metrics({f"val/{k}": v for k, v in start.items()}, 0)
        self.wrapped.train()
        while pos.step < self.total_steps:
            t_step, epoch_at_start = window.start(), pos.epoch
            lr = self.scheduler.get_last_lr()[0]  # the rate this step uses
            stats = self.train_step(batches)
            window.stop(t_step, self.layout.global_batch)
            bar.update(1)
            if pos.step % cfg.train.log_every_steps == 0 or pos.step == self.total_steps:
                row = self._train_row(stats, lr, window)
                self.tracker.log_metrics(row, pos.step)
                if (remote := TRAFFIC.line()) is not None:  # shards streamed from a URL root: MB/s, in flight
                    log.info("%s", remote)
                bar.set_postfix(task=f"{row['train/task_loss']:.3f}", div=f"{row['train/div_loss']:.3g}",
                                img_s=f"{row['train/img_per_s']:.0f}")
            if pos.step < self.total_steps:  # the final step is evaluated and saved after the loop
                epoch_done = pos.epoch != epoch_at_start  # this step crossed an epoch boundary
                nll = None
                if _due(pos.step, cfg.train.eval_every_steps, epoch_done):
                    nll = self.evaluate()["nll"]
                if _due(pos.step, cfg.checkpoint.every_steps, epoch_done):
                    self.save(nll)
            if preempt.poll():
                preempt.drain()
                batches.close()  # the loaders' prefetching stops before the process exits
                seconds = self.save()
                bar.close()
                if env.is_main:
                    write_marker(self.run_dir, pos.step, preempt.signum)
                    self.tracker.log_metrics({"checkpoint/preempt_seconds": seconds}, pos.step)
                    log.warning("checkpointed at step %d after a signal (%.1f s); exiting with status %d", pos.step,
                                seconds, EXIT_PREEMPTED)
                return EXIT_PREEMPTED
        preempt.drain()
        batches.close()
        bar.close()
        metrics = self.evaluate(final=True)
        self.save(metrics.get("nll"))
        if env.is_main:
            metrics["params"] = float(_num_params(self.model))
            metrics["train_img_per_s"] = window.total_rate()
            write_text(self.run_dir / "final_metrics.json", json.dumps(metrics, indent=2))
            self.tracker.log_final(metrics, pos.step)
            self.tracker.log_artifact(self.run_dir / "reliability.png")
            _print_summary(metrics, self.model.num_members)
        if cfg.eval.at_end:
            self._evaluate_checkpoint(self.ckpt.checkpoints()[-1])
        return 0

    def _evaluate_checkpoint(self, path: Path) -> None:
        """The hook of ``eval.at_end``: ``sigmanens eval`` of the final checkpoint, as written (every strategy's
        format; a plain model, so sub-ensembles can copy it), every rank scoring its shard of each pass."""
        loaded = load_trained(path)
        ema = None if loaded.ema is None else loaded.ema.to(self.env.device)
        run_eval(self.cfg, loaded.model.to(self.env.device), ema, out_dir=self.run_dir / "eval", run_id=self.run_id,
                 step=self.pos.step, checkpoint=path, env=self.env)

    def _train_row(self, stats: torch.Tensor, lr: float, window: Throughput) -> dict[str, float]:
        """The log line: global-batch losses (not rank 0's share), lr, throughput, skipped samples."""
        counts = torch.cat([stats.double(), torch.tensor([float(self.data.bad.count)], dtype=torch.float64,
                                                         device=stats.device)])
        if self.env.distributed:
            dist.all_reduce(counts)
            counts[:3] /= self.env.world_size
        loss, task, div, bad = counts.tolist()
        return {"train/loss": loss, "train/task_loss": task, "train/div_loss": div, "train/lr": lr,
                "train/img_per_s": window.take_rate(), "train/epoch": self.pos.epoch, "data/bad_samples": bad}


# -- pieces of the step ------------------------------------------------------------------------------------------
def _due(step: int, every: int | None, epoch_done: bool) -> bool:
    """Every ``every`` steps, or at each epoch end when ``every`` is None."""
    return step % every == 0 if every else epoch_done


def _num_params(model: nn.Module) -> int:
    """Parameter count of the whole model, also when ZeRO-3 has partitioned it (``ds_numel`` is the full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def _micro_batches(stream: TrainStream, pos: Position) -> Iterator[tuple[Any, int, int]]:
    """Micro-batches forever, each with the position of the one after it (what a checkpoint must record)."""
    epoch, start = pos.epoch, pos.batch
    while True:
        for i, batch in enumerate(stream.iter_epoch(epoch, start), start=start + 1):
            yield (batch, epoch + 1, 0) if i == len(stream) else (batch, epoch, i)
        epoch, start = epoch + 1, 0


def _mixup(cfg: Config, num_classes: int) -> nn.Module | None:
    if not (cfg.train.mixup_alpha or cfg.train.cutmix_alpha):
        return None
    return Mixup(mixup_alpha=cfg.train.mixup_alpha, cutmix_alpha=cfg.train.cutmix_alpha,
                 label_smoothing=cfg.train.label_smoothing, num_classes=num_classes)


def _print_summary(metrics: dict[str, float], m: int) -> None:
    keys = ["acc", "nll", "ece", "brier", "disagreement"]
    print("\nfinal evaluation (ensemble = mean of member softmaxes):")
    print("  " + "  ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))
    for i in range(m if m > 1 else 0):
        print(f"  member {i}: " + "  ".join(f"{k}={metrics[f'member{i}/{k}']:.4f}" for k in ("acc", "nll", "ece")))


# Library warnings known to be benign here, silenced by their exact text (anything else still shows): each would
# otherwise repeat every step, on every rank, burying the log.
KNOWN_BENIGN_WARNINGS = (
    # FSDP2 on our root module: the (M, B, K) logits are a view of the batched output, never written in place
    (r"FSDP2-wrapped module \(FSDPSigmaEnsemble\) returned a view tensor\.", UserWarning),
    # DeepSpeed ZeRO's collectives, deprecated in torch for the *_single names (DeepSpeed 0.19 still calls them)
    (r"`torch\.distributed\.all_gather_into_tensor` is deprecated\.", FutureWarning),
    (r"`torch\.distributed\.reduce_scatter_tensor` is deprecated\.", FutureWarning),
)


def _quiet_known_warnings() -> None:
    for message, category in KNOWN_BENIGN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def _setup_logging(env: DistEnv) -> None:
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"[%(asctime)s rank{env.rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S")


def fit(cfg: Config) -> int:
    """Build the trainer for a checked config and train (:func:`sigmanens_dist.cli.train.main` reports a
    :class:`~sigmanens_dist.errors.UsageError`; any other exception, set-up included, keeps its traceback)."""
    return Trainer(cfg).fit()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
