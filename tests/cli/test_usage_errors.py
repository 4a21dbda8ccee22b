"""A user's mistake is one message and exit status 2, before anything is built; a traceback is for bugs. Flags and
overrides in any order; a checkpoint of another strategy refused from its metadata; eval and export of a run
directory; export never writes over what it reads, nor over a file without --force."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sigmanens_dist.checkpoint import TRAINER_STATE, consolidated_state_dict
from tests.helpers import FIXTURE, REPO, SYNTHETIC, TINY_VIT, env, run_train, torchrun

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


def test_a_boolean_for_a_number_is_one_message_and_exit_2() -> None:
    """``model.num_members=true`` once checked as one member, ``reg.tau=yes`` as 1.0."""
    proc = _train("--config", "configs/fmnist_small.yaml", "model.num_members=true", "reg.tau=yes", "--check")
    assert proc.returncode == 2
    boolean = "not a boolean (YAML reads yes/no and on/off as true/false)"
    assert proc.stderr.splitlines() == ["error: configs/fmnist_small.yaml: 2 problems in the config:",
                                        f"  - model.num_members: must be an integer, {boolean} (got True)",
                                        f"  - reg.tau: must be a number, {boolean} (got True)"]


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
    assert main(["export", str(ddp_run), str(tmp_path / "m7.pt"), "--member", "7"]) == 2
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "n.pt")]) == 2
    assert main(["eval", "--checkpoint", str(ddp_run), "--no-mlflow", "--out", str(tmp_path / "ev"),
                 "--no-sub-ensembles"]) == 0
    assert (tmp_path / "ev" / "eval.json").is_file()


def test_export_errors_are_one_line(ddp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sigmanens_dist.cli.export import main

    assert main([str(ddp_run), str(tmp_path / "m.pt"), "--member", "7"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "sigmanens export: error: --member 7: the model has members 0..1"


@pytest.fixture
def old_run(tmp_path: Path) -> Path:
    """A copy of the smallest run there is (the 0.1.0 fixture: a 2-step tiny ViT), for exports that might harm it."""
    return shutil.copytree(FIXTURE, tmp_path / "run")


def _export_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    from sigmanens_dist.cli import main

    assert main(["export", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err  # refused before anything is loaded, in one line
    return err.removeprefix("sigmanens export: error: ").strip()


def test_export_never_writes_over_its_own_checkpoint(old_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``export R/checkpoints/step_N.pt R/checkpoints/step_N.pt`` had replaced the run's checkpoint by its export."""
    ckpt = old_run / "checkpoints" / "step_00000002.pt"
    original = ckpt.read_bytes()
    for source in (ckpt, old_run):  # the file itself, or the run directory that resolves to it
        for force in ([], ["--force"]):
            assert _export_error(capsys, str(source), str(ckpt), *force) == (
                f"OUT {ckpt} is the checkpoint being exported; write it elsewhere")
    assert ckpt.read_bytes() == original
    folder = tmp_path / "step_00000004"  # a checkpoint folder (DCP, DeepSpeed): refused before it is read
    folder.mkdir()
    (folder / TRAINER_STATE).write_bytes(b"")
    for out in (folder / "model.pt", folder):
        assert _export_error(capsys, str(folder), str(out), "--force") == (
            f"OUT {out} is inside the checkpoint folder being exported ({folder}); write it elsewhere")
    assert sorted(p.name for p in folder.iterdir()) == [TRAINER_STATE]


def test_export_replaces_an_existing_file_only_with_force_and_atomically(
        old_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from sigmanens_dist.cli import main

    ckpt = old_run / "checkpoints" / "step_00000002.pt"
    out = tmp_path / "model.pt"
    out.write_bytes(b"keep me")
    assert _export_error(capsys, str(ckpt), str(out)) == f"OUT {out} already exists; pass --force to replace it"
    assert out.read_bytes() == b"keep me"

    def save_half(obj: object, f: object) -> None:
        f.write(b"half a state dict")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", save_half)
        with pytest.raises(OSError, match="disk full"):
            main(["export", str(ckpt), str(out), "--force"])
    assert out.read_bytes() == b"keep me" and not list(tmp_path.glob(".model.pt.*"))  # old file whole, no temporary
    assert main(["export", str(ckpt), str(out), "--force"]) == 0
    assert torch.load(out, weights_only=True).keys() == consolidated_state_dict(ckpt)[0].keys()


def test_export_to_a_folder_or_into_a_missing_one_is_one_line(old_run: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A folder as OUT had been a traceback (IsADirectoryError); a missing parent is a typo to report, not create."""
    ckpt = str(old_run / "checkpoints" / "step_00000002.pt")
    assert _export_error(capsys, ckpt, str(tmp_path), "--force") == (
        f"OUT {tmp_path} is a folder; give the file to write, e.g. {tmp_path / 'model.pt'}")
    missing = tmp_path / "nowhere" / "model.pt"
    assert _export_error(capsys, ckpt, str(missing)) == f"OUT {missing}: its folder {missing.parent} does not exist"
    assert not missing.parent.exists()
