"""Node-local copies of remote shards (``data.remote.cache_dir``): a shard is downloaded once per node, not once per
epoch, rank, worker and member stream, which is what streaming costs without it (σN-Ens with members on their own
batches reads every shard M times an epoch).

A copy is named by the sha256 its manifest records and published atomically once its bytes check against that
sha256 and size, so a rewritten shard is never read from a stale copy, and ranks and DataLoader workers on one node
share the folder safely (two that fetch the same shard at once publish the same bytes). Using a copy marks it recently
used; after each download the least recently used copies are deleted until the folder holds at most
``data.remote.cache_gb`` (a reader that has a deleted copy open keeps reading it). A shard whose manifest records no
sha256 is streamed, not cached. Copies are read without checking their sha256 again: the folder is trusted as the
node's own disk is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import IO

from sigmanens_dist.atomic import atomic_path
from sigmanens_dist.data.remote import RemotePath, download

__all__ = ["cached_copy", "open_cached"]

log = logging.getLogger(__name__)


def cached_copy(path: RemotePath, size: int | None, sha256: str | None) -> Path | None:
    """The node-local copy of the shard at ``path``, downloaded first if the cache lacks it; None when the cache is
    off or the manifest gives no sha256 to name the copy by."""
    folder = path.settings.cache_dir
    if folder is None or sha256 is None:
        return None
    copy = folder / f"{sha256}.tar"
    if copy.is_file() and (size is None or copy.stat().st_size == size):
        os.utime(copy)  # recently used: evicted last
        return copy
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(copy) as tmp, tmp.open("wb") as f:
        download(path, size, sha256, f)  # retried, size and sha256 checked
    _evict(folder, keep=copy, limit=round(path.settings.cache_gb * 2**30))
    return copy


def open_cached(path: RemotePath, size: int | None, sha256: str | None) -> IO[bytes] | None:
    """The cached copy open for reading (see :func:`cached_copy`), or None to stream the shard instead."""
    copy = cached_copy(path, size, sha256)
    return None if copy is None else copy.open("rb")


def _evict(folder: Path, keep: Path, limit: int) -> None:
    """Deletes the least recently used copies (never ``keep``) until the folder holds at most ``limit`` bytes."""
    copies = []
    for copy in folder.glob("*.tar"):
        try:
            stat = copy.stat()
        except FileNotFoundError:  # evicted by another process meanwhile
            continue
        copies.append((stat.st_mtime, stat.st_size, copy))
    total = sum(size for _, size, _ in copies)
    for _, size, copy in sorted(copies):
        if total <= limit:
            break
        if copy != keep:
            copy.unlink(missing_ok=True)
            total -= size
    if total > limit:
        log.warning("shard cache %s: %.2f GB in use, over data.remote.cache_gb=%g (one shard is larger than the "
                    "limit)", folder, total / 2**30, limit / 2**30)
