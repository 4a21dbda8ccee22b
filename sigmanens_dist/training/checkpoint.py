"""Checkpoints that survive crashes and preemption: atomic writes, keep-last-k + best, ``--resume auto``.

One policy, two backends. A checkpoint is either one file ``step_<N>.pt`` under ``<run_dir>/checkpoints`` (written by
rank 0: DDP) or one folder ``step_<N>/`` every rank writes its shards into (FSDP2 through torch.distributed.checkpoint,
DeepSpeed through its engine), with the trainer's own state in ``step_<N>/trainer.pt``. Both are written under a
temporary name and renamed into place, so a reader sees either the old set or the new set, never a half checkpoint;
older ones are deleted only after the new one is complete. ``best.pt`` / ``best/`` is a copy of the best-so-far (by
a metric, lower is better), made the same way.
"""

from __future__ import annotations

import logging
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sigmanens_dist.atomic import atomic_write, replace_folder, torch_save
from sigmanens_dist.distributed.strategies.base import FOLDER_KEY
from sigmanens_dist.errors import MissingPathError, UsageError

__all__ = ["CheckpointManager", "capture_rng", "consolidated_ema", "consolidated_state_dict", "load_file",
           "resolve_checkpoint", "restore_rng"]

log = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^step_(\d+)(\.pt)?$")
#: The trainer's non-tensor state inside a checkpoint folder (position, RNG of all ranks, schedule, config…).
TRAINER_STATE = "trainer.pt"


def load_file(path: Path | str, what: str) -> Any:
    """``torch.load`` of a checkpoint or weights file that cannot run code: tensors, containers and plain values only
    (``weights_only``), plus the numpy RNG state our checkpoints carry. A file from elsewhere holding any other object
    is refused in one line, before anything in it is built."""
    import numpy as np

    rng_parts = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    reconstruct = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    with torch.serialization.safe_globals([reconstruct._reconstruct, *rng_parts]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL (\S+)", str(err))
            raise UsageError(
                f"{what} {path}: refused: it holds {found.group(1) if found else 'a Python object'} besides tensors "
                "and plain values, and unpickling it could run any code. If you trust the file, re-save its tensors "
                "(torch.save(torch.load(f, weights_only=False)['state_dict'], 'weights.pt')) and give that") from None


# What the pickles of this project's checkpoints name besides containers and numbers: torch's tensor rebuilding, the
# numpy RNG state, and the data classes that torch.distributed.checkpoint's metadata and DeepSpeed's state files hold.
_WRITTEN_GLOBALS = frozenset({
    "collections.OrderedDict", "_codecs.encode", "pathlib.PosixPath", "torch.Size", "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter", "torch._tensor._rebuild_from_type_v2", "torch.Tensor",
    "torch.nn.parameter.Parameter", "torch.serialization._get_layout", "numpy.dtype", "numpy.ndarray",
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct",
    "torch.distributed.checkpoint.filesystem._StorageInfo"})
_DATA_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "deepspeed.runtime.zero.config",
                       "deepspeed.runtime.fp16.loss_scaler", "deepspeed.utils.tensor_fragment", "numpy.dtypes")


def written_by_us(name: str) -> bool:
    """Whether a pickle GLOBAL is one that this project's checkpoints contain (a class of those modules, a torch dtype
    or storage type, or one of ``_WRITTEN_GLOBALS``); functions of those modules are not."""
    import importlib

    if name in _WRITTEN_GLOBALS:
        return True
    module, _, attr = name.rpartition(".")
    if module == "torch":
        obj = getattr(torch, attr, None)
        return isinstance(obj, torch.dtype) or (isinstance(obj, type) and attr.endswith("Storage"))
    if module in _DATA_CLASS_MODULES:
        return isinstance(getattr(importlib.import_module(module), attr, None), type)
    return False


class _GlobalsCheck(pickle.Unpickler):
    """Walks a pickle the way ``pickle.load`` would, but every class or function it names resolves to an inert stand-in
    (nothing is constructed or called), and a name outside ``allowed`` stops the walk: the way to vet a pickle that a
    library will then load in full (DCP's metadata, DeepSpeed's state files)."""

    class _Inert(dict):
        """Takes any construction, state, items or appends (an OrderedDict, a list subclass…) and keeps none."""

        __hash__ = object.__hash__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __setstate__(self, state: Any) -> None:
            pass

        def __setitem__(self, key: Any, value: Any) -> None:
            pass

        def append(self, item: Any) -> None:
            pass

        def extend(self, items: Any) -> None:
            pass

    def __init__(self, file: Any, allowed: Callable[[str], bool]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self.allowed(f"{module}.{name}"):
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return self._Inert

    def persistent_load(self, pid: Any) -> None:  # torch.save's tensor storages: their bytes are not pickles
        return None


def check_pickle(path: Path, allowed: Callable[[str], bool], what: str) -> None:
    """Refuse (one line) a pickle file, or a ``torch.save`` zip's pickle, that names a class or function outside
    ``allowed``: a checkpoint folder from elsewhere must not run code when torch.distributed.checkpoint or DeepSpeed,
    which unpickle without restriction, read it."""
    import zipfile

    with open(path, "rb") as f:
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                streams = [z.open(n) for n in z.namelist() if n.endswith(".pkl")]
        else:
            f.seek(0)
            streams = [f]
        try:
            for stream in streams:
                _GlobalsCheck(stream, allowed).load()
        except pickle.UnpicklingError as err:
            raise UsageError(f"{what} {path}: refused: it holds {str(err).removeprefix('GLOBAL ')}, which is not "
                             "in a checkpoint this project writes, and unpickling it could run any code") from None


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
        improved = self._improves(metric)
        torch_save({**state, "best": self.best_metric}, path)
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
            torch_save({**state, "best": self.best_metric}, tmp / TRAINER_STATE)
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

    def load(self, resume: str) -> tuple[dict[str, Any], Path] | None:
        """``"auto"``: the newest readable checkpoint (a corrupt newest one is reported and skipped), or None if the
        run has none; a path: exactly that file (an error if unreadable); ``"none"``: None."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if not path.exists():
                raise MissingPathError(f"checkpoint.resume={resume!r}: no such file or folder")
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
        """One checkpoint, or an error if it is unreadable or not ours. A folder gives the trainer's state with the
        folder under ``FOLDER_KEY`` (the strategy reads its shards from there), once its shard index is readable."""
        path = Path(path)
        if path.is_dir():
            state = load_file(path / TRAINER_STATE, "checkpoint")
            if not isinstance(state, dict) or "format" not in state or "position" not in state:
                raise UsageError(f"{path} is not a sigmanens checkpoint folder (missing 'format'/'position')")
            check_folder(path, state["format"])
            return {**state, FOLDER_KEY: path}
        state = load_file(path, "checkpoint")
        if not isinstance(state, dict) or "model" not in state or "position" not in state:
            raise UsageError(f"{path} is not a sigmanens checkpoint (missing 'model'/'position')")
        return state


def resolve_checkpoint(path: Path | str, what: str = "checkpoint") -> tuple[Path, str]:
    """A checkpoint as given (a ``step_N.pt`` / ``best.pt`` file or a step folder), or for a run directory its best
    checkpoint, else its newest; returned with a phrase saying which was picked (callers log it). ``what`` names
    the argument in the error (e.g. ``model.init_from``)."""
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"{what} {path}: no such file or folder")
    if path.is_file() or (path / TRAINER_STATE).is_file():
        return path, f"{path}"
    manager = CheckpointManager(path)
    best = [b for b in (manager.directory / "best.pt", manager.directory / "best") if b.exists()]
    if best:
        return best[0], f"{best[0]} (the run's best checkpoint)"
    steps = manager.checkpoints()
    if steps:
        return steps[-1], f"{steps[-1]} (the run's newest checkpoint; it has no best)"
    raise MissingPathError(f"{what} {path}: a folder that is neither a checkpoint (no {TRAINER_STATE}) nor a run "
                            f"directory with checkpoints (nothing in {manager.directory})")


def check_folder(path: Path, fmt: str) -> None:
    """Raise if a checkpoint folder's shard index is missing or unreadable (a truncated or foreign folder)."""
    if fmt == "dcp":
        from torch.distributed.checkpoint import FileSystemReader

        check_pickle(path / ".metadata", written_by_us, "checkpoint")  # DCP unpickles it without restriction
        FileSystemReader(str(path)).read_metadata()
    elif fmt == "deepspeed":
        tag = path / "latest"
        if not tag.is_file() or not (path / tag.read_text().strip()).is_dir():
            raise FileNotFoundError(f"{path} has no complete DeepSpeed checkpoint ('latest' and its tag folder)")
        for file in sorted((path / tag.read_text().strip()).glob("*.pt")):  # DeepSpeed loads with weights_only=False
            check_pickle(file, written_by_us, "checkpoint")
    else:
        raise ValueError(f"{path}: unknown checkpoint folder format {fmt!r}")


def _step_of(path: Path) -> int:
    return int(_STEP_FILE.match(path.name).group(1))


def consolidated_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full model state dict of a checkpoint and the trainer's state saved with it (config, model args…)."""
    path = Path(path)
    state = CheckpointManager.read(path)  # refuses an incomplete or foreign checkpoint
    fmt = state.get("format", "file")
    if fmt == "file":
        return state["model"], state
    if fmt == "dcp":
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

        return _load_state_dict_from_keys("model", checkpoint_id=str(path))["model"], state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from sigmanens_dist.distributed.strategies.deepspeed import TAG

    return get_fp32_state_dict_from_zero_checkpoint(str(path), tag=TAG), state


def consolidated_ema(path: Path, state: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """The EMA weights of a checkpoint whose run kept an EMA (in ``trainer.pt``, or with the DCP shards), else None."""
    if state.get("ema") is not None or state.get("format") != "dcp":
        return state.get("ema")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not any(k.startswith("ema.") for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata):
        return None
    return _load_state_dict_from_keys("ema", checkpoint_id=str(path))["ema"]
