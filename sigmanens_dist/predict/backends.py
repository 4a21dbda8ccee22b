"""The program ``sigmanens predict`` runs, behind one small interface: ``meta`` (the program's ``sigmanens.json``
as a checked :class:`~sigmanens_dist.program_meta.ProgramMeta`) and ``__call__`` (a ``(B, C, H, W)`` float32 batch
→ its outputs as numpy arrays). Two kinds of file:

* ``.pt2``, a ``torch.export`` program (``sigmanens export RUN --program``), vetted by
  :func:`~sigmanens_dist.safe_load.check_program_file` before ``torch.export.load`` sees it, because that load can
  run code from the file;
* ``.onnx``, run by onnxruntime: input ``images``, outputs named as the metadata's ``outputs``, the metadata in the
  model's ``metadata_props`` under ``sigmanens.json`` (ONNX holds no code to run).

Of the exporter only the torch-free :mod:`sigmanens_dist.program_meta` is imported: deploying needs no evaluation
code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from sigmanens_dist.errors import MissingPathError, UsageError
from sigmanens_dist.program_meta import METADATA_FILE, LaterFormatError, ProgramMeta, ProgramMetaError
from sigmanens_dist.safe_load import check_program_file

__all__ = ["Program", "load_program"]


class Program(Protocol):
    path: Path
    meta: ProgramMeta

    def __call__(self, images: torch.Tensor) -> dict[str, np.ndarray]: ...


def _checked_meta(path: Path, text: str | None) -> ProgramMeta:
    """The metadata, refused in one line unless it is of a format version this code reads and names the input shape
    and every output predict writes."""
    try:
        return ProgramMeta.from_json(text)
    except LaterFormatError as err:
        raise UsageError(f"PROGRAM {path}: {err}") from None
    except ProgramMetaError as err:
        raise UsageError(f"PROGRAM {path}: {err}; write it with `sigmanens export RUN --program OUT`") from None


class TorchProgram:
    """A ``.pt2`` on ``device``; outputs copied to the CPU."""

    def __init__(self, path: Path, device: torch.device) -> None:
        check_program_file(path)
        extra = {METADATA_FILE: ""}
        try:
            program = torch.export.load(path, extra_files=extra)
        except (RuntimeError, ValueError, KeyError, AssertionError) as err:
            raise UsageError(f"PROGRAM {path}: not a loadable torch.export program ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:200] if str(err) else ''})") from None
        self.path, self.meta = path, _checked_meta(path, extra[METADATA_FILE])
        self.device = device
        self.module = program.module().to(device)

    def __call__(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        with torch.no_grad():
            out = self.module(images.to(self.device, non_blocking=True))
        return {name: value.cpu().numpy() for name, value in out.items()}


class OnnxProgram:
    """An ``.onnx`` file in onnxruntime, on the GPU when ``device`` is cuda (and onnxruntime has CUDA), on as many
    CPU threads as torch's (``OMP_NUM_THREADS``, ``torch.set_num_threads``)."""

    def __init__(self, path: Path, device: torch.device) -> None:
        try:
            import onnxruntime  # optional extra: deploy (onnxruntime)
        except ImportError:
            raise UsageError(f"PROGRAM {path}: running .onnx programs needs onnxruntime (pip install "
                             "onnxruntime, or onnxruntime-gpu)") from None
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # one knob for both formats: OMP_NUM_THREADS
        try:
            self.session = onnxruntime.InferenceSession(str(path), options, providers=providers)
        except Exception as err:  # onnxruntime's own error types share no public base class
            raise UsageError(f"PROGRAM {path}: not a loadable ONNX model ({str(err).splitlines()[0][:200]})") from None
        props = self.session.get_modelmeta().custom_metadata_map
        self.path, self.meta = path, _checked_meta(path, props.get(METADATA_FILE))
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        values = self.session.run(self.outputs, {"images": images.numpy()})
        return dict(zip(self.outputs, values, strict=True))


def load_program(path: Path, device: torch.device) -> Program:
    """The program at ``path`` (``.pt2`` or ``.onnx``), or one line saying why not."""
    if not path.is_file():
        raise MissingPathError(f"PROGRAM {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".pt2":
        return TorchProgram(path, device)
    if suffix == ".onnx":
        return OnnxProgram(path, device)
    raise UsageError(f"PROGRAM {path}: give a .pt2 (sigmanens export RUN --program OUT.pt2) or an .onnx program")
