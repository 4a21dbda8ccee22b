"""Which BatchNorm statistics a program normalises with: its metadata's ``norm_stats``, fixed when it was exported
(``sigmanens export RUN --program OUT --norm-stats train|batch``; a program from before that option: ``train``).
``sigmanens predict`` cannot change them, they are inside the program, so its ``--norm-stats`` checks them; and a
program that normalises each batch by that batch's statistics alone (prior 0) cannot do so from one image.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sigmanens_dist.errors import UsageError
from sigmanens_dist.export.format import ProgramMeta

__all__ = ["check_norm_stats", "warn_alone"]

log = logging.getLogger("sigmanens")


def check_norm_stats(path: Path, meta: ProgramMeta, wanted: str | None, batch_size: int) -> None:
    """Refuse, in one line, ``--norm-stats wanted`` for a program exported with other statistics, and
    ``--batch-size 1`` for a program that normalises each batch by its own statistics alone."""
    mode, prior = meta.norm_stats.mode, meta.norm_stats.prior
    if wanted is not None and wanted != mode:
        raise UsageError(f"--norm-stats {wanted}: PROGRAM {path} normalises with the {mode} statistics it was exported "
                         f"with; export one with `sigmanens export RUN --program OUT --norm-stats {wanted}`")
    if mode == "batch" and prior == 0 and batch_size < 2:
        raise UsageError(f"--batch-size {batch_size}: PROGRAM {path} normalises each batch with that batch's own "
                         "BatchNorm statistics (--norm-stats batch, prior 0), which one image cannot give; use "
                         "--batch-size 2 or more, or export with --norm-stats-prior N > 0")


def warn_alone(meta: ProgramMeta, sample_id: str) -> None:
    """A warning when a batch-statistics program (prior 0) predicts an input in a batch of one (a unit's last)."""
    if meta.norm_stats.mode == "batch" and meta.norm_stats.prior == 0:
        log.warning("%s was predicted in a batch of 1: the program normalised it with its own statistics", sample_id)
