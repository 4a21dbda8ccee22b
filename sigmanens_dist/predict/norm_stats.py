"""Which BatchNorm statistics a program normalises with: its metadata's ``norm_stats``, fixed when it was exported
(``sigmanens export RUN --program OUT --norm-stats train|batch``; a program from before that option: ``train``).
``sigmanens predict`` cannot change them, they are inside the program, so its ``--norm-stats`` checks them; and a
program that normalises each batch by that batch's statistics alone (prior 0) is never handed one image: every image
would map to one output (``NormStats.min_batch``). ``--batch-size 1`` and inputs of one image in all are refused
before any work; a unit's last batch of one is predicted beside the batch before it (:func:`alone_reason` when the
unit has no other image).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.errors import UsageError
from sigmanens_dist.predict.inputs import Unit
from sigmanens_dist.program_meta import ProgramMeta

__all__ = ["alone_reason", "check_enough_inputs", "check_norm_stats"]

_FIX = "export one with --norm-stats-prior N > 0 (the training statistics weigh as N images), or --norm-stats train"


def check_norm_stats(path: Path, meta: ProgramMeta, wanted: str | None, batch_size: int) -> None:
    """Refuse, in one line, ``--norm-stats wanted`` for a program exported with other statistics, and a batch size
    too small for the program's ``min_batch``."""
    mode, least = meta.norm_stats.mode, meta.norm_stats.min_batch
    if wanted is not None and wanted != mode:
        raise UsageError(f"--norm-stats {wanted}: PROGRAM {path} normalises with the {mode} statistics it was exported "
                         f"with; export one with `sigmanens export RUN --program OUT --norm-stats {wanted}`")
    if batch_size < least:
        raise UsageError(f"--batch-size {batch_size}: PROGRAM {path} normalises each batch with that batch's own "
                         f"BatchNorm statistics (--norm-stats batch, prior 0), which one image cannot give; use "
                         f"--batch-size {least} or more, or {_FIX}")


def check_enough_inputs(path: Path, meta: ProgramMeta, units: Sequence[Unit]) -> None:
    """Refuse, in one line before any work, inputs of fewer images than the program's ``min_batch`` (image files
    only: the count of a shard is known once it is read)."""
    least = meta.norm_stats.min_batch
    if all(u.kind == "images" for u in units) and sum(len(u.files) for u in units) < least:
        raise UsageError(f"INPUTS: one image in all, and PROGRAM {path} normalises each batch with that batch's own "
                         f"BatchNorm statistics (--norm-stats batch, prior 0), which one image cannot give: predict "
                         f"it among other images, or {_FIX}")


def alone_reason(meta: ProgramMeta) -> str:
    """Why an image that is its unit's only readable one is skipped by a program of ``min_batch`` 2."""
    return (f"the only readable image of its unit, and the program normalises each batch by its own statistics "
            f"(--norm-stats batch, prior {meta.norm_stats.prior:g}), which one image cannot give")
