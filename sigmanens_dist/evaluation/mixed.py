"""``sigmanens eval --shift-batches mixed``: the shift scored as a deployment meets it, one stream whose batches mix
every corruption × severity asked for with the clean images (issue 52).

The per-corruption passes (the default) give each batch 32 images of one corruption at one severity, and prediction
-time batch statistics then re-estimate exactly that one shift; a service or a batch job never sees such batches. Here
the split's images are corrupted exactly as the per-corruption passes corrupt them (same batches, same seeds), kept as
8-bit pixels (what an image file carries, so that ``sigmanens predict`` over the same images written as PNG files in
stream order gives the same answers), pooled with the clean images, shuffled under the run's seed and scored in
batches of ``--batch-size``. Every prediction is then credited to its group (one corruption at one severity, or
clean), so the report keeps its per-corruption columns, and to the overall.

A batch that would hold one image where one image cannot be normalised alone (batch statistics, prior 0) is predicted
beside the batch before it, as ``sigmanens predict`` does with a folder's lone last image.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor, nn

from sigmanens_dist.atomic import check_writable_folder
from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.scoring import Transform
from sigmanens_dist.inference.collect import not_main
from sigmanens_dist.methods.base import map_tensors
from sigmanens_dist.progress import progress
from sigmanens_dist.training.run_lock import LOCK_FILE, RunLock

__all__ = ["CLEAN", "Stream", "build_stream", "check_stream_folder", "claim_stream_folder", "stream_batches",
           "stream_pixels", "write_stream"]

CLEAN = "clean"  # the group of the uncorrupted images


@dataclass(frozen=True)
class Stream:
    """The pooled images of a mixed stream: ``pixels`` ``(N, C, H, W)`` uint8 and ``targets`` ``(N,)`` in group
    order, ``groups`` ``(N,)`` the group of each (an index into ``names``: ``CLEAN`` or ``(corruption, severity)``),
    and ``order``, the stream: a permutation of ``0..N-1``."""

    pixels: Tensor
    targets: Tensor
    groups: Tensor
    names: list[str | tuple[str, int]]
    order: Tensor

    def __len__(self) -> int:
        return len(self.order)


def _to_pixels(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Normalised float images → the 8-bit pixels an image file of them holds."""
    return (x.float() * std + mean).clamp(0, 1).mul(255).round().to(torch.uint8)


def stream_pixels(pixels: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """8-bit pixels → the model's normalised input, computed as an exported program computes it from the [0, 1]
    floats ``sigmanens predict`` decodes a file into (``(x / 255 - mean) / std``)."""
    shape = (1, -1, 1, 1)
    m = torch.tensor(mean, dtype=torch.float32).view(shape)
    s = torch.tensor(std, dtype=torch.float32).view(shape)
    return (pixels.float().div(255) - m) / s


def build_stream(batches: Callable[[], Iterable[tuple[Tensor, Tensor]]],
                 cells: Sequence[tuple[str, int, Transform]], mean: Sequence[float], std: Sequence[float],
                 seed: int, desc: str) -> Stream:
    """The clean images of ``batches()`` (the scored split, in its order) and, for each ``(corruption, severity,
    transform)`` of ``cells``, the same images corrupted as the per-corruption pass does (``transform(x, batch)``),
    as 8-bit pixels; shuffled under ``seed``."""
    shape = (1, -1, 1, 1)
    m = torch.tensor(mean, dtype=torch.float32).view(shape)
    s = torch.tensor(std, dtype=torch.float32).view(shape)
    names: list[str | tuple[str, int]] = [CLEAN, *((name, severity) for name, severity, _ in cells)]
    transforms: list[Transform | None] = [None, *(transform for _, _, transform in cells)]
    pixels, targets, groups = [], [], []
    for g, transform in enumerate(progress(transforms, desc=f"{desc} mixed stream", unit="group", leave=False,
                                                 disable=not_main())):
        for i, (x, y) in enumerate(batches()):
            x = map_tensors(x, lambda t: t.cpu())
            if transform is not None:
                x = transform(x, i)
            pixels.append(_to_pixels(x, m, s))
            targets.append(y.cpu())
            groups.append(torch.full((len(y),), g, dtype=torch.long))
    generator = torch.Generator().manual_seed(seed)
    n = sum(len(t) for t in targets)
    return Stream(torch.cat(pixels), torch.cat(targets), torch.cat(groups), names,
                  torch.randperm(n, generator=generator))


def stream_batches(n: int, batch_size: int, min_batch: int) -> Iterator[tuple[Tensor, int]]:
    """Positions ``0..n-1`` of the stream in batches of ``batch_size``, each as ``(positions, company)``: the first
    ``company`` rows only keep a lone last image company (a last batch smaller than ``min_batch`` is predicted with
    the batch before it, all but that batch's first rows, as ``sigmanens predict`` does); their answers were given
    in that batch already."""
    starts = list(range(0, n, batch_size))
    for j, start in enumerate(starts):
        stop = min(start + batch_size, n)
        if stop - start >= min_batch or j == 0:
            yield torch.arange(start, stop), 0
        else:  # previous batch but its first (stop - start) rows, then the lone image(s)
            lone = stop - start
            yield torch.arange(start - batch_size + lone, stop), batch_size - lone


@torch.no_grad()
def score_stream(model: nn.Module, stream: Stream, batch_size: int, min_batch: int, mean: Sequence[float],
                 std: Sequence[float], device: torch.device, desc: str,
                 update: Callable[[Tensor, Tensor, Tensor], None]) -> None:
    """Run ``model`` over the stream in batches of ``batch_size``; ``update(member_logits, targets, groups)`` is
    called once a batch with the logits of the images it answers (never a company row twice)."""
    model.eval()
    batches = list(stream_batches(len(stream), batch_size, min_batch))
    for positions, company in progress(batches, desc=f"{desc} mixed B={batch_size}", unit="batch", leave=False,
                                       disable=not_main()):
        index = stream.order[positions]
        x = stream_pixels(stream.pixels[index], mean, std).to(device)
        logits = model(x).float()[:, company:]
        index = index[company:]
        update(logits, stream.targets[index].to(device), stream.groups[index].to(device))


def check_stream_folder(folder: Path) -> None:
    """``--stream-images DIR`` must be a new or empty folder this process can write: the stream's files never
    replace anyone's (the lock file of :func:`claim_stream_folder` alone is not content)."""
    check_writable_folder(folder, "--stream-images ")
    if folder.is_dir() and any(entry.name != LOCK_FILE for entry in folder.iterdir()):
        raise UsageError(f"--stream-images {folder}: the folder is not empty; give a new or empty folder")


def claim_stream_folder(folder: Path) -> RunLock:
    """The folder's lock, held while the stream is written (two evaluations started at once into one new folder:
    the second is refused naming the first), and the folder checked empty again under it."""
    lock = RunLock(folder, "eval --stream-images", flag="--stream-images ").acquire()
    try:
        check_stream_folder(folder)
    except BaseException:
        lock.release()
        raise
    return lock


def write_stream(stream: Stream, folder: Path) -> None:
    """The stream as image files a deployment can be given in its order: ``folder/<position>.png`` (8-bit, lossless:
    the pixels scored), and ``folder/stream.csv`` (position, file, label, corruption, severity; clean images have
    neither) — a sorted listing of the folder is the stream's order."""
    folder.mkdir(parents=True, exist_ok=True)
    width = len(str(len(stream) - 1))
    rows = []
    for position, index in enumerate(progress(stream.order.tolist(), desc="stream images", unit="image",
                                              leave=False)):
        pixels = stream.pixels[index]
        if pixels.shape[0] not in (1, 3):  # an invariant: image datasets have 1 or 3 channels (a bug if hit)
            raise ValueError(f"cannot write an image of {pixels.shape[0]} channels")
        array = pixels[0].numpy() if pixels.shape[0] == 1 else pixels.permute(1, 2, 0).numpy()
        name = f"{position:0{width}d}.png"
        Image.fromarray(array).save(folder / name)
        group = stream.names[int(stream.groups[index])]
        corruption, severity = (group if isinstance(group, tuple) else ("", ""))
        rows.append([position, name, int(stream.targets[index]), corruption, severity])
    with open(folder / "stream.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["position", "file", "label", "corruption", "severity"])
        writer.writerows(rows)
