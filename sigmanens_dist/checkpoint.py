"""Checkpoints that survive crashes and preemption: atomic writes, keep-last-k + best, ``--resume auto``.

A checkpoint is one file ``step_<N>.pt`` under ``<run_dir>/checkpoints``. It is written to a temporary name and
renamed into place, so a reader sees either the old set or the new set, never a half file; older ones are deleted only
after the new one is complete. ``best.pt`` is a copy of the best-so-far (by a metric, lower is better), made the
same way.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointManager", "capture_rng", "restore_rng"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def capture_rng() -> dict[str, Any]:
    """Every RNG the loop draws from (torch CPU/CUDA, numpy, python), so a resumed run draws the same numbers."""
    import random

    import numpy as np

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
        improved = metric is not None and (self.best_metric is None or metric < self.best_metric)
        if improved:
            self.best_metric = metric
        _atomic_torch_save({**state, "best": self.best_metric}, path)
        if improved:
            tmp = self.directory / ".best.pt.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, self.directory / "best.pt")
        older = [p for p in self.checkpoints() if _step_of(p) < step]
        for old in older[: max(0, len(older) - (self.keep_last - 1))]:
            old.unlink(missing_ok=True)
        return path

    def checkpoints(self) -> list[Path]:
        """Step checkpoints, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted((p for p in self.directory.iterdir() if _STEP_FILE.match(p.name)), key=_step_of)

    def load(self, resume: str) -> tuple[dict[str, Any], Path] | None:
        """``"auto"``: the newest readable checkpoint (a corrupt newest one is reported and skipped), or None if the
        run has none; a path: exactly that file (an error if unreadable); ``"none"``: None."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint.resume={resume!r}: no such file")
            return self.read(path), path
        for path in reversed(self.checkpoints()):
            try:
                return self.read(path), path
            except Exception as err:
                log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", path,
                            type(err).__name__, err)
        return None

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        """One checkpoint file, or an error if it is unreadable or not ours."""
        state = torch.load(path, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or "model" not in state or "position" not in state:
            raise ValueError(f"{path} is not a sigmanens checkpoint (missing 'model'/'position')")
        return state


def _step_of(path: Path) -> int:
    return int(_STEP_FILE.match(path.name).group(1))


def _atomic_torch_save(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
