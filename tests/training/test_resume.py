"""Resume rules: what may change, elastic batch adaptation, preemption signal handling, weight-decay groups."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import timm
import torch

from sigmanens_dist.checkpoint import BatchLayout, Position, TrainerState
from sigmanens_dist.config import load_config
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.training.optim import param_groups
from sigmanens_dist.training.preemption import PreemptionCheck, PreemptionFlag
from sigmanens_dist.training.resume import check_same_run
from tests.helpers import SYNTHETIC, TINY_VIT, losses, run_train

SYN = ["data.dataset=synthetic"]


def _state(*overrides: str, world: int = 2) -> TrainerState:
    cfg = load_config(None, [*SYN, *overrides])
    layout = BatchLayout(cfg.train.batch_size, world, cfg.train.grad_accum)
    return TrainerState(config=cfg.model_dump(mode="json"), position=Position(), layout=layout, rng=[{}] * world,
                        scheduler={}, model_args=None)


def _resume(state: TrainerState, *overrides: str, world: int) -> BatchLayout:
    cfg = load_config(None, [*SYN, *overrides])
    return check_same_run(state, cfg, BatchLayout(cfg.train.batch_size, world, cfg.train.grad_accum))


def test_same_run_same_world_keeps_layout() -> None:
    state = _state("train.batch_size=8", "train.grad_accum=2")
    assert _resume(state, "train.batch_size=8", "train.grad_accum=2", world=2) == BatchLayout(8, 2, 2)


def test_changed_run_keys_are_all_named() -> None:
    state = _state("model.num_members=4", "train.batch_size=8")
    with pytest.raises(ValueError) as err:
        _resume(state, "model.num_members=2", "model.name=resnet10t", "train.batch_size=4", world=2)
    text = str(err.value)
    assert "model.num_members: the checkpoint's run has 4, this config 2" in text
    assert "model.name: the checkpoint's run has 'resnet18', this config 'resnet10t'" in text
    assert "8 × 2 × 1 = 16" in text and "4 × 2 × 1 = 8" in text  # the global batch, both values


def test_the_calibration_split_is_part_of_the_run() -> None:
    """It takes its samples from the training set: changing it on resume would train on other samples."""
    state = _state("data.calib_split=100")
    with pytest.raises(ValueError, match=r"data.calib_split: the checkpoint's run has 100, this config 0"):
        _resume(state, world=2)
    before = _state()  # a checkpoint written before the key existed trained without a calibration split
    del before.config["data"]["calib_split"]
    assert _resume(before, world=2) == before.layout
    with pytest.raises(ValueError, match=r"data.calib_split: the checkpoint's run has 0, this config 5"):
        _resume(before, "data.calib_split=5", world=2)


def test_elastic_resume_adapts_per_rank_batch() -> None:
    state = _state("train.batch_size=8", "train.grad_accum=3", world=2)
    assert _resume(state, "train.batch_size=8", "train.grad_accum=3", world=1) == BatchLayout(16, 1, 3)
    assert _resume(state, "train.batch_size=8", "train.grad_accum=3", world=4) == BatchLayout(4, 4, 3)
    assert _resume(state, "train.batch_size=2", "train.grad_accum=3", world=8) == BatchLayout(2, 8, 3)  # user-set
    with pytest.raises(ValueError, match="world size that divides 16"):
        _resume(state, "train.batch_size=8", "train.grad_accum=3", world=3)
    with pytest.raises(ValueError, match=r"set train\.batch_size=4"):
        _resume(state, "train.batch_size=5", "train.grad_accum=3", world=4)


def test_budget_change_warns_about_the_schedule() -> None:
    state = _state("train.max_steps=100")
    with pytest.warns(UserWarning, match=r"train\.max_steps changed from 100 to 200"):
        _resume(state, "train.max_steps=200", world=2)


def test_preemption_flag_restores_previous_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionFlag() as flag:
        assert signal.getsignal(signal.SIGUSR1) == flag._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        check = PreemptionCheck(flag, DistEnv(0, 1, 0, torch.device("cpu")))
        assert flag.raised and flag.signum == signal.SIGUSR1 and check.poll()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_no_weight_decay_names_are_honoured() -> None:
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=1, num_classes=3)
    decay, other = param_groups(vit, 0.05)
    ids = {id(p) for p in other["params"]}
    assert id(vit.pos_embed) in ids and id(vit.cls_token) in ids
    assert id(vit.patch_embed.proj.weight) in {id(p) for p in decay["params"]}


@pytest.mark.slow
def test_elastic_resume_two_ranks_to_one_continues_at_the_same_global_sample(tmp_path: Path) -> None:
    # A LayerNorm ViT and SGD: one process at batch 16 computes what two ranks at batch 8 do (test_train.py), so
    # the continuation on one process must match the two-rank run step for step if it sees the same samples.
    common = [*TINY_VIT, *SYNTHETIC, "optim.name=sgd", "optim.lr=0.05", "train.log_every_steps=1",
              "train.max_steps=6", "checkpoint.every_steps=3", "checkpoint.keep_last=3", "train.batch_size=8"]
    run_train(tmp_path / "two", *common, nproc=2)
    proc = run_train(tmp_path / "one", *common, f"checkpoint.resume={tmp_path}/two/checkpoints/step_00000003.pt")
    assert "per-rank batch 8 → 16 keeps the global batch of 16" in proc.stderr
    assert "per-rank random streams" in proc.stderr
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(one) == [4, 5, 6]
    for step in one:
        assert one[step] == pytest.approx(two[step], rel=1e-4, abs=1e-5), step
