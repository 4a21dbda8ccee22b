"""The samples of a webdataset tar shard: one grouping of its members for training (:mod:`.webdataset_io`) and for
``sigmanens predict`` (:mod:`sigmanens_dist.predict.inputs`), so that a shard means the same samples to both.

A sample is the consecutive members sharing a key: the member's path up to the first dot of its file name, folders
included (webdataset's own convention, so ``a/0001.jpg`` and ``b/0001.jpg`` are two samples); the rest of the
name, lower-cased, names the part (``jpg``, ``cls``, ``seg.png``). Torch-free: predict reads shards without the
training loaders.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from typing import IO

__all__ = ["sample_key", "tar_samples"]


def sample_key(name: str) -> tuple[str, str]:
    """A tar member's name → (its sample's key, its part's extension)."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def tar_samples(f: IO[bytes]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` of each sample of the tar streamed from ``f``, in tar order. A corrupt or
    truncated tar raises ``tarfile.TarError``/``OSError``/``EOFError`` where it breaks: the caller says which
    shard, after which key."""
    key, parts = None, {}
    with tarfile.open(fileobj=f, mode="r|") as tar:
        for member in tar:
            if not member.isreg():
                continue
            member_key, ext = sample_key(member.name)
            if member_key != key:
                if key is not None:
                    yield key, parts
                key, parts = member_key, {}
            reader = tar.extractfile(member)
            parts[ext] = reader.read() if reader is not None else b""
    if key is not None:
        yield key, parts
