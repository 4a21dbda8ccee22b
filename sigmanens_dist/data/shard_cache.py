"""Node-local copies of remote shards (``data.remote.cache_dir``): a shard is downloaded once per node, not once per
epoch, rank, worker and member stream, which is what streaming costs without it (σN-Ens with members on their own
batches reads every shard M times an epoch).

A copy is named by the sha256 its manifest records and published atomically once its bytes check against that
sha256 and size, so a rewritten shard is never read from a stale copy, and ranks, DataLoader workers and other jobs
on one node share the folder safely (two that fetch the same shard at once publish the same bytes). A reader is
handed its copy open, never by name: after each download the least recently used copies are deleted until the
folder holds at most ``data.remote.cache_gb``, and a copy deleted while open stays readable (its disk space is freed
when the reader closes it), so another process's eviction cannot take a shard from a reader it was handed to. Using
a copy marks it recently used. A shard whose manifest records no sha256 is streamed, not cached. Copies are read
without checking their sha256 again: the folder is trusted as the node's own disk is.

A folder that cannot take a copy (read-only, full, not a folder) is one warning, from the first process of the rank
(its own or a DataLoader worker's) that meets it, and from then on the shards it does not hold are streamed
uncached; with ``data.remote.cache_required`` it is a :class:`CacheUnwritable` instead (a usage error, one line).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import multiprocessing
import os
import re
import tempfile
from pathlib import Path
from typing import IO

from sigmanens_dist.atomic import atomic_path
from sigmanens_dist.errors import UsageError
from sigmanens_dist.storage.remote import RemoteError, RemotePath, RemoteSettings, download

__all__ = ["CacheUnwritable", "check_cache", "open_cached"]

log = logging.getLogger(__name__)

_COPY = re.compile(r"[0-9a-f]{64}\.tar")  # what the cache writes: eviction never deletes any other file
_SLOT = 32  # a sha256 digest

# The cache folders found unwritable by this process or the DataLoader workers it forked, a digest of each path per
# slot, in memory they share: the first process to meet a read-only or full folder warns, the others (this
# epoch's workers and the next epoch's) stream quietly.
_OFF = multiprocessing.Array(ctypes.c_char, 64 * _SLOT)


class CacheUnwritable(RemoteError, UsageError):
    """``data.remote.cache_required`` and the cache folder cannot take a copy: the run stops rather than stream."""


def check_cache(settings: RemoteSettings) -> None:
    """Writes and removes a small file in the cache folder before any shard is read, so a folder that cannot take
    one is found by the main process (its DataLoader workers inherit the verdict) and, with
    ``data.remote.cache_required``, refused before compute starts."""
    folder = settings.cache_dir
    if folder is None or _is_off(folder):
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe.") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        _unwritable(folder, settings.cache_required, err)


def open_cached(path: RemotePath, size: int | None, sha256: str | None) -> IO[bytes] | None:
    """The node-local copy of the shard at ``path``, downloaded first if the cache lacks it, open for reading at its
    start; None to stream the shard instead: the cache is off, the manifest gives no sha256 to name the copy by, or
    the folder cannot take a copy."""
    settings = path.settings
    folder = settings.cache_dir
    if folder is None or sha256 is None:
        return None
    copy = folder / f"{sha256}.tar"
    f = _open_copy(copy, size)
    if f is not None or _is_off(folder):
        return f
    try:
        f = _download(path, size, sha256, copy)
    except RemoteError:
        raise
    except OSError as err:  # the folder's, not the server's: those are RemoteErrors
        _unwritable(folder, settings.cache_required, err)
        return None
    _evict(folder, keep=copy, limit=round(settings.cache_gb * 2**30))
    return f


def _open_copy(copy: Path, size: int | None) -> IO[bytes] | None:
    """The copy open and marked recently used, or None when there is none to read (absent, evicted, unreadable, or
    of another size: it is downloaded again)."""
    try:
        f = copy.open("rb")
    except OSError:
        return None
    if size is not None and os.fstat(f.fileno()).st_size != size:
        f.close()
        return None
    with contextlib.suppress(OSError):  # a read-only folder or another user's copy: read, just not marked
        os.utime(f.fileno())
    return f


def _download(path: RemotePath, size: int | None, sha256: str, copy: Path) -> IO[bytes]:
    """The shard downloaded into a temporary file beside ``copy``, published there once checked, and returned open:
    the handle that wrote it is the one the reader reads, so no eviction can come between the two."""
    copy.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as on_error:
        with atomic_path(copy) as tmp:
            f = on_error.enter_context(tmp.open("w+b"))
            download(path, size, sha256, f)  # retried, size and sha256 checked
            f.flush()  # before atomic_path's fsync
        on_error.pop_all()
    f.seek(0)
    return f


def _unwritable(folder: Path, required: bool, err: OSError) -> None:
    """One warning for the run, and the shards are streamed; with ``data.remote.cache_required``, a usage error."""
    reason = err.strerror or str(err)
    if required:
        raise CacheUnwritable(f"data.remote.cache_dir={folder} cannot take a shard copy ({reason}) and "
                              "data.remote.cache_required=true: free space or give a writable folder, or set "
                              "data.remote.cache_required=false to stream the shards uncached") from None
    if _turn_off(folder):
        log.warning("data.remote.cache_dir=%s cannot take a shard copy (%s): for the rest of this run the shards "
                    "it does not hold are streamed, uncached", folder, reason)


def _digest(folder: Path) -> bytes:
    return hashlib.sha256(os.fsencode(os.path.abspath(folder))).digest()


def _is_off(folder: Path) -> bool:
    key, raw = _digest(folder), _OFF.raw
    return any(raw[i:i + _SLOT] == key for i in range(0, len(raw), _SLOT))


def _turn_off(folder: Path) -> bool:
    """Records the folder as unwritable for the run; True for the one process that does so first (it warns)."""
    key, empty = _digest(folder), bytes(_SLOT)
    with _OFF.get_lock():
        raw = _OFF.raw
        slots = [raw[i:i + _SLOT] for i in range(0, len(raw), _SLOT)]
        if key in slots:
            return False
        if empty in slots:  # all taken (64 folders in one run): it warns again, harmlessly
            i = slots.index(empty) * _SLOT
            _OFF[i:i + _SLOT] = key
    return True


def _evict(folder: Path, keep: Path, limit: int) -> None:
    """Deletes the least recently used copies (never ``keep``) until the folder holds at most ``limit`` bytes; a
    reader that has one open keeps reading it."""
    copies = []
    for copy in folder.glob("*.tar"):
        if not _COPY.fullmatch(copy.name):
            continue
        try:
            stat = copy.stat()
        except FileNotFoundError:  # evicted by another process meanwhile
            continue
        copies.append((stat.st_mtime, stat.st_size, copy))
    total = sum(size for _, size, _ in copies)
    for _, size, copy in sorted(copies):
        if total <= limit:
            break
        if copy == keep:
            continue
        try:
            copy.unlink(missing_ok=True)
        except OSError:  # another user's copy in a sticky folder: it stays
            continue
        total -= size
    if total > limit:
        log.warning("shard cache %s: %.2f GB in use, over data.remote.cache_gb=%g (a shard larger than the limit, or "
                    "copies this user cannot delete)", folder, total / 2**30, limit / 2**30)
