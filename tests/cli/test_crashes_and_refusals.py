"""What the commands do with errors (sigmanens_dist/errors.py; docs/training.md "What is guaranteed"): a refusal of
the user's input is one line and exit 2, before anything is built; a crash (a CUDA out-of-memory, a bug) keeps its
traceback and exits 1, which the Slurm scripts retry; a server that does not answer is one line and exit 1. Issue
44, findings 7, 8, 9, 11 and 12; the rule in the code itself: tests/test_error_model.py.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers import FIXTURE, REPO, SYNTHETIC, TINY_VIT, env, free_port

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)"


# -- eval ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A copy of the 0.1.0 fixture (a 2-step tiny σN-Ens ViT on synthetic data): the smallest run to evaluate."""
    return shutil.copytree(FIXTURE, tmp_path / "run")


def _eval(run: Path, out: Path, *args: str) -> list[str]:
    return ["eval", "--checkpoint", str(run), "--no-mlflow", "--no-sub-ensembles", "--data", "test_subset=16",
            "--out", str(out), *args]


def test_a_crash_in_evals_forward_keeps_its_traceback(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 7: eval printed a CUDA out-of-memory (or any RuntimeError, ValueError, TypeError) as a one-line usage
    error, exit 2. Now it leaves ``main`` (the console script exits 1 with its traceback)."""
    from sigmanens_dist.cli import main
    from sigmanens_dist.methods.sigma import SigmaEnsemble

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError(OOM)

    monkeypatch.setattr(SigmaEnsemble, "forward", out_of_memory)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        main(_eval(run, tmp_path / "ev"))
    assert "error:" not in capsys.readouterr().err and not (tmp_path / "ev" / "eval.json").exists()


def test_eval_refusals_are_one_line_without_a_doubled_prefix(run: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Findings 8 and 12: ``--out`` under a file was a traceback after the model was built; an option the model's
    data refuses read ``sigmanens eval: error: sigmanens eval: …``."""
    from sigmanens_dist import models as load
    from sigmanens_dist.cli import main

    (tmp_path / "afile").write_text("mine")
    with monkeypatch.context() as m:
        m.setattr(load, "load_trained", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
        assert main(_eval(run, tmp_path / "afile" / "ev")) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"sigmanens eval: error: --out {tmp_path / 'afile' / 'ev'}: a part of this path is a file, not a folder "
        f"({tmp_path / 'afile'})"]
    assert main(_eval(run, tmp_path / "ev", "--ood", "svhn")) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["sigmanens eval: error: --ood 'svhn': for data.dataset='synthetic' the OOD sets are none yet (all: "
                   "digits, svhn)"]
    assert main(_eval(run, tmp_path / "ev", "--members", "0")) == 2
    assert capsys.readouterr().err.splitlines() == ["sigmanens eval: error: --members 0: must be >= 1"]
    assert (tmp_path / "afile").read_text() == "mine" and not (tmp_path / "ev").exists()


# -- the trainer ---------------------------------------------------------------------------------------------------
TRAIN = [*TINY_VIT, *SYNTHETIC, "tracking.enabled=false", "train.max_steps=1", "eval.at_end=false"]


@pytest.mark.slow  # a subprocess: the exit status and traceback as the Slurm scripts see them (~15 s)
def test_a_crash_in_the_trainers_set_up_exits_1_with_its_traceback(tmp_path: Path) -> None:
    """Finding 7: ``fit`` turned every ValueError, FileNotFoundError and FileExistsError of the set-up into a usage
    error (exit 2, usage_error.txt), which slurm/common.sh never requeues. A CUDA out-of-memory while the model is
    built is exit 1 with its traceback and no marker: the batch script retries it (up to SIGMANENS_MAX_RETRIES)."""
    run = tmp_path / "run"
    crash = ("import sys\nimport sigmanens_dist.trainer as trainer\n"
             "def out_of_memory(*args, **kwargs):\n"
             f"    raise RuntimeError({OOM!r})\n"
             "trainer.build_model = out_of_memory\n"
             "from sigmanens_dist.cli.train import main\nsys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", crash, f"run_dir={run}", *TRAIN], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr and f"RuntimeError: {OOM}" in proc.stderr
    assert run.is_dir() and not (run / "usage_error.txt").exists()


@pytest.mark.parametrize("error", [ValueError("a bug's message"), FileNotFoundError(2, "No such file", "/x/y.pt")])
def test_a_plain_error_at_set_up_is_not_a_usage_error(error: Exception, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A ValueError of a bug, or a file not (yet) visible on this node, keeps its type and traceback."""
    import sigmanens_dist.trainer as trainer
    from sigmanens_dist.cli.train import main

    def fail(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(trainer, "build_data", fail)
    with pytest.raises(type(error), match=re.escape(str(error))):
        main([f"run_dir={tmp_path / 'run'}", *TRAIN])
    assert "error:" not in capsys.readouterr().err and not (tmp_path / "run" / "usage_error.txt").exists()


def test_a_refusal_at_set_up_is_one_line_exit_2_and_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    from sigmanens_dist.cli.train import main

    run, missing = tmp_path / "run", tmp_path / "nowhere"
    assert main([f"run_dir={run}", *TRAIN, f"model.init_from={missing}"]) == 2
    message = f"model.init_from {missing}: no such file or folder"
    assert capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert (run / "usage_error.txt").read_text().startswith(message)


# -- --check: the run's paths --------------------------------------------------------------------------------------
@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    """An HTTP server (a thread of this process) on a folder with one converted dataset, ``wds/classes.json``."""
    root = tmp_path / "served"
    (root / "wds").mkdir(parents=True)
    (root / "wds" / "classes.json").write_text(json.dumps({"classes": ["a", "b"]}))

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()
    server.server_close()


REMOTE = ["data.dataset=fashion_mnist", "data.format=webdataset", "data.remote.retries=0"]


def test_check_refuses_what_the_run_would(tmp_path: Path, served: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 9: ``--check`` said "config ok" for a run_dir under a file and for a remote data.root that is not
    there; the run refused both. Both go through one function (config.check_run_paths) now."""
    from sigmanens_dist.cli.train import main

    (tmp_path / "afile").write_text("mine")
    bad = tmp_path / "afile" / "run"
    assert main([f"run_dir={bad}", "data.dataset=synthetic", "--check"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: run_dir={bad}: a part of this path is a file, not a folder ({tmp_path / 'afile'})"]
    assert main([f"run_dir={tmp_path / 'run'}", *REMOTE, f"data.root={served}/nowhere", "--check"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {served}/nowhere/classes.json is missing: write webdataset data with `sigmanens data convert "
        f"--format webdataset --out {served}/nowhere …`"]
    assert main([f"run_dir={tmp_path / 'run'}", *REMOTE, f"data.root={served}/wds", "--check"]) == 0
    assert capsys.readouterr().out.strip() == f"config ok: run_dir={tmp_path / 'run'}"
    assert not (tmp_path / "run").exists() and (tmp_path / "afile").read_text() == "mine"  # --check writes nothing


def test_a_server_that_does_not_answer_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    """Finding 8: a data or tracking server unreachable from the start was a 36-line traceback. It stays exit 1
    (maybe transient: a batch script retries it), in one line naming the server."""
    from sigmanens_dist.cli import main

    dead = f"http://127.0.0.1:{free_port()}"
    assert main(["train", f"run_dir={tmp_path / 'run'}", *REMOTE, f"data.root={dead}/wds", "--check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {dead}/wds/classes.json: ") and "gave up after 1 attempts" \
        in err[0], err
    assert main(["compare", "--experiment", "x", "--uri", dead, "--out", str(tmp_path / "cmp")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the tracking server {dead} does not answer ("), err


def test_a_registry_that_does_not_answer_is_one_line_and_exit_1(run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Review item 3: `export --register` (to the store of a run that has an MLflow run) and `predict models:/…`
    against a tracking server that does not answer were a traceback of MLflow's retry loop; now one line, exit 1,
    and export writes no program first."""
    import torch

    from sigmanens_dist.cli import main
    from sigmanens_dist.safe_load import load_file

    ckpt = run / "checkpoints" / "step_00000002.pt"
    torch.save({**load_file(ckpt, "checkpoint"), "mlflow_run_id": "0" * 32}, ckpt)
    dead = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "p.pt2"
    assert main(["export", str(run), "--program", str(out), "--register", "tiny", "--tracking-uri", dead]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"sigmanens export: error: the tracking server {dead} does not answer ({err[0].split(' (', 1)[1]}"]
    assert not out.exists()
    (tmp_path / "photos").mkdir()
    assert main(["predict", "models:/tiny@champion", str(tmp_path / "photos"), "--out", str(tmp_path / "preds"),
                 "--tracking-uri", dead]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"sigmanens predict: error: the tracking server {dead} does not "
                                               "answer ("), err
    assert not (tmp_path / "preds").exists()


def test_data_convert_out_under_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Finding 8: ``data convert --out afile/sub`` was a traceback (NotADirectoryError at the first write)."""
    from sigmanens_dist.cli import main

    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "sub"
    assert main(["data", "convert", "--dataset", "cifar10", "--root", str(tmp_path), "--format", "webdataset",
                 "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"sigmanens data convert: error: --out {out}: a part of this path is a file, not a folder "
        f"({tmp_path / 'afile'})"]


# -- a preemption at the first instant -----------------------------------------------------------------------------
def test_a_signal_before_the_start_up_guard_is_imported_is_a_preemption(tmp_path: Path) -> None:
    """Finding 11: a SIGTERM 0.3 s after ``python -m sigmanens_dist.train`` started came before the guard's module
    was imported: exit 143 and no marker. The trainer's first statement now notes such a signal and the guard
    answers it. Deterministic: the signal is sent while the guard's module is being imported."""
    run = tmp_path / "run"
    early = ("import os, runpy, signal, sys\n"
             "class SignalDuringImport:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'sigmanens_dist.training.preemption':\n"
             "            os.kill(os.getpid(), signal.SIGTERM)\n"
             "sys.meta_path.insert(0, SignalDuringImport())\n"
             "sys.argv = ['sigmanens_dist.train', *sys.argv[1:]]\n"
             "runpy.run_module('sigmanens_dist.train', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.run([sys.executable, "-c", early, f"run_dir={run}", *TRAIN], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert "received SIGTERM before the first step" in proc.stderr
    assert json.loads((run / "preempted.json").read_text()) == {"step": None, "signal": "SIGTERM",
                                                                 "when": "before the first step"}
