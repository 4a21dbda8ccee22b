"""One owner per run directory, records that survive any crash, preemption from the first instruction, a tracking
store that cannot be written costing one warning: what issue 36 found broken, reproduced and now passing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sigmanens_dist.errors import UsageError
from sigmanens_dist.training.run_lock import LOCK_FILE, RunLock, RunLockedError
from sigmanens_dist.training.tracking import RUN_ID_FILE, Tracker, read_records
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, final_state, losses, run_train, train_cmd

BASE = [*TINY_VIT, *SYNTHETIC, "train.batch_size=8", "checkpoint.every_steps=2", "train.log_every_steps=1",
        "eval.at_end=false", "model.num_members=2"]


def _steps(run: Path) -> list[int]:
    return [row["step"] for row in read_records(run / "metrics.jsonl") if "train/loss" in row]


@pytest.mark.slow
def test_two_trainers_on_one_run_dir(tmp_path: Path) -> None:
    """Started within 100 ms: exactly one trains, the other exits 2 in one line and writes nothing into the
    holder's directory; the survivor's records and checkpoints equal an undisturbed run's. The refusal names the
    holder's PID and host, or, where a loaded machine let the first finish before the second reached the lock, the
    checkpoints that run left (test_a_held_run_dir_is_refused_naming_the_holder holds the first message for sure)."""
    run, alone = tmp_path / "shared", tmp_path / "alone"
    args = [*BASE, "train.max_steps=6"]
    procs = [subprocess.Popen(train_cmd(run, *args, f"reg.tau={tau}"), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for tau in ("0.5", "0.5")]
    outs = [p.communicate(timeout=600) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [o[1][-2000:] for o in outs]
    winner, loser = (0, 1) if procs[0].returncode == 0 else (1, 0)
    err = outs[loser][1].strip()
    assert err.count("\n") == 0, err
    held = f"PID {procs[winner].pid} on host {socket.gethostname()}" in err and "in use by trainer" in err
    assert held or "already holds checkpoints of an earlier run" in err, err
    if held:  # a refusal for a held directory leaves the holder's alone (a late one records its refusal there)
        assert not (run / "usage_error.txt").exists()
    run_train(alone, *args, "reg.tau=0.5")
    assert _steps(run) == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(alone)
    got, want = final_state(run), final_state(alone)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        p.name for p in (alone / "checkpoints").iterdir())


def _hold(run: Path, seconds: float, job: str | None) -> subprocess.Popen:
    """Another process owning ``run`` for ``seconds`` (as Slurm job ``job``)."""
    code = (f"import time; from sigmanens_dist.training.run_lock import RunLock\n"
            f"with RunLock({str(run)!r}, 'trainer'):\n    print('held', flush=True); time.sleep({seconds})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**env(), **({"SLURM_JOB_ID": job} if job else {})})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_held_run_dir_is_refused_naming_the_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = _hold(tmp_path / "run", 30, "41")
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "42")  # another job: refused at once
        start = time.monotonic()
        with pytest.raises(RunLockedError, match=rf"in use by trainer PID {holder.pid} on host .*Slurm job 41"):
            RunLock(tmp_path / "run", "trainer").acquire()
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path / "run", "trainer"):  # the kernel dropped the dead holder's lock: nothing stale
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_eval_or_export_into_a_held_run_is_refused(tmp_path: Path) -> None:
    """``sigmanens eval`` writes beside the checkpoint, ``export`` wherever OUT is: not into a run a trainer owns
    (and rotates); outside it, export goes on."""
    import shutil

    from tests.helpers import FIXTURE

    run = shutil.copytree(FIXTURE, tmp_path / "run")
    holder = _hold(run, 120, None)
    try:
        procs = [subprocess.run([sys.executable, "-m", "sigmanens_dist.cli", *args], cwd=REPO, env=env(),
                                capture_output=True, text=True, timeout=300, check=False)
                 for args in (["eval", "--checkpoint", str(run), "--no-mlflow", "--no-sub-ensembles"],
                              ["export", str(run), str(run / "model.pt")],
                              ["export", str(run), str(tmp_path / "model.pt")])]
    finally:
        holder.kill()
        holder.wait()
    for proc in procs[:2]:
        assert proc.returncode == 2 and f"in use by trainer PID {holder.pid}" in proc.stderr, proc.stderr[-2000:]
    assert procs[2].returncode == 0, procs[2].stderr[-2000:]
    assert not list(run.rglob("eval.json")) and not (run / "model.pt").exists()


def test_a_requeue_waits_for_its_own_previous_attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    holder = _hold(tmp_path / "run", 2, "41")
    start = time.monotonic()
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    with RunLock(tmp_path / "run", "trainer", wait_s=60):
        assert time.monotonic() - start > 1.5  # taken only once the holder let go, 2 s after it took it
    holder.wait()


def test_a_run_dir_that_cannot_be_one_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for bad, why in ((tmp_path / "file", "is a file"), (tmp_path / "file" / "run", "a part of this path is a file")):
        with pytest.raises(UsageError, match=why):
            RunLock(bad, "trainer").acquire()


@pytest.fixture
def read_only(tmp_path: Path) -> Path:
    """A read-only file system (a tmpfs mounted ro): root ignores permission bits, not this."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                      capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_a_run_dir_on_a_read_only_file_system_is_one_line(read_only: Path) -> None:
    with pytest.raises(UsageError, match="cannot be created"):
        RunLock(read_only / "run", "trainer").acquire()


def test_a_store_that_cannot_be_written_is_one_warning_at_once(read_only: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    tracker = Tracker(tmp_path / "run", enabled=True, active=True, uri=f"sqlite:///{read_only}/mlflow.db",
                      experiment="e")
    start = time.monotonic()
    assert tracker.start("r", None, {}, {}) is None
    assert time.monotonic() - start < 5
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cannot be written" in warnings[0].getMessage()


@pytest.mark.slow
def test_a_torn_last_record_does_not_block_resume(tmp_path: Path) -> None:
    """A crash mid-write leaves half a line in metrics.jsonl: the resumed run drops it with a warning and goes on
    (it was exit 2 with usage_error.txt, which the Slurm scripts read as "never requeue")."""
    run = tmp_path / "run"
    run_train(run, *BASE, "train.max_steps=2")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "train/lo')
    proc = run_train(run, *BASE, "train.max_steps=4", "checkpoint.resume=auto")
    assert "metrics.jsonl line" in proc.stderr and "dropped" in proc.stderr
    assert not (run / "usage_error.txt").exists()
    assert _steps(run) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_rerun_after_a_death_before_the_first_checkpoint(tmp_path: Path) -> None:
    """The first attempt logged steps 1-8 and died before any checkpoint, its MLflow run left RUNNING: the rerun
    records each step once and ends the dead attempt's run as FAILED."""
    from mlflow import MlflowClient

    run, uri = tmp_path / "run", f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    dead = client.create_run(client.create_experiment("e")).info.run_id
    run.mkdir()
    (run / RUN_ID_FILE).write_text(f"{uri}\n{dead}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 9.0}) + "\n"
                                               for s in range(1, 9)))
    cmd = [*train_cmd(run, *BASE, "train.max_steps=3"), "tracking.enabled=true", f"tracking.uri={uri}",
           "tracking.experiment=e"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _steps(run) == [1, 2, 3] and 9.0 not in losses(run).values()
    assert client.get_run(dead).info.status == "FAILED"
    assert (run / RUN_ID_FILE).read_text().split()[1] != dead


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
@pytest.mark.parametrize("after", [0.3, 2.5])
def test_a_signal_during_start_up_is_a_preemption(tmp_path: Path, sig: signal.Signals, after: float) -> None:
    """During the imports (0.3 s) or the set-up (2.5 s): exit 75 and the marker saying "before the first step",
    never a death by signal that a batch script cannot tell from a crash."""
    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(run, *BASE, "train.max_steps=50"), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    if proc.returncode == 75 and (run / "checkpoints").is_dir():
        pytest.skip("training had already started on this machine: the in-loop handler answered")
    assert proc.returncode == 75, err[-2000:]
    assert f"received {sig.name} before the first step" in err
    marker = json.loads((run / "preempted.json").read_text())  # run_dir= is read from the command line at once
    assert marker == {"step": None, "signal": sig.name, "when": "before the first step"}
