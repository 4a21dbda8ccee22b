"""Checkpoint files: atomic, rotated, never losing the previous good one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sigmanens_dist.training.checkpoint import CheckpointManager


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "position": {"step": step}}


def test_keep_last_and_best(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step, nll in [(1, 0.9), (2, 0.5), (3, 0.7), (4, None)]:
        mgr.save(_state(step), step, nll)
    assert [p.name for p in mgr.checkpoints()] == ["step_00000003.pt", "step_00000004.pt"]
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=False)
    assert best["position"]["step"] == 2
    state, path = mgr.load("auto")
    assert path.name == "step_00000004.pt" and state["position"]["step"] == 4


def test_failed_write_keeps_previous_and_leaves_no_temp(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(_state(1), 1)

    class Boom:
        def __reduce__(self) -> tuple:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save({"model": Boom(), "position": {}}, 2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001.pt"]
    assert mgr.load("auto")[0]["position"]["step"] == 1


def test_corrupt_newest_is_skipped_and_explicit_path_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(_state(1), 1)
    newest = mgr.save(_state(2), 2)
    newest.write_bytes(b"not a checkpoint")
    assert mgr.load("auto")[0]["position"]["step"] == 1
    assert "step_00000002.pt is unreadable" in caplog.text
    assert mgr.load("none") is None
    with pytest.raises(FileNotFoundError, match=r"checkpoint\.resume='/nope\.pt': no such file"):
        mgr.load("/nope.pt")
    assert CheckpointManager(tmp_path / "empty").load("auto") is None


def test_step_file_records_the_best_including_its_own_metric(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=5)
    first = mgr.save(_state(1), 1, 0.5)
    second = mgr.save(_state(2), 2, 0.6)
    assert torch.load(first, weights_only=False)["best"] == 0.5  # its own metric, not the None before it
    assert torch.load(second, weights_only=False)["best"] == 0.5


def test_rotation_never_deletes_the_file_just_written(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(_state(10), 10)
    mgr.save(_state(5), 5)
    assert [p.name for p in mgr.checkpoints()] == ["step_00000005.pt", "step_00000010.pt"]
