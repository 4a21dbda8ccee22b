"""Loading that cannot run code: every byte a checkpoint or weights path reaches is read as tensors and plain values.

Three ways in, one rule ("nothing a user loads runs code"):

* ``.pt`` files (a checkpoint, ``trainer.pt``, a weights file): ``torch.load(weights_only=True)`` with the numpy RNG
  classes our checkpoints carry allow-listed (:func:`load_file`); ``.safetensors`` is not pickle at all.
* DCP folders: torch's reader unpickles ``.metadata`` and every non-tensor entry of the ``.distcp`` shards without
  restriction. :class:`SafeDCPReader` reads the metadata through an allow-list of DCP's own data classes and loads
  each non-tensor entry with ``weights_only`` before torch's planner sees it.
* DeepSpeed folders, which DeepSpeed reads with ``weights_only=False``: each file is vetted first
  (:func:`check_torch_file`), through torch's own zip reader, so the records checked are the records torch will read,
  whatever bytes the file starts or ends with.

Anything else (a foreign class, a truncated, empty or garbage file) is refused in one line naming the file.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from sigmanens_dist.errors import UsageError
from sigmanens_dist.program_check import ZIP_MAGIC, ProgramError, ProgramRefused, check_program, unreadable

__all__ = ["RefusedFileError", "SafeDCPReader", "check_program_file", "check_torch_file", "dcp_refusals", "load_file",
           "load_safetensors", "written_by_us"]


class RefusedFileError(UsageError):
    """A file that would run code when loaded: never skipped over like a merely unreadable one, always reported."""


def _refused(what: str, path: Any, name: str, why: str) -> RefusedFileError:
    return RefusedFileError(f"{what} {path}: refused: it holds {name}{why}, and unpickling it could run any code")


def load_file(path: Path | str | IO[bytes], what: str, *, label: str | None = None) -> Any:
    """``torch.load`` of a checkpoint or weights file that cannot run code: tensors, containers and plain values only
    (``weights_only``), plus the numpy RNG state our checkpoints carry. A file holding any other object is refused,
    and one that is not a complete ``torch.save`` file is reported, in one line, before anything in it is built."""
    rng_parts = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    reconstruct = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    with torch.serialization.safe_globals([reconstruct._reconstruct, *rng_parts]):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL (\S+)", str(err))
            if found is None:  # not a name torch's safe unpickler blocked: bytes it cannot parse (corrupt, foreign)
                raise _unreadable(what, label or path, err) from None
            refusal = _refused(what, label or path, found.group(1), " besides tensors and plain values")
            raise RefusedFileError(f"{refusal}. If you trust the file, re-save its tensors (torch.save(torch.load(f, "
                                   "weights_only=False)['state_dict'], 'weights.pt')) and give that") from None
        except (RuntimeError, EOFError, ValueError, TypeError, OverflowError, MemoryError, KeyError,
                AttributeError, IndexError, UnicodeDecodeError) as err:
            raise _unreadable(what, label or path, err) from None


def load_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file (no code in the format), or one line saying why it cannot be read."""
    from safetensors.torch import load_file as load  # lazy: safetensors comes with timm, which predict does without

    try:
        return load(path)
    except Exception as err:  # SafetensorError and friends: the library has no common base class
        raise _unreadable(what, path, err) from None


def _unreadable(what: str, path: Any, err: BaseException) -> UsageError:
    return UsageError(unreadable(what, path, err))


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
    """Whether a pickle GLOBAL is one that this project's checkpoints contain: one of ``_WRITTEN_GLOBALS``, a torch
    dtype or storage type, or a class *defined* in one of the data-class modules (not a function, not a name they
    import)."""
    if name in _WRITTEN_GLOBALS:
        return True
    module, _, attr = name.rpartition(".")
    if module == "torch":
        obj = getattr(torch, attr, None)
        return isinstance(obj, torch.dtype) or (isinstance(obj, type) and attr.endswith("Storage"))
    if module in _DATA_CLASS_MODULES:
        try:
            obj = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            return False
        return isinstance(obj, type) and obj.__module__ == module
    return False


class _GlobalsCheck(pickle.Unpickler):
    """Walks a pickle the way ``pickle.load`` would, but every class or function it names resolves to an inert stand-in
    (nothing is constructed or called), and a name outside ``allowed`` stops the walk: the way to vet a pickle that a
    library will then load in full (DeepSpeed's state files)."""

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

    def __init__(self, file: IO[bytes], allowed: Callable[[str], bool]) -> None:
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self.allowed(f"{module}.{name}"):
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return self._Inert

    def persistent_load(self, pid: Any) -> None:  # torch.save's tensor storages: their bytes are not pickles
        return None


def check_torch_file(path: Path, allowed: Callable[[str], bool], what: str) -> None:
    """Refuse (one line) a file a library will ``torch.load`` without restriction (DeepSpeed's) unless it is a
    ``torch.save`` zip whose every pickle names only ``allowed`` classes. The records are those torch's own zip
    reader finds, so a pickle with a zip appended or a zip inside a pickle is judged as torch would read it; the
    legacy (non-zip) format, which nothing here writes, is refused."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            raise RefusedFileError(f"{what} {path}: refused: not a torch.save zip file, the only format this "
                                   "project's checkpoints use (a legacy or foreign pickle could run any code)")
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = [name for name in reader.get_all_records() if name.endswith(".pkl")]
        for name in records:
            _walk(io.BytesIO(reader.get_record(name)), allowed, what, path)
    except RuntimeError as err:  # the zip reader's "failed finding central directory" and the like
        raise _unreadable(what, path, err) from None


def _walk(stream: IO[bytes], allowed: Callable[[str], bool], what: str, path: Any) -> None:
    try:
        _GlobalsCheck(stream, allowed).load()
    except pickle.UnpicklingError as err:
        if str(err).startswith("GLOBAL "):
            raise _refused(what, path, str(err).removeprefix("GLOBAL "), ", which is not in a checkpoint this project "
                           "writes") from None
        raise _unreadable(what, path, err) from None
    except (EOFError, ValueError, TypeError, OverflowError, MemoryError, KeyError, AttributeError, IndexError,
            UnicodeDecodeError, RecursionError) as err:
        raise _unreadable(what, path, err) from None


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata from the allow-list :func:`written_by_us` (DCP's data classes, sizes, dtypes, paths);
    any other name is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if not written_by_us(f"{module}.{name}"):
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return super().find_class(module, name)


class _VettedBytes:
    """A load planner whose non-tensor entries are first loaded with ``weights_only`` (torch's planner then
    unpickles the same bytes without restriction); everything else is the wrapped planner's."""

    def __init__(self, planner: Any, path: Path) -> None:
        self._planner, self._path = planner, path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        load_file(value, "checkpoint", label=f"{self._path} (its entry {read_item.dest_index.fqn!r})")
        value.seek(0)
        self._planner.load_bytes(read_item, value)


@contextlib.contextmanager
def dcp_refusals() -> Iterator[None]:
    """Around a DCP load: a refusal raised while reading comes out as itself, not wrapped in DCP's
    ``CheckpointException`` (a multi-line report of every rank's traceback)."""
    try:
        yield
    except CheckpointException as err:
        refusals = [exc for exc, _ in err.failures.values() if isinstance(exc, UsageError)]
        if refusals:
            raise refusals[0] from None
        raise


class SafeDCPReader(FileSystemReader):
    """``torch.distributed.checkpoint``'s file reader with its two unrestricted unpicklings made safe: pass it as
    ``storage_reader=`` wherever a DCP folder is read."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except pickle.UnpicklingError as err:
            if str(err).startswith("GLOBAL "):
                raise _refused("checkpoint", path, str(err).removeprefix("GLOBAL "), ", which is not in a "
                               "checkpoint this project writes") from None
            raise _unreadable("checkpoint", path, err) from None
        except (OSError, EOFError, ValueError, TypeError, OverflowError, MemoryError, KeyError, AttributeError,
                IndexError, UnicodeDecodeError, RecursionError) as err:
            raise _unreadable("checkpoint", path, err) from None
        if not isinstance(metadata, Metadata):
            raise UsageError(f"checkpoint {path}: not the metadata of a torch.distributed.checkpoint folder")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        return super().read_data(plan, _VettedBytes(planner, Path(self.path)))


# ---------------------------------------------------------------------------------------------------------------------
# torch.export programs (.pt2): vetted by sigmanens_dist/program_check.py, standalone so that a registered program's
# pyfunc runs the same check where this package is not installed.


def check_program_file(path: Path, what: str = "PROGRAM") -> None:
    """Refuse (one line) a ``.pt2`` that ``torch.export.load`` or ``.module()`` would run code from
    (:func:`~sigmanens_dist.program_check.check_program`), or that is not a readable program."""
    try:
        check_program(path, what)
    except ProgramRefused as err:
        raise RefusedFileError(str(err)) from None
    except ProgramError as err:
        raise UsageError(str(err)) from None
