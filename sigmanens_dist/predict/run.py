"""The loop of ``sigmanens predict``: every check first (the output folder's path, inputs, program, shapes, the
output folder's contents), then rank r predicts units r, r + N, … of the global order that have no part yet, one part
file per unit, and rank 0 writes the summary once every rank is done. Under torchrun (or Slurm's same variables) a
gloo group carries only the output folder's verdict and the final gathering; a single process needs none.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sigmanens_dist.atomic import file_sha256
from sigmanens_dist.distributed.env import all_gather_object, init_distributed
from sigmanens_dist.errors import UsageError
from sigmanens_dist.predict.backends import Program, load_program
from sigmanens_dist.predict.inputs import (
    BadInput,
    Sample,
    Unit,
    check_shapes,
    decode,
    discover,
    inputs_digest,
    read_unit,
)
from sigmanens_dist.predict.norm_stats import alone_reason, check_enough_inputs, check_norm_stats
from sigmanens_dist.predict.writer import FORMAT, check_claimable, check_out, claim, part_path, summarise, write_part
from sigmanens_dist.progress import progress
from sigmanens_dist.training.run_lock import RunLock

__all__ = ["predict"]

log = logging.getLogger("sigmanens")


def _device(requested: str | None, local_rank: int, world: int) -> torch.device:
    """``--device`` (cuda means cuda:LOCAL_RANK under torchrun), else cuda:LOCAL_RANK when there is a GPU, else cpu."""
    name = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r}: give cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA GPU is visible; use --device cpu")
        if device.index is None or world > 1:
            device = torch.device("cuda", local_rank)
    return device


def predict(program_path: Path, inputs: Sequence[Path], out: Path, *, batch_size: int = 64, fmt: str = "parquet",
            device: str | None = None, force: bool = False, chunk_size: int = 1024,
            norm_stats: str | None = None, source: str | None = None) -> dict[str, Any] | None:
    """Predict every input once into ``out``; the summary on rank 0, None on the other ranks. ``norm_stats``, when
    given, must be the BatchNorm statistics the program was exported with. ``source``: what the manifest and
    summary name as the program when ``program_path`` is a temporary copy (the ``models:/`` URI it was downloaded
    from); default the path itself."""
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: give a batch size ≥ 1")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    check_out(out, inputs)  # before any input is read
    units = discover(inputs, chunk_size)
    program = load_program(program_path, _device(device, int(os.environ.get("LOCAL_RANK", "0")), world))
    check_norm_stats(program_path, program.meta, norm_stats, batch_size)
    check_enough_inputs(program_path, program.meta, units)
    channels, height, width = program.meta.input.chw
    check_shapes(units, channels, (height, width), program.meta.input.crop_ratio)
    manifest = {"format": FORMAT, "program": {"path": source or str(program_path), "sha256": file_sha256(program_path)},
                "inputs": [str(p) for p in inputs], "inputs_sha256": inputs_digest(units),
                "chunk_size": chunk_size, "output_format": fmt, "units": [u.describe() for u in units]}
    env = None
    if world > 1:
        env = init_distributed(backend="gloo")
    lock = None
    try:
        lock = _agree(out, manifest, force, rank, env)
        started = time.monotonic()
        done = _run_units(program, units[rank::world], out, fmt, batch_size, (channels, height, width), rank)
        stats = {"rank": rank, **done, "seconds": time.monotonic() - started}
        if env is None:
            return summarise(out, manifest, program.meta, [stats])
        runs = all_gather_object(stats, env)  # also the barrier: every part is written before the summary
        return summarise(out, manifest, program.meta, runs) if rank == 0 else None
    finally:
        if lock is not None:
            lock.release()
        if env is not None:
            torch.distributed.destroy_process_group()


def _agree(out: Path, manifest: dict[str, Any], force: bool, rank: int, env: Any) -> RunLock | None:
    """Rank 0 takes ``out``'s lock for the whole run (a second predict there is refused, naming this one, with or
    without ``--force``) and claims it, or refuses it; every rank learns the verdict before any work. Rank 0's
    lock is returned."""
    verdict, lock = [None], None
    if rank == 0:
        try:
            check_claimable(out)  # before the lock file is added to a folder of other files
            lock = RunLock(out, "sigmanens predict", flag="--out ").acquire()
            existing = claim(out, manifest, force)
            if existing:
                log.info("resuming in %s: %d of %d units already predicted", out, existing, len(manifest["units"]))
        except UsageError as err:
            verdict = [str(err)]
            if lock is not None:
                lock.release()
    if env is not None:
        torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise UsageError(verdict[0])
    return lock


def _run_units(program: Program, mine: list[Unit], out: Path, fmt: str, batch_size: int,
               shape: tuple[int, int, int], rank: int) -> dict[str, int]:
    """This rank's units without a part, each predicted and written; counts for the summary's throughput. Reading and
    decoding run on threads beside the program (:class:`_Feed`): the next batch, and the next unit's first, are read
    and decoded while the program runs on this one."""
    todo = [u for u in mine if not part_path(out, u.id, fmt).exists()]
    names = program.meta.class_names
    predicted = skipped = 0
    bar = progress(total=len(todo), desc=f"predict (rank {rank})", unit="unit", disable=rank != 0)
    workers = min(8, os.cpu_count() or 1)
    channels, height, width = shape
    crop_ratio = program.meta.input.crop_ratio

    def load(sample: Sample) -> np.ndarray:
        """The program's (C, H, W) uint8 pixels: _Stack makes floats once per batch."""
        return decode(sample, channels, (height, width), crop_ratio)

    with ThreadPoolExecutor(max_workers=1) as reader, ThreadPoolExecutor(max_workers=workers) as pool, bar:
        stack = _Stack()
        feeds = [_Feed(unit, batch_size, load, reader, pool, workers) for unit in todo[:1]]
        for i, unit in enumerate(todo):
            if i + 1 < len(todo):  # the next unit's first batch read and decoded while this one runs
                feeds.append(_Feed(todo[i + 1], batch_size, load, reader, pool, workers))
            ids, outputs, bad = _predict_unit(program, feeds.pop(0), shape, stack)
            write_part(part_path(out, unit.id, fmt), unit.id, ids, outputs, bad, names)
            predicted, skipped = predicted + len(ids), skipped + len(bad)
            bar.update(1)
            bar.set_postfix(predicted=predicted, skipped=skipped)
    return {"units": len(todo), "predicted": predicted, "skipped": skipped}


class _Feed:
    """A unit's batches in order, each with its images as ``load`` decodes them (or why it refused), one batch
    ahead of the program: the single ``reader`` thread reads a batch (in order, so a unit's samples are read as
    one stream) and hands its decoding to ``pool`` in ``workers`` slices; iterating waits for a batch's images and
    starts reading the next before handing them out."""

    def __init__(self, unit: Unit, batch_size: int, load: Callable[[Sample], np.ndarray],
                 reader: ThreadPoolExecutor, pool: ThreadPoolExecutor, workers: int) -> None:
        self.samples, self.batch_size, self.load = read_unit(unit), batch_size, load
        self.reader, self.pool, self.workers = reader, pool, workers
        self.ahead: Future[tuple[list[Sample], list[Future[list[np.ndarray | str]]]]] = reader.submit(self._read)

    def _read(self) -> tuple[list[Sample], list[Future[list[np.ndarray | str]]]]:
        batch = list(islice(self.samples, self.batch_size))
        step = max(1, -(-len(batch) // self.workers))
        return batch, [self.pool.submit(self._decode, batch[i:i + step]) for i in range(0, len(batch), step)]

    def _decode(self, samples: list[Sample]) -> list[np.ndarray | str]:
        images: list[np.ndarray | str] = []
        for sample in samples:
            try:
                images.append(self.load(sample))
            except BadInput as err:
                images.append(str(err))
        return images

    def __iter__(self) -> Iterator[tuple[list[Sample], list[np.ndarray | str]]]:
        while True:
            batch, parts = self.ahead.result()
            if not batch:
                return
            self.ahead = self.reader.submit(self._read)
            yield batch, [image for part in parts for image in part.result()]


class _Stack:
    """A batch of ``(C, H, W)`` uint8 images as the program takes it, ``(B, C, H, W)`` float32 in [0, 1], in one
    copy and one division into buffers kept across batches (grown when a batch is larger): no per-image tensors, and
    a batch of large images costs no fresh allocation, whose pages the kernel would zero each time. The programs copy
    nothing of their input into their outputs, so the buffers are free again once the program returns."""

    def __init__(self) -> None:
        self.pixels: np.ndarray | None = None
        self.floats: torch.Tensor | None = None

    def __call__(self, images: list[np.ndarray]) -> torch.Tensor:
        n, shape = len(images), images[0].shape
        if self.pixels is None or len(self.pixels) < n or self.pixels.shape[1:] != shape:
            self.pixels = np.empty((n, *shape), np.uint8)
            self.floats = torch.empty(n, *shape)
        np.stack(images, out=self.pixels[:n])
        return torch.div(torch.from_numpy(self.pixels[:n]), 255, out=self.floats[:n])


def _predict_unit(program: Program, feed: Iterable[tuple[list[Sample], list[np.ndarray | str]]],
                  shape: tuple[int, int, int], stack: _Stack
                  ) -> tuple[list[str], dict[str, np.ndarray], list[dict[str, str]]]:
    """The unit's predicted ids with the program's outputs, and its skipped inputs with their reason."""
    channels, height, width = shape
    ids: list[str] = []
    batches: list[dict[str, np.ndarray]] = []
    bad: list[dict[str, str]] = []
    least = program.meta.norm_stats.min_batch
    previous: list[np.ndarray] = []  # the last batch predicted: company for a lone image (min_batch 2)
    held: list[np.ndarray] = []  # a lone image with no batch before it: predicted with the next one
    for batch, decoded in feed:
        images = held
        for sample, image in zip(batch, decoded, strict=True):
            if isinstance(image, str):
                log.warning("skipping %s: %s", sample.id, image)
                bad.append({"id": sample.id, "reason": image})
            else:
                ids.append(sample.id)
                images.append(image)
        held = []
        if len(images) >= least:
            batches.append(program(stack(images)))
            previous = images
        elif images and previous:  # normalised among the batch before it, not by itself
            outputs = program(stack([*previous[1:], *images]))
            batches.append({k: v[-len(images):] for k, v in outputs.items()})
        else:
            held = images
    if held:  # the unit's only readable image
        reason = alone_reason(program.meta)
        log.warning("skipping %s: %s", ids[-1], reason)
        bad.append({"id": ids.pop(), "reason": reason})
    if not batches:  # every input skipped: the part still has the program's columns
        empty = torch.zeros(program.meta.norm_stats.min_batch, channels, height, width)
        batches = [{k: v[:0] for k, v in program(empty).items()}]
    return ids, {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}, bad
