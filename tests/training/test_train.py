"""The training loop end to end: runs, DDP equivalence, exact resume after SIGKILL and SIGUSR1, clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, final_state, interrupted, losses, run_train, torchrun

BASE = [*TINY_VIT, *SYNTHETIC, "train.batch_size=16", "optim.name=adamw", "optim.lr=0.002",
        "schedule.warmup_steps=3", "train.log_every_steps=1", "reg.lam=0.01"]


@pytest.mark.slow
def test_single_process_run_writes_everything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_train(run, *BASE, "train.max_steps=20", "train.eval_every_steps=10", "checkpoint.every_steps=10",
                     "checkpoint.keep_last=1", "train.grad_accum=2", "train.clip_grad=1.0", "train.ema_decay=0.9")
    metrics = json.loads((run / "final_metrics.json").read_text())
    for key in ("acc", "nll", "ece", "brier", "disagreement", "member0/acc", "member3/nll", "sharing/members_on"):
        assert key in metrics, key
    assert metrics["acc"] > 0.3  # 10 learnable classes, chance is 0.1
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*.pt"))] == ["step_00000020.pt"]
    assert (run / "checkpoints" / "best.pt").is_file()
    assert (run / "config.yaml").is_file() and (run / "reliability.png").stat().st_size > 10_000
    assert sorted(losses(run)) == list(range(1, 21))
    assert "member 3:" in proc.stdout


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process_with_double_batch(tmp_path: Path) -> None:
    # SGD, not Adam: Adam divides by √v and turns fp-noise gradients (e.g. of the attention key bias, which is
    # exactly zero in theory) into full-size steps of random sign, so it cannot be compared across reductions.
    common = [*BASE, "train.max_steps=6", "checkpoint.every_steps=6", "optim.name=sgd", "optim.lr=0.05"]
    run_train(tmp_path / "ddp", *common, "train.batch_size=8", nproc=2)
    run_train(tmp_path / "one", *common, "train.batch_size=16", nproc=1)
    a, b = losses(tmp_path / "ddp"), losses(tmp_path / "one")
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4, abs=1e-5), step
    sa, sb = final_state(tmp_path / "ddp"), final_state(tmp_path / "one")
    for k in sa:
        if sa[k].is_floating_point():
            torch.testing.assert_close(sa[k], sb[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_ddp_flat_sigma_gradient_is_identical_on_all_ranks(tmp_path: Path) -> None:
    script = REPO / "tests" / "dist_scripts" / "ddp_grad_check.py"
    proc = subprocess.run([*torchrun(2), str(script), str(tmp_path)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    grads = [torch.load(tmp_path / f"grad_rank{r}.pt") for r in (0, 1)]
    assert grads[0].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])
    local = [torch.load(tmp_path / f"local_grad_rank{r}.pt") for r in (0, 1)]
    assert not torch.equal(local[0], local[1])  # the ranks saw different data: the equality above is the all-reduce
    torch.testing.assert_close(grads[0], (local[0] + local[1]) / 2, atol=1e-6, rtol=1e-5)  # an average, once


# Dropout and drop-path on, so RNG restoration matters; slow steps so the signal lands mid-run.
INTERRUPTED = [*BASE, "train.max_steps=24", "checkpoint.every_steps=4", "checkpoint.keep_last=3",
               "model.kwargs.drop_rate=0.2", "model.kwargs.drop_path_rate=0.1", "train.eval_every_steps=8",
               "train.batch_size=8", "train.ema_decay=0.9"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """The uninterrupted run per process count, trained once for every signal that interrupts it."""
    runs: dict[int, Path] = {}

    def get(nproc: int) -> Path:
        if nproc not in runs:
            runs[nproc] = tmp_path_factory.mktemp(f"straight{nproc}") / "run"
            run_train(runs[nproc], *INTERRUPTED, nproc=nproc)
        return runs[nproc]
    return get


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "nproc"), [(signal.SIGKILL, 1), (signal.SIGUSR1, 1), (signal.SIGUSR1, 2)])
def test_interrupted_and_resumed_run_is_identical(tmp_path: Path, straight: Callable[[int], Path],
                                                  sig: signal.Signals, nproc: int) -> None:
    overrides = INTERRUPTED
    reference = straight(nproc)
    run = tmp_path / "interrupted"
    status = interrupted(run, overrides, sig, "step_00000004.pt", nproc)
    if sig == signal.SIGKILL:
        assert status == -signal.SIGKILL
    else:
        assert status in (75, 1)  # 75 from the worker; torchrun reports a failed worker as 1
        done = sorted(int(p.stem.split("_")[1]) for p in (run / "checkpoints").glob("step_*.pt"))
        assert done[-1] < 24, "the signal arrived too late to test anything"
        assert max(losses(run)) == done[-1], "a step ran after the preemption checkpoint"
        # the signal that arrived, also when it reached one worker only (the last one of two: not rank 0's)
        assert json.loads((run / "preempted.json").read_text())["signal"] == sig.name
    umask = os.umask(0)
    os.umask(umask)
    for ckpt in (run / "checkpoints").iterdir():  # every file as the umask says (shared project directories)
        assert ckpt.stat().st_mode & 0o777 == 0o666 & ~umask, ckpt
    run_train(run, *overrides, "checkpoint.resume=auto", nproc=nproc)
    assert losses(run) == losses(reference)
    # The records hold each step once: what the killed attempt logged past its checkpoint was dropped on resume.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in rows if "train/loss" in r]
    assert trained == list(range(1, 25)), trained
    [mark] = [r for r in rows if "resumed_from_step" in r]
    assert mark["step"] == mark["resumed_from_step"] < 24
    for part in ("model", "ema"):
        expected, resumed = final_state(reference, part), final_state(run, part)
        for k in expected:
            assert torch.equal(expected[k], resumed[k]), f"{part}: {k}"


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [*BASE, "train.max_steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=3"]
    run_train(run, *overrides)
    newest = run / "checkpoints" / "step_00000008.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as after a crash mid-copy
    proc = run_train(run, *overrides, "train.max_steps=10", "checkpoint.resume=auto")
    assert "step_00000008.pt is unreadable" in proc.stderr
    assert "resumed from" in proc.stderr and "step_00000004.pt at step 4" in proc.stderr


@pytest.mark.slow
def test_resume_with_other_members_is_a_clear_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_train(run, *BASE, "train.max_steps=2", "model.num_members=2")
    proc = run_train(run, *BASE, "train.max_steps=4", "model.num_members=3", "checkpoint.resume=auto", expect=2)
    assert "model.num_members: the checkpoint's run has 2, this config 3" in proc.stderr
    proc = run_train(run, *BASE, "train.max_steps=4", "model.num_members=2", expect=2)  # resume=none: not over it
    assert "already holds checkpoints of an earlier run" in proc.stderr


@pytest.mark.slow
def test_epoch_end_eval_and_checkpoint_when_accumulation_straddles_the_epoch(tmp_path: Path) -> None:
    # 512 training samples (640 less the 128 carved off for validation) / 16 = 32 batches an epoch; 3 micro-batches
    # a step: step 11 takes batches 31-33 and ends epoch 0.
    run = tmp_path / "run"
    run_train(run, *BASE, "train.max_steps=12", "train.grad_accum=3", "checkpoint.keep_last=3",
              "data.train_subset=640", "data.val_split=128")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/nll" in r] == [11, 12]
    assert [p.name for p in sorted((run / "checkpoints").glob("step_*.pt"))] == ["step_00000011.pt",
                                                                                "step_00000012.pt"]


def test_bad_config_fails_before_anything_starts(tmp_path: Path) -> None:
    proc = run_train(tmp_path / "run", "model.num_members=0", "reg.tau=-1", "model.nmembers=3", expect=2)
    for needle in ("model.num_members", "reg.tau", "model.nmembers"):
        assert needle in proc.stderr, needle
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_compiled_model_trains_like_eager(tmp_path: Path) -> None:
    # aot_eager: dynamo captures the σ layers' graphs (views of the flat store, member-major batches) and AOT
    # autograd derives the backward, without inductor's minutes of C++ code generation on a CPU test machine.
    common = [*BASE, "train.max_steps=3", "optim.name=sgd", "optim.lr=0.05"]
    run_train(tmp_path / "eager", *common)
    proc = run_train(tmp_path / "compiled", *common, "train.compile=true", "train.compile_backend=aot_eager")
    assert "model compiled with torch.compile(backend='aot_eager')" in proc.stderr
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert eager.keys() == compiled.keys() == {1, 2, 3}
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-5, abs=1e-6), step


def test_progress_is_plain_lines_outside_a_terminal(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """In a Slurm .out file (stderr not a TTY) progress is a readable line every few seconds, never \\r frames."""
    import time as clock

    from sigmanens_dist.progress import LineProgress, progress

    monkeypatch.setenv("SIGMANENS_PROGRESS_SECONDS", "0")
    bar = progress(total=4, desc="train", unit="step")
    assert isinstance(bar, LineProgress)  # pytest's captured stderr is not a TTY
    bar.set_postfix(task="0.500")
    for _ in range(4):
        bar.update(1)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines) and len(lines) == 5  # one per update (interval 0) and one at the end
    assert lines[1].startswith("train: 2/4 step (50%) ") and " ETA " in lines[1] and lines[1].endswith("| task=0.500")
    assert lines[-1].startswith("train: 4/4 step (100%) ")
    assert list(progress(range(3), desc="x", disable=True)) == [0, 1, 2]  # other ranks: nothing shown
    monkeypatch.setenv("SIGMANENS_PROGRESS_SECONDS", "3600")
    quiet = progress(total=100, desc="train", unit="step")
    began = clock.monotonic()
    for _ in range(50):
        quiet.update(1)
    assert clock.monotonic() - began < 5 and not capsys.readouterr().err  # nothing until the interval passes


def test_known_benign_library_warnings_are_silenced_by_their_exact_text() -> None:
    """FSDP2's view-tensor warning and DeepSpeed's deprecated collectives would repeat every step on every rank."""
    import warnings

    from sigmanens_dist.trainer import _quiet_known_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _quiet_known_warnings()
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
                      "`torch.distributed.reduce_scatter_single` instead.", FutureWarning, stacklevel=1)
        warnings.warn("FSDP2-wrapped module (FSDPSigmaEnsemble) returned a view tensor. An in-place op …",
                      UserWarning, stacklevel=1)
        warnings.warn("`torch.distributed.scatter` is deprecated.", FutureWarning, stacklevel=1)  # not ours to hide
    assert [str(w.message) for w in caught] == ["`torch.distributed.scatter` is deprecated."]
