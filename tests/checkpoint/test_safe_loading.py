"""No load path runs what a pickle says: ``model.init_from``, ``sigmanens eval`` and resume refuse a file whose
unpickling would run code (here: create a file), before anything in it is built; checkpoint folders that
torch.distributed.checkpoint or DeepSpeed unpickle in full are vetted first; the project's own checkpoints load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sigmanens_dist.checkpoint import check_folder
from sigmanens_dist.errors import UsageError
from sigmanens_dist.safe_load import check_torch_file, load_file, written_by_us
from sigmanens_dist.training.rng import capture_rng
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, run_train

FIXTURE = REPO / "tests" / "fixtures" / "run_v0_1_0" / "checkpoints" / "step_00000002.pt"


class _Planted:
    """Unpickling this creates ``marker``: what a hostile weights file could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _hostile(tmp_path: Path, like_a_checkpoint: bool = True) -> tuple[Path, Path]:
    marker = tmp_path / "ran"
    path = tmp_path / "weights.pt"
    body = {"model": {"w": torch.ones(1)}, "position": {}} if like_a_checkpoint else {"w": torch.ones(1)}
    torch.save({**body, "payload": _Planted(marker)}, path)
    return path, marker


def test_hostile_files_are_refused_in_process(tmp_path: Path) -> None:
    path, marker = _hostile(tmp_path)
    with pytest.raises(UsageError, match=r"refused: it holds posix\.system besides tensors"):
        load_file(path, "model.init_from")
    with pytest.raises(UsageError, match=r"refused: it holds posix\.system, which is not in a checkpoint"):
        check_torch_file(path, written_by_us, "checkpoint")
    assert not marker.exists()


@pytest.mark.slow
def test_init_from_eval_and_resume_refuse_a_hostile_pickle(tmp_path: Path) -> None:
    """Through the commands a user runs: each exits 2 with the refusal in one line, and the payload never ran."""
    path, marker = _hostile(tmp_path)
    base = [*TINY_VIT, *SYNTHETIC, "train.batch_size=8", "train.max_steps=1", "eval.at_end=false"]
    for how in (f"model.init_from={path}", f"checkpoint.resume={path}"):
        proc = run_train(tmp_path / how.split("=")[0], *base, "model.method=single", how, expect=2)
        assert "refused: it holds posix.system" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    cmd = [sys.executable, "-m", "sigmanens_dist.cli", "eval", "--checkpoint", str(path), "--no-mlflow"]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "refused: it holds posix.system" in proc.stderr, proc.stderr[-2000:]
    assert not marker.exists()


def test_a_dcp_folder_with_hostile_metadata_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "step_00000001"
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    dcp.save({"model": model.state_dict(), "ema": {"x": torch.ones(2, dtype=torch.bfloat16)}}, checkpoint_id=folder)
    check_folder(folder, "dcp")  # what DCP writes passes
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(__import__("pickle").dumps(_Planted(marker)))
    with pytest.raises(UsageError, match=r"\.metadata: refused: it holds posix\.system"):
        check_folder(folder, "dcp")
    assert not marker.exists()


def test_the_projects_own_checkpoints_load_safely(tmp_path: Path) -> None:
    """A checkpoint of v0.1.0 and a fresh RNG state (numpy's, allow-listed) read with weights_only."""
    state = load_file(FIXTURE, "checkpoint")
    assert {"model", "position", "rng", "config"} <= state.keys()
    check_torch_file(FIXTURE, written_by_us, "checkpoint")
    path = tmp_path / "rng.pt"
    torch.save({"rng": capture_rng()}, path)
    assert load_file(path, "checkpoint")["rng"]["numpy"][0] == "MT19937"


def test_only_data_classes_of_the_allowed_modules_pass() -> None:
    assert written_by_us("torch.bfloat16") and written_by_us("torch.FloatStorage")
    assert written_by_us("torch.distributed.checkpoint.metadata.TensorStorageMetadata")
    assert not written_by_us("torch.load")  # a function of torch, not a dtype or storage
    assert not written_by_us("torch.distributed.checkpoint.metadata.no_such_name")
    assert not written_by_us("builtins.eval") and not written_by_us("posix.system")


def test_a_safetensors_file_converts(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from sigmanens_dist.models import source_weights

    weights = {"fc.weight": torch.randn(2, 3), "fc.bias": torch.zeros(2)}
    save_file(weights, tmp_path / "w.safetensors")
    source = source_weights(tmp_path / "w.safetensors")
    assert not source.whole_model and torch.equal(source.weights["fc.weight"], weights["fc.weight"])
