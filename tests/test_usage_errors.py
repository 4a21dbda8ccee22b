"""A user's mistake is one message and exit status 2, before anything is built; a traceback is for bugs. Flags and
overrides in any order; a checkpoint of another strategy refused from its metadata; eval and export of a run
directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, run_train, torchrun

BASE = [*TINY_VIT, *SYNTHETIC, "train.batch_size=16", "optim.name=adamw", "optim.lr=0.002", "eval.at_end=false",
        "model.num_members=2"]


def _train(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = [*torchrun(nproc), "-m"] if nproc > 1 else [sys.executable, "-m"]
    return subprocess.run([*launcher, "sigmanens_dist.train", *args], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=300, check=False)


def test_bad_key_is_one_message_and_exit_2() -> None:
    proc = _train("--config", "configs/fmnist_small.yaml", "model.bogus_key=1")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: configs/fmnist_small.yaml: 1 problem in the config:",
                                        "  - model.bogus_key: unknown key (got 1)"]


def test_flags_and_overrides_in_any_order() -> None:
    proc = _train("--resume", "auto", "train.max_steps=3", "--config", "configs/fmnist_small.yaml", "seed=2",
                  "--check")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "config ok: run_dir=runs/fmnist_small"


@pytest.mark.slow
def test_a_refusal_at_setup_is_printed_once_by_rank_0_and_recorded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    proc = _train(f"run_dir={run}", "tracking.enabled=false", *BASE, f"model.init_from={tmp_path / 'nowhere'}",
                  nproc=2)
    assert proc.returncode != 0
    message = f"error: model.init_from {tmp_path / 'nowhere'}: no such file or folder"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr  # torchrun's own only
    assert "[rank0]" not in proc.stderr and "[rank1]" not in proc.stderr  # no worker prints a traceback
    assert (run / "usage_error.txt").read_text().startswith(f"model.init_from {tmp_path / 'nowhere'}")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("usage") / "ddp"
    run_train(run, *BASE, "train.max_steps=4", "checkpoint.every_steps=2")
    return run


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["strategy.name=fsdp"], ["strategy.name=deepspeed", "strategy.zero_stage=3"]])
def test_another_strategy_is_refused_from_the_checkpoint(ddp_run: Path, strategy: list[str]) -> None:
    proc = _train(f"run_dir={ddp_run}", "tracking.enabled=false", *BASE, "train.max_steps=6", "--resume", "auto",
                  *strategy)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the checkpoint was written by strategy.name=ddp (file format) and this run uses" in proc.stderr
    assert "`sigmanens export <checkpoint> model.pt`" in proc.stderr and "model.init_from=model.pt" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_eval_and_export_take_a_run_directory(ddp_run: Path, tmp_path: Path) -> None:
    from sigmanens_dist.cli import main

    out = tmp_path / "m.pt"
    assert main(["export", str(ddp_run), str(out), "--member", "1"]) == 0
    assert out.is_file()
    assert main(["export", str(ddp_run), str(out), "--member", "7"]) == 2
    assert main(["export", str(tmp_path / "nowhere"), str(out)]) == 2
    assert main(["eval", "--checkpoint", str(ddp_run), "--no-mlflow", "--out", str(tmp_path / "ev"),
                 "--no-sub-ensembles"]) == 0
    assert (tmp_path / "ev" / "eval.json").is_file()


def test_export_errors_are_one_line(ddp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sigmanens_dist.cli.export import main

    assert main([str(ddp_run), str(tmp_path / "m.pt"), "--member", "7"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "sigmanens export: error: --member 7: the model has members 0..1"
