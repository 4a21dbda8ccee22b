"""Checkpoint files: atomic, rotated, never losing the previous good one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sigmanens_dist.checkpoint import CheckpointManager


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
    assert path.name == "step_00000004.pt" and state.position.step == 4


def test_failed_write_keeps_previous_and_leaves_no_temp(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(_state(1), 1)

    class Boom:
        def __reduce__(self) -> tuple:
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        mgr.save({"model": Boom(), "position": {}}, 2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001.pt"]
    assert mgr.load("auto")[0].position.step == 1


def test_corrupt_newest_is_skipped_and_explicit_path_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(_state(1), 1)
    newest = mgr.save(_state(2), 2)
    newest.write_bytes(b"not a checkpoint")
    assert mgr.load("auto")[0].position.step == 1
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


def test_read_checkpoint_takes_the_model_sizes_from_the_checkpoint_only(tmp_path: Path) -> None:
    """Export, eval and init_from rebuild a model from the saved config and ``model_args``; one without them is
    refused in one line (there is no second way to learn a model's size)."""
    from sigmanens_dist.checkpoint import read_checkpoint
    from sigmanens_dist.errors import UsageError

    mgr = CheckpointManager(tmp_path)
    args = {"num_classes": 7, "in_chans": 1, "vocab_size": None}
    path = mgr.save({**_state(3), "config": {"seed": 1}, "model_args": args, "ema": {"w": torch.ones(3)}}, 3)
    ckpt = read_checkpoint(path, with_ema=True)
    assert ckpt.model_args == args and ckpt.config == {"seed": 1} and ckpt.step == 3
    assert torch.equal(ckpt.weights["w"], torch.full((3,), 3.0)) and torch.equal(ckpt.ema["w"], torch.ones(3))
    assert read_checkpoint(path).ema is None  # consolidated only when asked for
    bare = mgr.save({**_state(4), "config": {"seed": 1}}, 4)
    with pytest.raises(UsageError, match=r"does not record model_args") as err:
        read_checkpoint(bare, "--checkpoint")
    assert "\n" not in str(err.value)


def test_every_strategy_reads_the_format_it_writes() -> None:
    """The registry's formats (what resume compares, known without importing a strategy) are the strategies' own."""
    from sigmanens_dist.distributed.strategies import CHECKPOINT_FORMATS, STRATEGIES, folder_format, strategy_class

    assert set(CHECKPOINT_FORMATS) == set(STRATEGIES)
    for name, fmt in CHECKPOINT_FORMATS.items():
        assert strategy_class(name).checkpoint_format == fmt
        if fmt != "file":
            assert folder_format(fmt) is strategy_class(name)
    with pytest.raises(ValueError, match="unknown checkpoint folder format 'zip'"):
        folder_format("zip")


def test_a_saved_config_validates_from_the_dict(tmp_path: Path) -> None:
    from sigmanens_dist.config import ConfigError, config_from_dict, load_config

    raw = load_config("fmnist_small", check_data=False).model_dump(mode="json")
    cfg = config_from_dict(raw, ["reg.tau=0.25"], source="the config stored in X", check_data=False)
    assert cfg.reg.tau == 0.25 and raw["reg"]["tau"] != 0.25  # the saved dict is not changed
    with pytest.raises(ConfigError, match="the config stored in X"):
        config_from_dict(raw, ["reg.tau=yes"], source="the config stored in X", check_data=False)
