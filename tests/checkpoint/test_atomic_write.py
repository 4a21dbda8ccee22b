"""The one atomic-write policy (sigmanens_dist/atomic.py): the mode follows the umask, a failed or killed writer
leaves the old file and no temporary file, folders are replaced whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from sigmanens_dist.atomic import atomic_path, atomic_write, replace_folder, torch_save, write_text


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_mode_follows_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        text = write_text(tmp_path / "a.yaml", "x: 1\n")
        ckpt = torch_save({"w": torch.ones(2)}, tmp_path / "a.pt")
        with atomic_path(tmp_path / "a.beton") as tmp:
            tmp.write_bytes(b"by name")
    finally:
        os.umask(old)
    for path in (text, ckpt, tmp_path / "a.beton"):
        assert _mode(path) == 0o666 & ~umask, path
    assert torch.load(ckpt)["w"].tolist() == [1.0, 1.0]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = write_text(tmp_path / "config.yaml", "old\n")

    def half(f) -> None:
        f.write(b"new, half of it")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half)
    with pytest.raises(KeyboardInterrupt), atomic_path(path) as tmp:
        tmp.write_text("new, by name")
        raise KeyboardInterrupt
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_killed_writer_leaves_the_old_file(tmp_path: Path) -> None:
    path = write_text(tmp_path / "state.pt", "old")
    script = textwrap.dedent(f"""
        import os, signal
        from sigmanens_dist.atomic import atomic_write

        def write(f):
            f.write(b"new, half of it")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        atomic_write({str(path)!r}, write)
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert path.read_text() == "old"
    leftovers = [p.name for p in tmp_path.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].startswith(".state.pt.") and leftovers[0].endswith(".tmp")


def test_replace_folder_swaps_the_whole_folder(tmp_path: Path) -> None:
    dst = tmp_path / "step_1"
    dst.mkdir()
    (dst / "old.bin").write_bytes(b"old")
    src = tmp_path / ".step_1.tmp"
    src.mkdir()
    (src / "new.bin").write_bytes(b"new")
    replace_folder(src, dst)
    assert [p.name for p in dst.iterdir()] == ["new.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # neither the source nor the old folder
