"""The training loop's view of data, whatever the on-disk format (``data.format``: raw, ffcv, webdataset).

A *train stream* has a fixed number of batches per epoch, the same on every rank, and yields the batches of an epoch
from any start batch exactly as an uninterrupted pass would (``iter_epoch(epoch, start_batch)``), which is what exact
resume needs. An *eval pass* scores every validation sample exactly once across ranks.

On-disk layout of the converted formats (written by ``sigmanens data convert``)::

    <root>/classes.json                         {"classes": [...], "val_split": …, "split_seed": …} (both formats)
    <root>/{train,val,test}.beton               ffcv
    <root>/{train,val,test}/manifest.json       webdataset (+ the shards)
    <root>/tokenizer/                           sst2: the default tokenizer (``data.tokenizer`` overrides it)

``val`` is the validation split carved from the training pool at conversion (absent when converted with
``--val-split 0``); a run must ask for the same ``data.val_split`` / ``data.split_seed``, or validate on ``test``
with ``data.val_split=0 data.val_from_test=true``.

Converted SST-2 holds sentences, tokenised per batch by the same ``TextBatcher`` as the raw reader.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from sigmanens_dist.catalog.datasets import CLASSES_FILE, DATASETS, converted_classes_file, convertible, resolve_root
from sigmanens_dist.config import DataConfig
from sigmanens_dist.config.schema import AugMixConfig
from sigmanens_dist.data.bad_samples import BadSamples, Checked, collate_present
from sigmanens_dist.data.ffcv_io import FFCVLoader, FFCVTextLoader
from sigmanens_dist.data.raw import IMAGE_FOLDERS, build_datasets, image_folder_transforms
from sigmanens_dist.data.sampler import EvalShardSampler, ShardedBatchSampler, epoch_seed
from sigmanens_dist.data.sst2 import TOKENIZER_DIR, TextBatcher, load_tokenizer
from sigmanens_dist.data.webdataset_io import MANIFEST, WebDatasetLoader, image_transform, iter_eval
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.errors import MissingPathError, UsageError
from sigmanens_dist.storage.remote import RemotePath

__all__ = ["CLASSES_FILE", "FORMATS", "Data", "MapStyleStream", "TrainStream", "build_data"]


log = logging.getLogger("sigmanens")

Batch = tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]  # images, or tokenizer tensors for text


class TrainStream(Protocol):
    def __len__(self) -> int: ...

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]: ...


@dataclass
class Data:
    train: TrainStream
    val: Callable[[], Iterable[Batch]]  # a fresh pass over this rank's share of the validation set
    test: Callable[[], Iterable[Batch]]  # the same over the test set (scored only by `sigmanens eval`)
    num_classes: int
    in_chans: int
    vocab_size: int | None = None  # text datasets: the tokenizer's vocabulary size
    bad: BadSamples = field(default_factory=BadSamples)  # skipped-sample count (data.on_bad_sample=skip)
    calib: Callable[[], Iterable[Batch]] | None = None  # the calibration split (data.calib_split): never trained on

    def posthoc_split(self) -> tuple[str, Callable[[], Iterable[Batch]]]:
        """``(name, pass)`` of the split post-hoc fits (temperature, conformal thresholds) read: the calibration
        split when the run carved one, so that they are not fitted on the data best.pt was chosen on; else val."""
        return ("calib", self.calib) if self.calib is not None else ("val", self.val)


class MapStyleStream:
    """A map-style dataset read in :class:`ShardedBatchSampler` order through a ``DataLoader``.

    With workers, one ``DataLoader`` with persistent workers serves every epoch (forking them anew each epoch
    stalled the first steps of each): the sampler is repositioned before each pass, and what a worker returns
    depends only on the indices and per-sample seeds it is sent, so a pass from ``(epoch, start_batch)`` is the one
    a fresh loader would give. One pass at a time: a pass abandoned midway (the end of training, a preemption)
    stops the workers, and the next pass starts new ones."""

    def __init__(self, dataset: Dataset, batch_size: int, env: DistEnv, seed: int, num_workers: int) -> None:
        self.dataset, self.num_workers, self.seed = dataset, num_workers, seed
        self.pin = env.device.type == "cuda"
        self.sampler = ShardedBatchSampler(len(dataset), batch_size, env.rank, env.world_size, seed)
        self.loader: DataLoader | None = None  # the persistent one (workers > 0), made by the first pass
        self.passes = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def _loader(self, epoch: int) -> DataLoader:
        # Its own generator: creating a loader mid-epoch on resume must not consume the global RNG stream.
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        return DataLoader(self.dataset, batch_sampler=self.sampler, num_workers=self.num_workers,
                          pin_memory=self.pin, generator=generator, collate_fn=collate_present,
                          persistent_workers=self.num_workers > 0)

    def iter_epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
        self.sampler.set_position(epoch, start_batch)
        if self.num_workers == 0:
            yield from self._loader(epoch)
            return
        if self.loader is None:
            self.loader = self._loader(epoch)
        self.passes += 1
        mine, finished = self.passes, False
        try:
            for batch in self.loader:  # iter() re-reads the sampler: this pass's batches
                if self.passes != mine:  # an invariant: the trainer reads one pass at a time (a bug if hit)
                    raise RuntimeError("a newer pass of this train stream started; read one pass at a time")
                yield batch
            finished = True
        finally:
            if not finished and self.passes == mine:
                self.loader = None  # abandoned midway: dropping the loader shuts its workers down now


def build_data(d: DataConfig, batch_size: int, seed: int, env: DistEnv, randaugment: str | None = None,
               augmix: AugMixConfig | None = None) -> Data:
    """Train stream and eval pass for the data config ``d``, at ``batch_size`` per rank; ``seed`` fixes the order
    and augmentation of every epoch. ``d.format`` picks the reader from :data:`FORMATS`; ``augmix`` goes to the raw
    reader alone (the config refuses it with the other formats)."""
    if d.val_from_test and env.is_main:
        log.warning("data.val_from_test=true: the loop validates and picks best.pt on the TEST set, so test "
                    "numbers of this run are not held out")
    if augmix is not None:
        assert d.format == "raw", f"the config refuses train.augmix with data.format={d.format!r}"
        return _raw(d, batch_size, seed, env, randaugment, augmix)
    return FORMATS[d.format](d, batch_size, seed, env, randaugment)


def _raw(d: DataConfig, batch: int, seed: int, env: DistEnv, randaugment: str | None,
         augmix: AugMixConfig | None = None) -> Data:
    """The dataset's native files, read by map-style datasets (data/raw.py)."""
    bad = BadSamples(d.on_bad_sample)
    bundle = build_datasets(d, resolve_root(d.dataset, d.root), randaugment, augmix)
    train = MapStyleStream(Checked(bundle.train, bundle.num_classes, bad, "train"), batch, env, seed, d.num_workers)

    def eval_pass(dataset: Dataset, split: str) -> Callable[[], Iterable[Batch]]:
        checked = Checked(dataset, bundle.num_classes, bad, split)

        def one_pass() -> Iterable[Batch]:
            sampler = EvalShardSampler(len(checked), batch, env.rank, env.world_size)
            return DataLoader(checked, batch_sampler=sampler, num_workers=d.num_workers, collate_fn=collate_present)

        return one_pass

    return Data(train, eval_pass(bundle.val, "val"), eval_pass(bundle.test, "test"), bundle.num_classes,
                bundle.in_chans, bundle.vocab_size, bad,
                eval_pass(bundle.calib, "calib") if bundle.calib is not None else None)


@dataclass(frozen=True)
class _Converted:
    """What a converted folder (``sigmanens data convert``) holds, read from its classes file."""

    root: Path | RemotePath
    num_classes: int
    val_name: str  # the split the loop validates on: "val", or "test" with data.val_from_test


def _converted(d: DataConfig) -> _Converted:
    if d.dataset not in convertible():
        raise UsageError(f"data.format={d.format!r} needs a converted dataset, one of "
                         f"{', '.join(convertible())}; got data.dataset={d.dataset!r}")
    root = resolve_root(d.dataset, d.root)
    root = root if isinstance(root, RemotePath) else Path(root)  # a URL root streams webdataset shards
    meta = json.loads(converted_classes_file(d.format, root).read_text())
    return _Converted(root, len(meta["classes"]), _converted_val(d, root, meta))


def _ffcv(d: DataConfig, batch: int, seed: int, env: DistEnv, randaugment: str | None) -> Data:
    """FFCV .beton files: decoded and augmented by FFCV's own pipelines (data/ffcv_io.py)."""
    c = _converted(d)
    common: dict[str, Any] = dict(batch_size=batch, rank=env.rank, world_size=env.world_size,
                                  num_workers=max(1, d.num_workers), seed=seed)
    if d.dataset == "sst2":
        batcher = _text_batcher(d, c.root)
        loader, common, in_chans, vocab = FFCVTextLoader, {**common, "batcher": batcher}, 0, len(batcher.tokenizer)
        augment: dict[str, Any] = {}  # no text augmentation
    else:
        spec = DATASETS[d.dataset]
        mean, std = spec.mean, spec.std
        if len(mean) == 1:  # FFCV stores grayscale as 3 equal channels
            mean, std = mean * 3, std * 3
        loader, in_chans, vocab = FFCVLoader, 3, None
        common.update(img_size=d.img_size or spec.size, mean=mean, std=std, device=env.device)
        augment = {"randaugment": randaugment}  # the config allows it only where every reader applies it
    train = loader(c.root / "train.beton", train=True, **common, **augment)
    val_loader = loader(c.root / f"{c.val_name}.beton", train=False, **common)
    test_loader = val_loader if c.val_name == "test" else loader(c.root / "test.beton", train=False, **common)
    return Data(train, lambda: val_loader.iter_epoch(0), lambda: test_loader.iter_epoch(0), c.num_classes, in_chans,
                vocab)


def _webdataset(d: DataConfig, batch: int, seed: int, env: DistEnv, randaugment: str | None) -> Data:
    """webdataset tar shards on local disk or behind a URL (data/webdataset_io.py, storage/remote.py)."""
    c = _converted(d)
    bad = BadSamples(d.on_bad_sample)
    collate: Callable[[list[Any]], Any]
    if d.dataset == "sst2":  # sentences in, the batcher tokenises them per batch
        batcher = _text_batcher(d, c.root)
        train_tf = eval_tf = None
        collate, in_chans, vocab = batcher, 0, len(batcher.tokenizer)
    else:
        spec = DATASETS[d.dataset]
        size = d.img_size or spec.size
        if d.dataset in IMAGE_FOLDERS:  # the raw reader's own: its pixels, its randaugment
            train_tf, eval_tf = image_folder_transforms(d.dataset, size, randaugment)
        else:
            train_tf = image_transform(True, size, spec.mean, spec.std)
            eval_tf = image_transform(False, size, spec.mean, spec.std)
        collate, in_chans, vocab = torch.stack, len(spec.mean), None
    train = WebDatasetLoader(c.root / "train" / MANIFEST, batch, env.rank, env.world_size, d.num_workers, seed,
                             train_tf, bad=bad, collate=collate)

    def eval_pass(split: str) -> Callable[[], Iterable[Batch]]:
        return lambda: iter_eval(c.root / split / MANIFEST, env.rank, env.world_size, batch, eval_tf, bad,
                                 collate=collate)

    return Data(train, eval_pass(c.val_name), eval_pass("test"), c.num_classes, in_chans, vocab, bad=bad)


#: data.format → its reader; the config's ``data.format`` choices are these names (a test holds them equal)
FORMATS: dict[str, Callable[[DataConfig, int, int, DistEnv, str | None], Data]] = {
    "raw": _raw, "ffcv": _ffcv, "webdataset": _webdataset}


def _converted_val(d: DataConfig, root: Path | RemotePath, meta: dict[str, Any]) -> str:
    """Which converted split the loop validates on (``val`` or ``test``), once the run's split settings are checked
    against the ones the folder was converted with."""
    if "val_split" not in meta:
        raise UsageError(f"{root} was converted by an older sigmanens (its 'val' split is the test set and it has no "
                         f"carved validation split); convert it again with `sigmanens data convert … --out {root}`")
    if d.val_from_test:
        return "test"
    converted = (meta["val_split"], meta["split_seed"])
    if converted[0] == 0:
        raise UsageError(f"data.val_split={d.val_split}: {root} was converted with --val-split 0 (no validation "
                         "split); validate on its test split with data.val_split=0 data.val_from_test=true, or "
                         "convert again with --val-split")
    if (d.val_split, d.split_seed) != converted:
        raise UsageError(f"data.val_split={d.val_split} data.split_seed={d.split_seed}, but {root} was converted "
                         f"with --val-split {converted[0]} --split-seed {converted[1]}: set data.val_split="
                         f"{converted[0]} data.split_seed={converted[1]}, or convert again")
    return "val"


def _text_batcher(d: DataConfig, root: Path | RemotePath) -> TextBatcher:
    """Sentences of converted data are tokenised per batch by the same ``TextBatcher`` as the raw reader."""
    if d.tokenizer is None and not (root / TOKENIZER_DIR / "tokenizer.json").is_file():
        raise MissingPathError(f"{root / TOKENIZER_DIR} is missing: `sigmanens data convert --dataset sst2` writes "
                               f"it there; or set data.tokenizer to the backbone's tokenizer folder")
    return TextBatcher(load_tokenizer(d.tokenizer, root), d.max_length)
