"""Every checkpoint version this project has written still loads (:class:`TrainerState` reads them all): one
written before the package was laid out by role (commit 12546e3, v0.1.0: a 2-member σN-Ens ViT, 2 steps, with EMA)
predicts the same and resumes; one written by 0.3.0 (commit 83a17ec, before the trainer state was a record) resumes
bit-exactly; one of a later version is refused in one line. Nothing of the layout is pickled in a checkpoint, and
these fixtures keep it so."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sigmanens_dist.checkpoint import (
    CheckpointManager,
    LaterVersionError,
    TrainerState,
    consolidated_ema,
    consolidated_state_dict,
    read_checkpoint,
)
from sigmanens_dist.checkpoint.state import VERSION
from sigmanens_dist.export import load_model
from tests.helpers import FIXTURE, REPO, env, losses, run_train

CKPT = FIXTURE / "checkpoints" / "step_00000002.pt"
# A run written by 0.3.0 (config.yaml: a 1-block σN-Ens ViT with dropout, drop-path, EMA, 2 accumulated
# micro-batches): its step-2 checkpoint, mid-epoch, and in expected.json the losses of steps 3 and 4 and a digest of
# each tensor of step 4 (model and EMA) of its uninterrupted run.
FIXTURE_0_3 = REPO / "tests" / "fixtures" / "run_v0_3_0"


def test_old_checkpoint_predicts_what_it_predicted_when_written() -> None:
    expected = torch.load(FIXTURE / "expected_logits.pt", weights_only=True)  # the logits v0.1.0 computed
    with torch.no_grad():
        logits = load_model(CKPT)(expected["input"])
    assert logits.shape == (2, 3, 10)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-6)
    weights, state = consolidated_state_dict(CKPT)
    ema = consolidated_ema(CKPT, state)
    assert ema is not None and ema.keys() == weights.keys()


@pytest.mark.slow
def test_old_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    run_train(run, "--config", str(run / "config.yaml"), "train.max_steps=3", "checkpoint.resume=auto")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0].get("resumed_from_step") == 2
    assert [r["step"] for r in rows if "train/loss" in r] == [3]
    assert (run / "checkpoints" / "step_00000003.pt").is_file()


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16] for k, v in state.items()}


@pytest.mark.slow
def test_a_checkpoint_of_0_3_resumes_bit_exactly(tmp_path: Path) -> None:
    """Resumed by this code, 0.3.0's step-2 checkpoint continues bit-exactly as a checkpoint this code wrote at step 3
    does (the same steps, on this machine, to the bit: losses and every tensor of step 4, model and EMA), and to the
    losses 0.3.0's own uninterrupted run reached. Those were recorded on another CPU, whose kernels round the last
    bit differently (this machine: step 3's loss 1 ulp of float32 away): to float32 rounding, not the bit."""
    expected = json.loads((FIXTURE_0_3 / "expected.json").read_text())
    every = "checkpoint.every_steps=1"  # step 3 saved too: the checkpoint of this code to resume from
    old = tmp_path / "old"
    shutil.copytree(FIXTURE_0_3, old)
    assert TrainerState.read(old / "checkpoints" / "step_00000002.pt").version == 1  # it records no version
    run_train(old, "--config", str(old / "config.yaml"), "checkpoint.resume=auto", every)
    ours = tmp_path / "ours"
    shutil.copytree(FIXTURE_0_3, ours, ignore=shutil.ignore_patterns("checkpoints"))
    (ours / "checkpoints").mkdir()
    shutil.copy(old / "checkpoints" / "step_00000003.pt", ours / "checkpoints")
    run_train(ours, "--config", str(ours / "config.yaml"), "checkpoint.resume=auto", every)
    assert losses(old)[4] == losses(ours)[4]
    states = {name: consolidated_state_dict(run / "checkpoints" / "step_00000004.pt") for name, run in
              (("old", old), ("ours", ours))}
    for _, saved in states.values():
        assert saved.version == VERSION and saved.position.step == 4 and saved.ema is not None
    assert _digests(states["old"][0]) == _digests(states["ours"][0])
    assert _digests(states["old"][1].ema) == _digests(states["ours"][1].ema)
    got = {str(step): loss for step, loss in losses(old).items()}
    assert got.keys() == expected["train_loss"].keys()
    np.testing.assert_allclose([got[k] for k in got], [expected["train_loss"][k] for k in got], rtol=2e-7, atol=0)


def _same(a: object, b: object) -> bool:
    """Equal values all the way down: tensors and arrays element for element (and dtype), mappings key for key,
    sequences item for item (a tuple and a list alike: RNG states come back as either)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # numpy's generator state
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            _same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_the_writer_and_the_reader_agree(tmp_path: Path) -> None:
    """What the trainer writes (:meth:`TrainerState.to_dict`, the strategy's part beside it, the best added by the
    manager) reads back field for field and value for value, the strategy's part handed back untouched."""
    saved = TrainerState.read(FIXTURE_0_3 / "checkpoints" / "step_00000002.pt")
    strategy = {"model": saved.weights, "optimizer": saved.strategy["optimizer"], "scaler": {}}
    path = CheckpointManager(tmp_path).save({**strategy, **saved.to_dict()}, 2, 1.5)
    again = TrainerState.read(path)
    assert again.best == 1.5 and again.version == VERSION
    assert _same(again.strategy, strategy) and _same(again.weights, saved.weights)
    for name in ("config", "position", "layout", "model_args", "run_id", "format", "scheduler", "rng", "ema"):
        assert _same(getattr(again, name), getattr(saved, name)), name
    assert len(again.rng) == 1 and again.ema is not None and again.strategy["optimizer"]["state"]  # non-trivial parts
    assert not _same({"w": torch.zeros(2)}, {"w": torch.tensor([0.0, 1.0])})  # values, not keys, are compared


def _later(tmp_path: Path) -> Path:
    """The 0.3.0 run, its checkpoint claiming the trainer-state version after this one."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_0_3, run)
    path = run / "checkpoints" / "step_00000002.pt"
    torch.save({**torch.load(path, weights_only=False), "version": VERSION + 1}, path)
    return run


def test_a_later_version_is_refused_naming_both_versions(tmp_path: Path) -> None:
    """Read, resolved by ``--resume auto`` (never skipped as if it were corrupt) or read as a model: one line."""
    run = _later(tmp_path)
    path = run / "checkpoints" / "step_00000002.pt"
    for read in (TrainerState.read, read_checkpoint, lambda p: CheckpointManager(run).load("auto")):
        with pytest.raises(LaterVersionError, match=rf"version {VERSION + 1}\b.*reads versions 1 to {VERSION}\b"
                           ) as err:
            read(path)
        assert "\n" not in str(err.value)


def test_resuming_a_later_version_is_one_line_exit_2(tmp_path: Path) -> None:
    run = _later(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "sigmanens_dist.train", "--config", str(run / "config.yaml"),
                           f"run_dir={run}", "checkpoint.resume=auto"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert f"trainer-state version {VERSION + 1}," in line and f"versions 1 to {VERSION}:" in line, line
