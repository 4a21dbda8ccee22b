"""Checkpoints that survive crashes and preemption: atomic writes, keep-last-k + best, ``--resume auto``.

One policy, two layouts. A checkpoint is either one file ``step_<N>.pt`` under ``<run_dir>/checkpoints`` (written by
rank 0: DDP) or one folder ``step_<N>/`` every rank writes its shards into (FSDP2 through torch.distributed.checkpoint,
DeepSpeed through its engine), with the trainer's own state in ``step_<N>/trainer.pt``; which one is the strategy's
choice (``Strategy.save_checkpoint``). Both are written under a temporary name and renamed into place, so a reader
sees either the old set or the new set, never a half checkpoint; older ones are deleted only after the new one is
complete. ``best.pt`` / ``best/`` is a copy of the best-so-far (by a metric, lower is better), made the same way.
Resume reads the trainer's state with :meth:`CheckpointManager.load` (a folder's shards stay where they are, for the
strategy to load onto its sharded model); everything else reads a whole model with
:func:`sigmanens_dist.checkpoint.read_checkpoint`, on top of the same reader (:class:`.state.TrainerState`).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sigmanens_dist.atomic import atomic_write, replace_folder, torch_save
from sigmanens_dist.checkpoint.state import TRAINER_STATE, LaterVersionError, TrainerState, record_best
from sigmanens_dist.errors import MissingPathError
from sigmanens_dist.safe_load import RefusedFileError

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step_(\d+)(\.pt)?$")


@dataclass
class CheckpointManager:
    """Writes, rotates and finds the checkpoints of one run directory."""

    run_dir: Path
    keep_last: int = 2
    best_metric: float | None = field(default=None, init=False)

    @property
    def directory(self) -> Path:
        return Path(self.run_dir) / "checkpoints"

    def save(self, state: dict[str, Any], step: int, metric: float | None = None) -> Path:
        """Atomically write ``step_<step>.pt`` (recording the best metric so far under ``"best"``); copy it to
        ``best.pt`` when ``metric`` improves; then delete all but the newest ``keep_last`` older than it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step:08d}.pt"
        improved = self._improves(metric)
        torch_save(record_best(state, self.best_metric), path)
        if improved:
            with path.open("rb") as src:
                atomic_write(self.directory / "best.pt", lambda dst: shutil.copyfileobj(src, dst))
        self._rotate(step)
        return path

    def save_folder(self, write_shards: Callable[[Path], None], state: dict[str, Any], step: int,
                    metric: float | None, *, is_main: bool, barrier: Callable[[], None]) -> Path:
        """Called on EVERY rank: ``write_shards(tmp)`` writes each rank's part into a temporary folder, rank 0 adds
        the trainer's ``state`` and, once every rank is done (``barrier``), renames the folder into place, copies it
        to ``best/`` when ``metric`` improves and rotates like :meth:`save`."""
        path = self.directory / f"step_{step:08d}"
        tmp = self.directory / f".step_{step:08d}.tmp"
        improved = self._improves(metric)
        if is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash during an earlier write
            tmp.mkdir()
        barrier()
        write_shards(tmp)
        if is_main:
            torch_save(record_best(state, self.best_metric), tmp / TRAINER_STATE)
        barrier()  # every rank's shards are on disk
        if is_main:
            replace_folder(tmp, path)
            if improved:
                best_tmp = self.directory / ".best.tmp"
                shutil.rmtree(best_tmp, ignore_errors=True)
                shutil.copytree(path, best_tmp)
                replace_folder(best_tmp, self.directory / "best")
            self._rotate(step)
        barrier()
        return path

    def _improves(self, metric: float | None) -> bool:
        improved = metric is not None and (self.best_metric is None or metric < self.best_metric)
        if improved:
            self.best_metric = metric
        return improved

    def _rotate(self, step: int) -> None:
        older = [p for p in self.checkpoints() if _step_of(p) < step]
        for old in older[: max(0, len(older) - (self.keep_last - 1))]:
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink(missing_ok=True)

    def checkpoints(self) -> list[Path]:
        """Step checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.iterdir() if _STEP_FILE.match(p.name)), key=_step_of)

    def load(self, resume: str) -> tuple[TrainerState, Path] | None:
        """``"auto"``: the newest readable checkpoint (a corrupt newest one is reported and skipped), or None if the
        run has none; a path: exactly that file (an error if unreadable); ``"none"``: None. A checkpoint of a later
        trainer-state version is refused, never skipped."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if not path.exists():
                raise MissingPathError(f"checkpoint.resume={resume!r}: no such file or folder")
            return TrainerState.read(path), path
        for path in reversed(self.checkpoints()):
            try:
                return TrainerState.read(path), path
            except (RefusedFileError, LaterVersionError):
                raise  # a file that would run code, or a later version's, is not a crash artifact: never skipped
            except Exception as err:
                log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", path,
                            type(err).__name__, err)
        return None


def _step_of(path: Path) -> int:
    return int(_STEP_FILE.match(path.name).group(1))
