"""WebDataset tar shards read back: the manifest, and a streaming loader with the training loop's batch contract.

Shards (written by :mod:`.webdataset_write`: ``{split}-%06d.tar``, each sample ``__key__``, ``jpg`` or ``png`` for
images or ``txt`` (UTF-8) for sentences, ``cls``) are described by ``manifest.json`` (counts and sha256 per shard),
local or remote (:mod:`.remote`), so a loader can size its epoch without reading a tar, and a truncated or replaced
shard is caught before training starts.

Streaming cannot use ``ShardedBatchSampler``'s global permutation (no random access), so the loader keeps the parts
of its contract that matter to DDP instead:

* **Equal steps on every rank.** Each epoch the shard list is permuted from ``(seed, epoch)`` and dealt round-robin
  to the ``world_size × max(1, num_workers)`` streams (one per rank and DataLoader worker). Every stream then yields
  the same number of batches, ``L`` = what the *smallest* possible deal (the ``⌊S / streams⌋`` smallest shards)
  fills, so ``len()`` = ``workers × L`` is fixed for the whole run and no rank waits in an all-reduce. We chose this
  over ``resampled=True`` + ``with_epoch(n)`` because resampling draws shards with replacement: an epoch would repeat
  some samples and miss others, and its order could not be replayed from a resume point.
* **At most once per epoch.** No sample is seen twice in an epoch; a stream's samples past ``L`` full batches are
  dropped for that epoch (at most one shard plus ``B - 1`` samples a stream; none when every shard holds the same
  count, a multiple of B, and the shard count is a multiple of the stream count). Which ones are dropped changes with
  the epoch's deal.
* **Exact resume.** The deal, each stream's shuffle buffer and each sample's augmentation seed are functions of
  ``(seed, epoch)`` (and the sample's key), and batch ``i`` always comes from stream ``i mod workers``; so
  ``iter_epoch(epoch, start_batch)`` yields the very batches an uninterrupted epoch yields from ``start_batch`` on.
  Skipped batches are read but not decoded.

Evaluation should use the map-style val set (``EvalShardSampler``), which scores every sample exactly once.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.transforms import v2

from sigmanens_dist.atomic import file_sha256
from sigmanens_dist.data.bad_samples import BadSamples
from sigmanens_dist.data.sampler import epoch_seed, sample_seed, seeded
from sigmanens_dist.data.shard_cache import check_cache, open_cached
from sigmanens_dist.data.tar_samples import tar_samples
from sigmanens_dist.errors import MissingPathError, UsageError
from sigmanens_dist.progress import progress
from sigmanens_dist.storage.remote import ReadAhead, RemoteError, RemotePath, stream_items
from sigmanens_dist.storage.traffic import TRAFFIC

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "PARTIAL_MANIFEST", "SHARDS_GLOB", "Manifest", "Shard", "ShardError",
           "WebDatasetLoader", "image_transform", "iter_eval", "read_manifest"]

MANIFEST = "manifest.json"
PARTIAL_MANIFEST = "manifest.partial.json"
MANIFEST_FORMAT = "sigmanens-webdataset/1"
SHARDS_GLOB = "{split}-*.tar"  # every shard of a split (written as {split}-%06d.tar)


class ShardError(UsageError):
    """A shard that does not match its manifest, or holds a sample that cannot be read."""


# ---------------------------------------------------------------------------------------------------------------------
# Reading.


@dataclass(frozen=True)
class Shard:
    path: Path | RemotePath
    count: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    path: Path | RemotePath
    num_samples: int
    num_classes: int
    classes: list[str] | None
    shards: list[Shard]


# What a user runs to write shards again (the loaders' errors name it).
_RECONVERT = ("write the shards again with `sigmanens data convert --format webdataset --dataset NAME --root RAW "
              "--out DIR`")


def read_manifest(path: Path | RemotePath | str, verify: bool = False) -> Manifest:
    """The manifest at ``path`` (or ``path/manifest.json``), checked against the shards on disk: every shard must
    exist with the recorded size (a cheap stat; ``verify=True`` also re-hashes them). A remote manifest's shards are
    checked as they stream instead (size against the server's, sha256 at the end of each read)."""
    path = path if isinstance(path, RemotePath) else Path(path)
    path = path / MANIFEST if isinstance(path, Path) and path.is_dir() else path
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MissingPathError(f"{path}: no webdataset manifest; {_RECONVERT}") from None
    try:
        raw = json.loads(text)
        shards = [Shard(path.parent / s["name"], int(s["count"]), int(s["bytes"]), s["sha256"]) for s in raw["shards"]]
        manifest = Manifest(path, int(raw["num_samples"]), int(raw["num_classes"]), raw["classes"], shards)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise UsageError(f"{path}: not a {MANIFEST_FORMAT} manifest ({type(err).__name__}: {err}); "
                         f"{_RECONVERT}") from err
    if sum(s.count for s in shards) != manifest.num_samples:
        raise UsageError(f"{path}: shard counts add up to {sum(s.count for s in shards)}, "
                         f"but num_samples is {manifest.num_samples}")
    local = [s for s in shards if isinstance(s.path, Path)]
    for s in progress(local, desc=f"verifying {path.parent}", unit="shard", disable=not verify, leave=False):
        if not s.path.is_file():
            raise ShardError(f"shard {s.path} listed in {path} is missing")
        size = s.path.stat().st_size
        if size != s.bytes:
            raise ShardError(f"shard {s.path} is {size} bytes but {path} records {s.bytes} "
                             f"({'truncated' if size < s.bytes else 'replaced or appended to'}); {_RECONVERT}")
        if verify and file_sha256(s.path) != s.sha256:
            raise ShardError(f"shard {s.path}: sha256 differs from {path}; the shard is corrupt, {_RECONVERT}")
    return manifest


def image_transform(train: bool, img_size: int, mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    """PIL → normalised float (C, H, W): the ffcv-imagenet recipe (random-resized crop + flip, or resize to
    ``img_size / 0.875`` and centre crop), so loaders can be compared at the same work per image."""
    if train:
        geometry = [v2.RandomResizedCrop(img_size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        geometry = [v2.Resize(round(img_size / 0.875), antialias=True), v2.CenterCrop(img_size)]
    return v2.Compose([v2.ToImage(), *geometry, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def _records(shard: Shard) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` per sample, in tar order; truncation and stray members name shard and key. A
    remote shard survives dropped connections: :func:`stream_items` reads it again and skips what was yielded; with
    ``data.remote.cache_dir`` it is read from its node-local copy (data/shard_cache.py)."""
    if isinstance(shard.path, RemotePath):
        copy = open_cached(shard.path, shard.bytes, shard.sha256)
        if copy is None:
            return stream_items(shard.path, shard.bytes, shard.sha256, lambda body: _tar_records(shard, body))
        return _open_records(shard, copy)
    return _local_records(shard, shard.path)


def _stream_records(shards: list[Shard]) -> Iterator[tuple[Shard, str, dict[str, bytes]]]:
    """``(shard, key, parts)`` of ``shards`` in order; remote ones are downloaded whole ``data.remote.read_ahead``
    shards ahead of the one being read (:class:`ReadAhead`), so a slow request waits while earlier shards last. The
    items are the same either way: the tar is parsed from the downloaded copy as it would be from the stream."""
    depth = shards[0].path.settings.read_ahead if shards and isinstance(shards[0].path, RemotePath) else 0
    if depth == 0:
        for shard in shards:
            yield from ((shard, key, parts) for key, parts in _records(shard))
        return
    cache = shards[0].path.settings.cache_dir is not None
    with closing(ReadAhead([(s.path, s.bytes, s.sha256) for s in shards], depth, open_cached if cache else None)
                 ) as ahead:
        for shard, f in zip(shards, ahead, strict=True):
            yield from ((shard, key, parts) for key, parts in _tar_records(shard, f))


def _local_records(shard: Shard, path: Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    yield from _open_records(shard, path.open("rb"))


def _open_records(shard: Shard, f: IO[bytes]) -> Iterator[tuple[str, dict[str, bytes]]]:
    with f:
        yield from _tar_records(shard, f)


def _tar_records(shard: Shard, f: Any) -> Iterator[tuple[str, dict[str, bytes]]]:
    """The samples of one shard (:func:`.tar_samples.tar_samples`, predict's grouping too), checked against the
    count its manifest lists."""
    count, key = 0, None
    try:
        for key, parts in tar_samples(f):
            count += 1
            yield key, parts
    except (tarfile.TarError, OSError, EOFError) as err:
        at = f"after sample key {key!r}" if key is not None else "at its first sample"
        raise ShardError(f"shard {shard.path}: corrupt or truncated tar {at} ({err})") from err
    if count != shard.count:
        raise ShardError(f"shard {shard.path} ended after {count} samples (last key {key!r}) but its manifest "
                         f"lists {shard.count}: truncated or rewritten; {_RECONVERT}")


def _shuffled(items: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """Buffered shuffle (webdataset's scheme) driven by our own seeded ``rng``, so a resumed epoch replays it."""
    buf: list[Any] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        j = rng.randrange(size)
        yield buf[j]
        buf[j] = item
    rng.shuffle(buf)
    yield from buf


def _decode(shard: Shard, key: str, parts: dict[str, bytes]) -> tuple[Image.Image | str, int]:
    ext = next((e for e in ("jpg", "png", "txt") if e in parts), None)
    if ext is None or "cls" not in parts:
        raise ShardError(f"shard {shard.path}, sample key {key!r}: has members {sorted(parts)}; "
                         f"expected jpg, png or txt, and cls")
    try:
        label = int(parts["cls"])
        if ext == "txt":
            return parts["txt"].decode("utf-8"), label
        image = Image.open(io.BytesIO(parts[ext]))
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ShardError(f"shard {shard.path}, sample key {key!r}: cannot decode {ext}/cls "
                         f"({type(err).__name__}: {err})") from err
    return (image if image.mode in ("L", "RGB") else image.convert("RGB")), label


def _checked_decode(shard: Shard, key: str, parts: dict[str, bytes], num_classes: int, bad: BadSamples
                    ) -> tuple[Image.Image | str, int] | None:
    """Decoded sample with its label checked against the manifest, or None when ``bad`` skips it."""
    try:
        image, label = _decode(shard, key, parts)
        if not 0 <= label < num_classes:
            raise ShardError(f"shard {shard.path}, sample key {key!r}: label {label} outside 0..{num_classes - 1}")
    except ShardError as err:  # already names shard and key
        if not bad.skipping:
            raise
        bad.skip(f"shard {shard.path.name} sample {key!r}", err)
        return None
    return image, label


@dataclass(frozen=True)
class _Failed:
    """A data error in a DataLoader worker, passed on as an item: raised in the worker, torch would re-raise it in
    the main process with the worker's traceback folded into its message, and the trainer's one-line report of a
    bad shard or URL would become a page."""

    error: Exception


@dataclass(frozen=True)
class _Counted:
    """A batch from a DataLoader worker streaming remote shards, with what the worker received since its last batch
    and its downloads under way (:meth:`Traffic.report`): the trainer's throughput line counts every worker."""

    batch: tuple[Any, ...]
    worker: int
    received: int
    active: int


class _RankStream(IterableDataset):
    """This rank's part of one epoch; DataLoader worker ``w`` runs stream ``(w + start_batch) mod workers``, so the
    DataLoader's round-robin over workers yields batches ``start_batch, start_batch + 1, ...`` in order."""

    def __init__(self, loader: WebDatasetLoader, epoch: int, start_batch: int) -> None:
        self.loader, self.epoch, self.start_batch = loader, epoch, start_batch

    def __iter__(self) -> Iterator[tuple[Any, ...] | _Counted | _Failed]:
        info = get_worker_info()
        counted = info is not None and isinstance(self.loader.manifest.path, RemotePath)
        try:
            for batch in self._batches():
                yield _Counted(batch, info.id, *TRAFFIC.report()) if counted else batch
        except (ShardError, RemoteError) as err:
            yield _Failed(err)

    def _batches(self) -> Iterator[tuple[Any, ...]]:
        ld = self.loader
        info = get_worker_info()
        stream = ((info.id if info is not None else 0) + self.start_batch) % ld.workers
        shards = ld.epoch_shards(self.epoch)[stream]
        skip = max(0, -(-(self.start_batch - stream) // ld.workers))  # batches of this stream before start_batch
        rng = random.Random(sample_seed(ld.seed, self.epoch, 1 + ld.rank * ld.workers + stream))
        source = _stream_records(shards)
        records = _shuffled(source, ld.shuffle_buffer, rng) if ld.shuffle_buffer > 1 else source
        try:
            for j in range(ld.batches_per_stream):
                batch = [next(records, None) for _ in range(ld.batch_size)]
                if batch[-1] is None:
                    raise ShardError(f"shards {[str(s.path) for s in shards]} ran out after batch {j}, before the "
                                     f"{ld.batches_per_stream} their manifest counts promise")
                if j >= skip:
                    yield self._collate(batch)
        finally:
            source.close()  # stops the read-ahead of shards this epoch leaves unread

    def _collate(self, batch: list[tuple[Shard, str, dict[str, bytes]]]) -> tuple[Any, ...]:
        ld = self.loader
        images, labels, keys = [], [], []
        for shard, key, parts in batch:
            decoded = _checked_decode(shard, key, parts, ld.num_classes, ld.bad)
            if decoded is None:
                continue
            image, label = decoded
            keys.append(key)
            labels.append(label)
            if ld.transform is None:
                images.append(image)
                continue
            with seeded(sample_seed(ld.seed, self.epoch, int(key) if key.isdigit() else zlib.crc32(key.encode()))):
                images.append(ld.transform(image))
        if not images:
            raise ShardError(f"all {len(batch)} samples of a batch were unreadable and skipped")
        out = (ld.collate(images), torch.tensor(labels, dtype=torch.int64))
        return (*out, keys) if ld.return_keys else out


class WebDatasetLoader:
    """Per-rank batches ``(images (B, C, H, W) float, labels (B,) int64)`` streamed from the shards of a
    :func:`write_shards` manifest; see the module docstring for the equal-steps and resume guarantees.

    ``transform`` maps a PIL image to a normalised ``(C, H, W)`` float tensor (:func:`image_transform` gives the
    standard ones); it runs under a per-sample seed, so augmentation also replays on resume. ``collate`` makes the
    batch from the transformed samples. Text: ``transform=None`` and ``collate`` a ``TextBatcher`` (sentences →
    token-id tensors), run in the DataLoader workers.
    """

    def __init__(self, manifest: Path | RemotePath | str, batch_size: int, rank: int, world_size: int,
                 num_workers: int, seed: int, transform: Callable[[Image.Image], torch.Tensor] | None,
                 shuffle_buffer: int = 1000, return_keys: bool = False, bad: BadSamples | None = None,
                 collate: Callable[[list[Any]], Any] = torch.stack) -> None:
        # an invariant: the loaders pass the process group's rank and checked sizes
        if not 0 <= rank < world_size or batch_size < 1 or num_workers < 0:
            raise ValueError(f"need 0 ≤ rank < world_size, batch_size ≥ 1, num_workers ≥ 0; got rank={rank}, "
                             f"world_size={world_size}, batch_size={batch_size}, num_workers={num_workers}")
        self.manifest = read_manifest(manifest)
        if isinstance(self.manifest.path, RemotePath):
            check_cache(self.manifest.path.settings)  # before any worker forks: they inherit its verdict
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.num_workers, self.workers = num_workers, max(1, num_workers)
        self.transform, self.shuffle_buffer, self.return_keys = transform, shuffle_buffer, return_keys
        self.collate = collate
        self.bad = bad or BadSamples("error")
        streams = world_size * self.workers
        shards = self.manifest.shards
        if len(shards) < streams:
            raise UsageError(f"{self.manifest.path}: {len(shards)} shards cannot feed {world_size} ranks × "
                             f"{self.workers} workers = {streams} streams, each of which needs whole shards; "
                             f"re-shard with write_shards(max_count ≤ {self.manifest.num_samples // streams}) or use "
                             f"fewer workers")
        smallest = sorted(s.count for s in shards)[: len(shards) // streams]
        self.batches_per_stream = sum(smallest) // batch_size
        if self.batches_per_stream == 0:
            raise UsageError(f"{self.manifest.path}: the {len(smallest)} smallest shards a stream may get hold "
                             f"{sum(smallest)} samples, less than one batch of {batch_size}; lower the batch size or "
                             f"use fewer ranks × workers")

    @property
    def num_classes(self) -> int:
        return self.manifest.num_classes

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank and in every epoch."""
        return self.workers * self.batches_per_stream

    def epoch_shards(self, epoch: int) -> list[list[Shard]]:
        """This rank's shards per stream: the epoch's shard permutation dealt round-robin over ranks × workers."""
        g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        order = torch.randperm(len(self.manifest.shards), generator=g).tolist()
        dealt = [self.manifest.shards[s] for j, s in enumerate(order) if j % self.world_size == self.rank]
        return [dealt[k::self.workers] for k in range(self.workers)]

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Any, ...]]:
        """Batches ``start_batch .. len() - 1`` of ``epoch``: the same ones, in the same order, as a full pass."""
        # an invariant: the position comes from this run's own checkpoint (a bug if hit)
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start batch {start_batch} outside an epoch of {len(self)} batches")
        if start_batch == len(self):
            return
        loader = DataLoader(_RankStream(self, epoch, start_batch), batch_size=None, num_workers=self.num_workers,
                            prefetch_factor=4 if self.num_workers else None)
        n = 0
        try:
            for batch in loader:
                if isinstance(batch, _Failed):
                    raise batch.error
                if isinstance(batch, _Counted):
                    TRAFFIC.merge(batch.worker, batch.received, batch.active)
                    batch = batch.batch
                yield batch
                n += 1
        finally:
            TRAFFIC.workers_done()
        if n != len(self) - start_batch:  # a stream ending early would desynchronise the ranks
            raise ShardError(f"{self.manifest.path}: epoch {epoch} yielded {n} batches from {start_batch}, "
                             f"expected {len(self) - start_batch}")


def iter_eval(manifest: Path | RemotePath | str, rank: int, world_size: int, batch_size: int,
              transform: Callable[[Image.Image], torch.Tensor] | None, bad: BadSamples | None = None,
              collate: Callable[[list[Any]], Any] = torch.stack) -> Iterator[tuple[Any, torch.Tensor]]:
    """Evaluation pass: rank r decodes samples ``r, r + W, …`` of the manifest's order, so every sample is scored
    exactly once across ranks however few shards the split has (ranks read all shards but decode only their own;
    evaluation runs no collective per batch, so ranks may end with different batch counts). ``transform`` and
    ``collate`` as for :class:`WebDatasetLoader`."""
    images: list[torch.Tensor] = []
    labels: list[int] = []
    index, bad = 0, bad or BadSamples("error")
    man = read_manifest(manifest)
    for shard, key, parts in _stream_records(man.shards):
        mine, index = index % world_size == rank, index + 1
        decoded = _checked_decode(shard, key, parts, man.num_classes, bad) if mine else None
        if decoded is None:
            continue
        image, label = decoded
        images.append(transform(image) if transform is not None else image)
        labels.append(label)
        if len(images) == batch_size:
            yield collate(images), torch.tensor(labels, dtype=torch.int64)
            images, labels = [], []
    if images:
        yield collate(images), torch.tensor(labels, dtype=torch.int64)
