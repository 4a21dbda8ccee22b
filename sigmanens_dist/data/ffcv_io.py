"""FFCV ``.beton`` files: the ffcv-imagenet writer recipe for images, sentences for text, and loaders with the
training loop's batch contract (``FFCVLoader`` for images, ``FFCVTextLoader`` for sentences, tokenised per batch).

The loader keeps ``ShardedBatchSampler``'s order exactly (for ``train=True``): each epoch one global permutation
from ``(seed, epoch)``, rank r taking its B-slice of every global batch, ``len()`` = N // (B·W) on every rank, and
``iter_epoch(epoch, start_batch)`` resuming at the very batch. So a run can move between the map-style loader and
FFCV without changing which samples meet in a batch. We give FFCV that order ourselves instead of
``distributed=True``, whose ``DistributedSampler`` pads, interleaves (``perm[rank::W]``) and needs a process group.
``train=False`` follows ``EvalShardSampler``: contiguous, unpadded per-rank slices, every sample scored once.

Images decode through ``ffcv_decode.SeededCropDecoder``: each sample's crop and flip are a function of
``(seed, epoch, sample index)``, so a resumed epoch replays the augmentation exactly too. ``randaugment`` adds timm's
auto-augmentation of each crop in worker processes (``ffcv_augment``), seeded per sample as the other readers do.

Grayscale sources are stored as 3-channel RGB (the channel repeated): FFCV's ``RGBImageField`` holds only RGB.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import Process, Queue, SimpleQueue, Value
from pathlib import Path
from queue import Empty
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from sigmanens_dist.atomic import atomic_path
from sigmanens_dist.data.sampler import EvalShardSampler, ShardedBatchSampler
from sigmanens_dist.data.sources import read_source, unwrap_source
from sigmanens_dist.data.sst2 import TextDataset
from sigmanens_dist.errors import MissingPathError, UnsupportedError, UsageError
from sigmanens_dist.progress import progress

__all__ = ["EVAL_CROP_RATIO", "FFCVLoader", "FFCVTextLoader", "check_beton", "write_beton", "write_text_beton"]

# the evaluation crop: the centre 0.875 of the shorter side (FFCV's and timm's default), what an exported program of an
# FFCV-trained run applies to an image file (sigmanens_dist/export/image_input.py)
EVAL_CROP_RATIO = 0.875


def _ffcv() -> Any:
    try:
        import ffcv  # optional extra: ffcv
    except ImportError as err:
        raise UnsupportedError("the FFCV format needs FFCV, which is not installed: apt-get install pkg-config "
                               "libturbojpeg0-dev libopencv-dev, then pip install 'sigmanens-dist[ffcv]'") from err
    return ffcv


def _image_fields(dataset: Dataset, index: int) -> tuple[np.ndarray, int]:
    """``(HWC uint8 RGB, label)``: grayscale repeated to three channels."""
    pixels, label = read_source(dataset, index)
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[..., None], 3, axis=2)
    return pixels, label


def _text_fields(dataset: Dataset, index: int) -> tuple[np.ndarray, int, int]:
    """``(UTF-8 bytes, their length, label)``: FFCV's bytes decoder pads to the longest sample and keeps no length."""
    text, label = dataset[index]
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return data, data.size, int(label)


class _Source(Dataset):
    """A sample's field values as FFCV's fields expect (``read``); a failing sample is reported to the parent
    process, which would otherwise wait forever on a dead writer worker."""

    def __init__(self, dataset: Dataset, errors: SimpleQueue, read: Callable[[Dataset, int], tuple[Any, ...]]) -> None:
        self.dataset, self.errors, self.read = dataset, errors, read

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        try:
            return self.read(self.dataset, index)
        except Exception as err:
            self.errors.put(f"sample {index}: {type(err).__name__}: {err}")
            raise


def _writer_class() -> type:
    from ffcv.memory_allocator import MemoryAllocator  # optional extra: ffcv
    from ffcv.writer import DatasetWriter

    class Writer(DatasetWriter):
        """FFCV 1.0.2's writer loop, except that a worker that dies fails the write (its sample's error in the
        message) instead of leaving the parent polling a progress counter that never completes."""

        def __init__(self, tmp: Path, target: Path, fields: dict[str, Any], num_workers: int,
                     errors: SimpleQueue) -> None:
            super().__init__(str(tmp), fields, num_workers=num_workers)
            self.target, self.errors = target, errors

        def _write_common(self, num_samples: int, queue_content: Any, work_fn: Any,
                          extra_worker_args: tuple[Any, ...]) -> None:
            self.num_samples = num_samples
            self.prepare()
            todo, allocations_queue = Queue(), Queue()
            for chunk in queue_content:
                todo.put(chunk)
            for _ in range(self.num_workers):
                todo.put(None)
            done = Value(ctypes.c_uint64, 0)
            allocator = MemoryAllocator(self.fname, self.data_region_start, self.page_size)
            args = (todo, self.metadata_sm, self.metadata_type, self.fields, allocator, done, allocations_queue,
                    *extra_worker_args)
            workers = [Process(target=work_fn, args=args) for _ in range(self.num_workers)]
            for p in workers:
                p.start()
            try:
                allocations: list[Any] = []
                with progress(total=num_samples, desc=f"ffcv → {self.target}", unit="img") as bar:
                    received = 0
                    while received < len(workers):
                        self._check_workers(workers)
                        bar.update(done.value - bar.n)
                        try:
                            allocations.extend(allocations_queue.get(timeout=0.1))
                            received += 1
                        except Empty:
                            pass
                    bar.update(done.value - bar.n)
                for p in workers:
                    p.join()
                self.finalize(allocations)
            finally:
                for p in workers:
                    if p.is_alive():
                        p.terminate()
                self.metadata_sm.close()
                self.metadata_sm.unlink()

        def _check_workers(self, workers: list[Process]) -> None:
            dead = [p.exitcode for p in workers if p.exitcode not in (None, 0)]
            if dead:  # a crash (out of memory, a bad file), not a refusal: it keeps its traceback
                cause = self.errors.get() if not self.errors.empty() else "see the worker traceback above"
                raise RuntimeError(f"writing {self.target}: a writer worker exited with code {dead[0]}: {cause}")

    return Writer


def write_beton(dataset: Dataset, path: Path | str, *, max_resolution: int | None = 500, jpeg_quality: int = 90,
                write_mode: Literal["proportion", "jpg", "raw", "smart"] = "proportion",
                compress_probability: float = 0.5, num_workers: int = 2, chunksize: int = 100) -> Path:
    """Writes ``dataset`` to ``path`` as ffcv-imagenet does: ``image`` an ``RGBImageField`` (longer side capped at
    ``max_resolution``; with ``write_mode='proportion'`` a ``compress_probability`` fraction stored as JPEG at
    ``jpeg_quality``, the rest raw, trading disk for decode time) and ``label`` an ``IntField``.

    Written under a temporary name and renamed when complete, so ``path`` never holds a partial file.
    """
    _ffcv()
    from ffcv.fields import IntField, RGBImageField  # optional extra: ffcv

    modes = ("proportion", "jpg", "raw", "smart")
    if write_mode not in modes:
        raise UsageError(f"write_mode={write_mode!r} is not one of {', '.join(modes)}")
    if not 0.0 <= compress_probability <= 1.0 or not 1 <= jpeg_quality <= 100:
        raise UsageError(f"need compress_probability in [0, 1] and jpeg_quality in 1..100; got "
                         f"{compress_probability}, {jpeg_quality}")
    fields = {"image": RGBImageField(write_mode=write_mode, max_resolution=max_resolution, jpeg_quality=jpeg_quality,
                                     compress_probability=compress_probability),
              "label": IntField()}
    return _write(unwrap_source(dataset), path, fields, _image_fields, num_workers, chunksize)


def write_text_beton(dataset: TextDataset, path: Path | str, *, num_workers: int = 2, chunksize: int = 100) -> Path:
    """Writes ``(sentence, label)`` samples to ``path``: ``text`` a ``BytesField`` (UTF-8), ``length`` and ``label``
    ``IntField``s. Sentences, not token ids, so the tokenizer stays the training config's choice."""
    _ffcv()
    from ffcv.fields import BytesField, IntField  # optional extra: ffcv

    fields = {"text": BytesField(), "length": IntField(), "label": IntField()}
    return _write(dataset, path, fields, _text_fields, num_workers, chunksize)


def _write(dataset: Dataset, path: Path | str, fields: dict[str, Any],
           read: Callable[[Dataset, int], tuple[Any, ...]], num_workers: int, chunksize: int) -> Path:
    """``fields`` of every sample (``read(dataset, i)``) to a temporary file, renamed to ``path`` once complete."""
    if len(dataset) == 0:
        raise UsageError(f"writing {path}: the dataset is empty")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    errors: SimpleQueue = SimpleQueue()
    with atomic_path(path) as tmp:
        writer = _writer_class()(tmp, path, fields, max(1, num_workers), errors)
        writer.from_indexed_dataset(_Source(dataset, errors, read), chunksize=chunksize)
    return path


# The fields of each kind of .beton (FFCV type ids: 1 IntField, 2 RGBImageField, 3 BytesField), and the field and
# metadata column that point at each sample's payload.
_KINDS = {"image": ({"image": 2, "label": 1}, "image", "data_ptr"),
          "text": ({"text": 3, "length": 1, "label": 1}, "text", "ptr")}


def check_beton(path: Path | str, kind: Literal["image", "text"] = "image") -> int:
    """Number of samples in a ``.beton`` of ``kind`` (:func:`write_beton`'s image and label, or
    :func:`write_text_beton`'s text, length and label), after checking that its header, metadata and allocation
    table are whole and point inside the file (FFCV itself would read past a truncated file's end, or crash in
    compiled code). Payloads themselves carry no checksum."""
    _ffcv()
    from ffcv.types import (  # optional extra: ffcv
        ALLOC_TABLE_TYPE,
        CURRENT_VERSION,
        FieldDescType,
        HeaderType,
        get_handlers,
        get_metadata_type,
    )
    from ffcv.utils import decode_null_terminated_string  # optional extra: ffcv

    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"{path}: no such .beton file; write one with "
                               f"{'write_beton()' if kind == 'image' else 'write_text_beton()'}")
    size = path.stat().st_size

    writer = "write_beton()" if kind == "image" else "write_text_beton() (sigmanens data convert --dataset sst2)"

    def bad(why: str) -> UsageError:
        # the user's file, not a crash: one line and exit 2, which Slurm does not retry (a retry reads it again)
        return UsageError(f"{path}: corrupt or truncated .beton ({why}); re-run {writer}")

    if size < HeaderType.itemsize:
        raise bad(f"{size} bytes, shorter than the {HeaderType.itemsize}-byte header")
    header = np.fromfile(path, dtype=HeaderType, count=1)[0]
    if header["version"] != CURRENT_VERSION:
        raise bad(f"format version {header['version']}, this FFCV reads {CURRENT_VERSION}")
    n_fields, n = int(header["num_fields"]), int(header["num_samples"])
    meta_start = HeaderType.itemsize + n_fields * FieldDescType.itemsize
    if n_fields == 0 or meta_start > size:
        raise bad(f"{n_fields} field descriptors do not fit in {size} bytes")
    desc = np.fromfile(path, dtype=FieldDescType, count=n_fields, offset=HeaderType.itemsize)
    names = [decode_null_terminated_string(d["name"]) for d in desc]
    expected, payload, pointer = _KINDS[kind]
    found = {name: int(d["type_id"]) for name, d in zip(names, desc, strict=True)}
    if any(found.get(k) != v for k, v in expected.items()):
        raise bad(f"fields {found} (FFCV type ids); expected {expected} for {kind} data")
    meta_type = get_metadata_type(get_handlers(desc))
    meta_end, alloc_ptr = meta_start + n * meta_type.itemsize, int(header["alloc_table_ptr"])
    if not meta_end <= alloc_ptr <= size or (size - alloc_ptr) % ALLOC_TABLE_TYPE.itemsize:
        raise bad(f"allocation table at byte {alloc_ptr} does not fit a {size}-byte file whose metadata ends at "
                  f"{meta_end}")
    alloc = np.fromfile(path, dtype=ALLOC_TABLE_TYPE, offset=alloc_ptr)
    if len(alloc) and ((alloc["ptr"] < meta_end).any() or (alloc["ptr"] + alloc["size"] > alloc_ptr).any()
                       or (alloc["sample_id"] >= n).any()):
        raise bad("allocation table entries point outside the data region")
    meta = np.fromfile(path, dtype=meta_type, count=n, offset=meta_start)
    missing = ~np.isin(meta[f"f{names.index(payload)}"][pointer], alloc["ptr"])
    if missing.any():
        raise bad(f"sample {int(np.argmax(missing))} points at {payload} data missing from the allocation table")
    return n


class _EpochOrder:
    """Hands FFCV this rank's sample order for an epoch. FFCV 1.0.2's Loader accepts a custom order only as an
    object passing ``isinstance(order, TraversalOrder)`` that it then *calls* with itself; so this is built lazily
    as a TraversalOrder subclass instance that returns itself when called."""

    @staticmethod
    def create(stream: _BetonStream) -> Any:
        from ffcv.traversal_order.base import TraversalOrder  # optional extra: ffcv

        class Order(TraversalOrder):
            def __init__(self) -> None:  # TraversalOrder.__init__ wants the Loader, which does not exist yet
                self.plan = stream

            def __call__(self, _ffcv_loader: Any) -> Order:
                return self

            def sample_order(self, epoch: int) -> np.ndarray:
                return self.plan.rank_order(epoch, self.plan.start_batch)

        return Order()


class _BetonStream:
    """The sample order and epoch bookkeeping shared by the image and text loaders: the samplers' order (see the
    module docstring), ``len()`` batches, and ``_batches(epoch, start_batch)`` over FFCV's raw outputs."""

    def __init__(self, path: Path | str, kind: Literal["image", "text"], batch_size: int, rank: int,
                 world_size: int, num_workers: int, seed: int, train: bool) -> None:
        _ffcv()
        # an invariant: the loaders pass the process group's rank and a checked batch size
        if not 0 <= rank < world_size or batch_size < 1:
            raise ValueError(f"need 0 ≤ rank < world_size and batch_size ≥ 1; got rank={rank}, "
                             f"world_size={world_size}, batch_size={batch_size}")
        self.path = Path(path)
        self.num_samples = check_beton(self.path, kind)
        if train and self.num_samples < batch_size * world_size:
            raise UsageError(f"{self.path} has {self.num_samples} samples, fewer than one global batch "
                             f"({batch_size} per rank × {world_size} ranks)")
        self.batch_size, self.rank, self.world_size, self.seed, self.train = batch_size, rank, world_size, seed, train
        self.num_workers = max(1, num_workers)
        self.start_batch = 0

    def _make_loader(self, pipelines: dict[str, list[Any]], batches_ahead: int) -> Any:
        from ffcv.loader import Loader  # optional extra: ffcv

        return Loader(str(self.path), batch_size=self.batch_size, num_workers=self.num_workers,
                      order=_EpochOrder.create(self), drop_last=self.train, seed=self.seed, os_cache=True,
                      pipelines=pipelines, batches_ahead=batches_ahead)

    def __len__(self) -> int:
        """Batches per epoch on this rank (train: the same on every rank; eval: the last may be partial)."""
        if self.train:
            return self.num_samples // (self.batch_size * self.world_size)
        return len(EvalShardSampler(self.num_samples, self.batch_size, self.rank, self.world_size))

    def rank_order(self, epoch: int, start_batch: int = 0) -> np.ndarray:
        """Sample indices this rank reads in ``epoch`` from ``start_batch`` on, batch after batch: exactly the
        samplers' order (``EvalShardSampler`` for eval, ``ShardedBatchSampler`` for training)."""
        if not self.train:
            mine = EvalShardSampler(self.num_samples, self.batch_size, self.rank, self.world_size).indices
            return np.asarray(mine[start_batch * self.batch_size:], dtype=np.uint64)
        sampler = ShardedBatchSampler(self.num_samples, self.batch_size, self.rank, self.world_size, self.seed)
        return sampler.global_batches(epoch)[start_batch:, self.rank].reshape(-1).numpy().astype(np.uint64)

    def _batches(self, loader: Any, epoch: int, start_batch: int) -> Iterator[tuple[Any, ...]]:
        # an invariant: the position comes from this run's own checkpoint (a bug if hit)
        if not 0 <= start_batch <= len(self):
            raise ValueError(f"start batch {start_batch} outside an epoch of {len(self)} batches")
        if start_batch == len(self):
            return
        self.start_batch = start_batch
        loader.next_epoch = epoch
        epoch_iter = iter(loader)
        try:
            yield from epoch_iter
        finally:
            _stop_prefetch(epoch_iter)


def _stop_prefetch(epoch_iter: Any) -> None:
    """Stop FFCV's prefetch thread of a pass and wait for it. A pass left mid-epoch (``train.max_steps``, a
    preemption) otherwise leaves the thread decoding in numba's thread pool, and a process that exits meanwhile
    aborts ("terminate called without an active exception", exit -6, seen under load) although its run finished.
    The thread checks the event when the full queue refuses a batch; emptying the queue also frees its final
    blocking ``put(None)`` at the epoch's end."""
    epoch_iter.terminate_event.set()
    while epoch_iter.is_alive():
        with contextlib.suppress(Empty):
            epoch_iter.output_queue.get(timeout=0.1)
    epoch_iter.join()


class FFCVLoader(_BetonStream):
    """Per-rank batches ``(images (B, C, H, W) float normalised, labels (B,) int64)`` from a :func:`write_beton`
    ``.beton``.

    ``stock_decoder=True`` uses FFCV's own crop decoders and flip instead of ``SeededCropDecoder`` (for benchmarks:
    their draws are not reproducible on resume).

    CPU pipeline: decode+crop+flip, ``NormalizeImage`` (all numba-jitted) *then* ``ToTensor`` / ``ToTorchImage``:
    FFCV 1.0.2 hangs generating code on CPU when a jitted op follows a torch one. GPU pipeline (``device`` cuda):
    uint8 decode+crop and flip on CPU, ``ToDevice`` early, channels-last ``ToTorchImage``, and the normalisation
    on the GPU in torch (FFCV's GPU ``NormalizeImage`` would need cupy).

    ``randaugment`` (``train.randaugment``, training only): the uint8 crops go through timm's auto-augmentation
    (``ffcv_augment.AugmentPool``, ``num_workers`` processes), each under the seed its place in the epoch gives it
    (``sampler.sample_seed``, as the map-style reader's), then are normalised in torch (on the GPU for cuda). One
    batch is augmented while the loop trains on the one before.

    Batches live in FFCV's ring of reused buffers: use (or copy) each before drawing ``batches_ahead`` more.
    """

    def __init__(self, path: Path | str, batch_size: int, rank: int, world_size: int, num_workers: int, seed: int,
                 train: bool, img_size: int, mean: Sequence[float], std: Sequence[float],
                 device: torch.device | str = "cpu", crop_ratio: float = EVAL_CROP_RATIO, batches_ahead: int = 3,
                 stock_decoder: bool = False, randaugment: str | None = None) -> None:
        super().__init__(path, "image", batch_size, rank, world_size, num_workers, seed, train)
        from ffcv.fields.basics import IntDecoder  # optional extra: ffcv
        from ffcv.fields.rgb_image import CenterCropRGBImageDecoder, RandomResizedCropRGBImageDecoder
        from ffcv.transforms import NormalizeImage, RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

        from sigmanens_dist.data.ffcv_augment import auto_augmentation  # imports timm: auto-augmentation only
        from sigmanens_dist.data.ffcv_decode import SeededCropDecoder

        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        # built here too so that a string timm refuses fails now, as with the raw reader, not in a worker
        self._augment = (randaugment, img_size, mean) if train and randaugment else None
        if self._augment is not None:
            auto_augmentation(*self._augment)
        self._decoder = None if stock_decoder else SeededCropDecoder((img_size, img_size), train, seed,
                                                                      crop_ratio=crop_ratio)
        if self._decoder is not None:
            image: list[Any] = [self._decoder]
        elif train:
            image = [RandomResizedCropRGBImageDecoder((img_size, img_size)), RandomHorizontalFlip()]
        else:
            image = [CenterCropRGBImageDecoder((img_size, img_size), ratio=crop_ratio)]
        label = [IntDecoder(), ToTensor(), Squeeze()]
        if on_gpu or self._augment is not None:  # normalised in torch, after any augmentation of the uint8 crops
            self._mean = torch.tensor(mean, device=self.device).view(1, -1, 1, 1) * 255
            self._std = torch.tensor(std, device=self.device).view(1, -1, 1, 1) * 255
        if self._augment is not None:
            image += [ToTensor()]
            label += [ToDevice(self.device, non_blocking=True)] if on_gpu else []
        elif on_gpu:
            image += [ToTensor(), ToDevice(self.device, non_blocking=True), ToTorchImage(channels_last=True)]
            label += [ToDevice(self.device, non_blocking=True)]
        else:
            image += [NormalizeImage(np.array(mean) * 255, np.array(std) * 255, np.float32), ToTensor(),
                      ToTorchImage(channels_last=False)]
        self._loader = self._make_loader({"image": image, "label": label}, batches_ahead)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches ``start_batch .. len() - 1`` of ``epoch``, the same samples in the same order as a full pass."""
        if self._decoder is not None:
            self._decoder.set_epoch(epoch)
        if self._augment is not None:
            yield from self._augmented(self._augment, epoch, start_batch)
            return
        for images, labels in self._batches(self._loader, epoch, start_batch):
            if self._decoder is not None:
                self._decoder.check(self.path)
            if self.device.type == "cuda":
                images = images.float().sub_(self._mean).div_(self._std)
            yield images, labels.long().view(-1)

    def _augmented(self, augment: tuple[str, int, Sequence[float]], epoch: int,
                   start_batch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`iter_epoch` with ``randaugment``: batch k+1 is decoded and sent to the pool before batch k is
        yielded (its labels stay valid: FFCV reuses a buffer only ``batches_ahead`` batches later)."""
        # lazy: ffcv_augment imports timm, only for auto-augmentation
        from sigmanens_dist.data.ffcv_augment import AugmentPool

        pool = AugmentPool.shared(*augment, workers=self.num_workers)
        sampler = ShardedBatchSampler(self.num_samples, self.batch_size, self.rank, self.world_size, self.seed)
        sampler.set_position(epoch, start_batch)
        pending: tuple[Any, torch.Tensor] | None = None
        for (images, labels), keys in zip(self._batches(self._loader, epoch, start_batch), sampler, strict=True):
            if self._decoder is not None:
                self._decoder.check(self.path)
            job = pool.submit(images.numpy(), [seed for _, seed in keys])
            if pending is not None:
                yield self._normalised(*pending)
            pending = job, labels
        if pending is not None:
            yield self._normalised(*pending)

    def _normalised(self, job: Any, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # lazy: ffcv_augment imports timm, only for auto-augmentation
        from sigmanens_dist.data.ffcv_augment import AugmentPool

        images = torch.from_numpy(AugmentPool.gather(job)).to(self.device, non_blocking=True)
        images = images.permute(0, 3, 1, 2).float().sub_(self._mean).div_(self._std)  # channels-last, as on GPU
        return (images if self.device.type == "cuda" else images.contiguous()), labels.long().view(-1)


class FFCVTextLoader(_BetonStream):
    """Per-rank batches ``(batcher(sentences), labels (B,) int64)`` from a :func:`write_text_beton` ``.beton``;
    ``batcher`` is a ``TextBatcher`` (sentences → token ids and attention mask), run on the loop's thread. Unlike
    the image loader's, these batches are fresh tensors, not views of FFCV's reused buffers."""

    def __init__(self, path: Path | str, batch_size: int, rank: int, world_size: int, num_workers: int, seed: int,
                 train: bool, batcher: Callable[[list[str]], Any], batches_ahead: int = 3) -> None:
        super().__init__(path, "text", batch_size, rank, world_size, num_workers, seed, train)
        from ffcv.fields.basics import IntDecoder  # optional extra: ffcv
        from ffcv.fields.bytes import BytesDecoder

        self.batcher = batcher
        self._loader = self._make_loader({"text": [BytesDecoder()], "length": [IntDecoder()], "label": [IntDecoder()]},
                                         batches_ahead)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[Any, torch.Tensor]]:
        """Batches ``start_batch .. len() - 1`` of ``epoch``, the same samples in the same order as a full pass."""
        for text, length, label in self._batches(self._loader, epoch, start_batch):
            # Rows of ``text`` are padded to the longest sentence in the file; ``length`` says where each one ends.
            n = len(label)
            sentences = [bytes(text[i, :int(length[i, 0])]).decode("utf-8") for i in range(n)]
            # Copies: FFCV's buffers are reused a few batches later.
            yield self.batcher(sentences), torch.tensor(label[:n, 0], dtype=torch.int64)
