"""Atomic file writes: one policy for every file the package publishes (configs, checkpoints, markers, manifests).

A file is written under a temporary name in its own directory, given the mode a plain ``open()`` would have given it
(``0o666`` less the umask: ``mkstemp`` makes ``0600``, and run directories are often shared by a project group),
flushed to disk, renamed over the target, and the directory is flushed too, so after a crash the target is either
the old file or the whole new one, never a prefix, and the rename itself survives a power loss. A writer that fails
(or a process killed mid-write) leaves the old file untouched; an exception also removes the temporary file.

Named for the guarantee rather than ``io``: ``from sigmanens_dist import io`` would read as the standard library's.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sigmanens_dist.errors import UsageError

__all__ = ["atomic_path", "atomic_write", "check_writable_folder", "file_mode", "file_sha256", "replace_folder",
           "torch_save", "write_bytes", "write_text"]


def file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask."""
    return 0o666 & ~_umask()


def _umask() -> int:
    # /proc gives the umask without changing it: os.umask() can only read it by setting it, and another thread
    # creating a file in between (MLflow's, a data loader's) would get the temporary value.
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path`` for a writer that opens files by name (FFCV's); once the block ends
    without an exception it is published at ``path`` by the policy above, otherwise removed."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> Path:
    """``write(f)`` into a binary file published atomically at ``path``."""
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        write(f)
    return Path(path)


def write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` published atomically (a checkpoint is either the previous one or complete)."""
    import torch  # lazy: torch; the CLI imports this module for `--help`

    return atomic_write(path, lambda f: torch.save(obj, f))


def replace_folder(src: str | Path, dst: str | Path) -> None:
    """Publish the complete folder ``src`` at ``dst`` (a checkpoint folder, a converted checkpoint).

    A directory cannot be renamed over a non-empty one, so this is two renames: an existing ``dst`` is moved aside
    first and deleted only once ``src`` is in place (a crash between the two leaves the previous content intact at
    ``.<dst>.old``). Every file is flushed before the rename, so the rename cannot publish data still in the page
    cache."""
    src, dst = Path(src), Path(dst)
    for file in src.rglob("*"):
        if file.is_file():
            _fsync(file)
    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    _fsync_dir(dst.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync(file: Path) -> None:
    with file.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    """Flush a directory's entries (the rename). Some file systems cannot (EINVAL); their renames are as durable as
    they allow."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    """A file's SHA-256, read in 1 MiB blocks: what a manifest records of a file written whole (a shard, a
    program), to tell it from another or a torn one."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_writable_folder(path: Path, what: str) -> None:
    """Refuse in one line, writing nothing, a ``path`` that cannot be (or become) a folder this process writes into:
    a file there or in place of one of its parents, or a first existing parent that cannot be written. ``what``
    names the option in the message (``run_dir=``, ``--out ``). A command checks its output folder with this
    before it builds anything, so such a path is not found as a traceback at the first write."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{what}{path} is a file, not a folder")
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UsageError(f"{what}{path}: a part of this path is a file, not a folder ({existing})")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == path else existing
        raise UsageError(f"{what}{path} cannot be created or written: {where} is not writable (read-only file system "
                         "or permissions)")
