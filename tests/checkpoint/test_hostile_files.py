"""Nothing a user loads runs code, whatever bytes a file starts or ends with: hostile variants (code-running GLOBALs to
posix/builtins/subprocess, nested pickles, polyglots with zip heads and tails, oversized lengths) planted in every
checkpoint format (a file, a DCP folder's ``.metadata`` and ``.distcp`` entries, a DeepSpeed folder) are refused in
one line by every reader and every command; no payload writes its marker. Truncated, empty and garbage files are one
line too, never a traceback."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from sigmanens_dist.checkpoint import TRAINER_STATE, CheckpointManager, TrainerState, consolidated_state_dict
from sigmanens_dist.errors import UsageError
from sigmanens_dist.safe_load import RefusedFileError, load_file, load_safetensors
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, run_train


class _Call:
    """Unpickling this calls ``fn(*args)``: what a hostile file does instead of holding weights."""

    def __init__(self, fn: Callable, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _objects(marker: Path) -> dict[str, object]:
    """One code-running object per way in: os.system, exec, subprocess, and a pickle inside a pickle."""
    return {"posix.system": _Call(os.system, f"touch {marker}"),
            "builtins.exec": _Call(exec, f"open({str(marker)!r}, 'w').close()"),
            "subprocess.call": _Call(subprocess.call, ["touch", str(marker)]),
            "nested pickle": _Call(pickle.loads, pickle.dumps(_Call(os.system, f"touch {marker}")))}


def _empty_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": 1}))
    return buf.getvalue()


def _variants(marker: Path) -> dict[str, bytes]:
    """The bytes of every hostile file: each object as a raw pickle, with a zip appended (the polyglot that passed
    a check keyed on ``zipfile.is_zipfile``), and as a torch.save zip; plus a length field of 2**60."""
    out = {}
    for name, obj in _objects(marker).items():
        raw = pickle.dumps({"w": torch.ones(1), "payload": obj}, protocol=4)
        buf = io.BytesIO()
        torch.save({"model": {"w": torch.ones(1)}, "position": {}, "payload": obj}, buf)
        out |= {f"{name}/raw": raw, f"{name}/zip tail": raw + _empty_zip(), f"{name}/torch zip": buf.getvalue()}
    out["oversized length"] = b"\x80\x04\x8e" + (2**60).to_bytes(8, "little") + b"\x00" * 16 + b"."
    return out


BROKEN = {"empty": b"", "garbage": b"not a checkpoint at all\n" * 4}


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and len(text) < 600, text
    return text


def _dcp_folder(root: Path, metadata: bytes | None = None, entry: object | None = None) -> Path:
    """A DCP checkpoint folder as the FSDP trainer writes it, with hostile ``.metadata`` bytes or a hostile
    non-tensor entry in the model's shard."""
    folder = root / "checkpoints" / "step_00000009"
    model = {"w": torch.ones(2)} if entry is None else {"w": torch.ones(2), "extra": entry}
    dcp.save({"model": model}, checkpoint_id=folder)
    if metadata is not None:
        (folder / ".metadata").write_bytes(metadata)
    torch.save({"format": "dcp", "position": {"step": 9, "epoch": 0, "batch": 9}}, folder / TRAINER_STATE)
    return folder


def _deepspeed_folder(root: Path, file: bytes) -> Path:
    folder = root / "checkpoints" / "step_00000009"
    (folder / "zero").mkdir(parents=True)
    (folder / "latest").write_text("zero")
    (folder / "zero" / "mp_rank_00_model_states.pt").write_bytes(file)
    torch.save({"format": "deepspeed", "position": {"step": 9, "epoch": 0, "batch": 9}}, folder / TRAINER_STATE)
    return folder


def _file_checkpoint(root: Path, file: bytes) -> Path:
    path = root / "checkpoints" / "step_00000009.pt"
    path.parent.mkdir(parents=True)
    path.write_bytes(file)
    return path


PLANTS: dict[str, Callable[[Path, bytes], Path]] = {
    "file": _file_checkpoint, "dcp .metadata": lambda root, b: _dcp_folder(root, metadata=b),
    "deepspeed": _deepspeed_folder}


@pytest.mark.parametrize("where", list(PLANTS))
def test_every_hostile_variant_in_every_format_is_refused(tmp_path: Path, where: str) -> None:
    marker = tmp_path / "ran"
    for i, (variant, data) in enumerate(_variants(marker).items()):
        root = tmp_path / f"run{i}"
        path = PLANTS[where](root, data)
        for reader in (TrainerState.read, consolidated_state_dict):
            with pytest.raises(UsageError) as err:
                reader(path)
            assert "refused" in _one_line(err.value) or "unreadable" in str(err.value), (variant, str(err.value))
        # the newest checkpoint of a run, as resume=auto finds it: refused, or (a file torch cannot even parse as
        # what it claims to be) skipped as unreadable; never loaded
        try:
            assert CheckpointManager(root).load("auto") is None, variant
        except RefusedFileError as err:
            _one_line(err)
    assert not marker.exists()


def test_a_hostile_entry_in_a_dcp_shard_is_refused(tmp_path: Path) -> None:
    """The ``.metadata`` is DCP's own; a non-tensor entry of the shard (torch unpickles those in full) runs code."""
    marker = tmp_path / "ran"
    for i, obj in enumerate(_objects(marker).values()):
        folder = _dcp_folder(tmp_path / f"run{i}", entry=obj)
        TrainerState.read(folder)  # the index is clean
        with pytest.raises(RefusedFileError, match=r"entry 'model\.extra'") as err:
            consolidated_state_dict(folder)
        _one_line(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("where", list(PLANTS))
def test_truncated_empty_and_garbage_files_are_one_line(tmp_path: Path, where: str) -> None:
    good = io.BytesIO()
    torch.save({"model": {"w": torch.ones(64)}, "position": {}}, good)
    cases = {**BROKEN, "truncated": good.getvalue()[: len(good.getvalue()) // 2]}
    for i, (case, data) in enumerate(cases.items()):
        path = PLANTS[where](tmp_path / f"run{i}", data)
        with pytest.raises(UsageError) as err:
            consolidated_state_dict(path)
        assert str(path) in _one_line(err.value), (case, str(err.value))


def test_a_folder_without_trainer_state_is_one_line(tmp_path: Path) -> None:
    """A run directory given where a checkpoint is read (the library's load_trained, read_checkpoint) is refused by
    name, not a FileNotFoundError for a trainer.pt the caller never named."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(UsageError, match=TRAINER_STATE) as err:
        consolidated_state_dict(run)
    assert str(run) in _one_line(err.value)


def test_broken_weights_files_are_one_line(tmp_path: Path) -> None:
    for case, data in BROKEN.items():
        for suffix, load in ((".pt", load_file), (".safetensors", load_safetensors)):
            path = tmp_path / f"{case}{suffix}"
            path.write_bytes(data)
            with pytest.raises(UsageError, match=r"unreadable|refused") as err:
                load(path, "model.init_from")
            _one_line(err.value)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sigmanens_dist.cli", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "dcp .metadata", "dcp shard entry", "deepspeed"])
def test_every_command_refuses_a_hostile_checkpoint(tmp_path: Path, where: str) -> None:
    """The issue's case: a malicious pickle with a zip appended (and the other formats' ways in; a file checkpoint
    as torch.save writes one), through each command a user runs: export, eval, model.init_from and resume=auto all
    exit 2 in one line; nothing ran."""
    marker = tmp_path / "ran"
    hostile = _variants(marker)["posix.system/torch zip" if where == "file" else "posix.system/zip tail"]
    run = tmp_path / "run"
    if where == "dcp shard entry":
        folder = _dcp_folder(run, entry=_objects(marker)["posix.system"])
    else:
        folder = PLANTS[where](run, hostile)
    for proc in (_cli("export", str(folder), str(tmp_path / "out.pt")),
                 _cli("eval", "--checkpoint", str(folder), "--no-mlflow")):
        assert proc.returncode == 2 and "refused" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    base = [*TINY_VIT, *SYNTHETIC, "train.batch_size=8", "train.max_steps=1", "eval.at_end=false"]
    proc = run_train(tmp_path / "new", *base, f"model.init_from={folder}", expect=2)
    assert "refused" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if where != "dcp shard entry":  # resume reads a folder's shards only in its strategy (FSDP: SafeDCPReader too)
        proc = run_train(run, *base, "checkpoint.resume=auto", expect=2)
        assert "refused" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()
