"""The MLflow pyfunc of a registered program: the one code file logged with the model (MLflow's models from code),
run by ``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` and ``mlflow models serve``.

It imports neither sigmanens_dist nor timm, so a service needs only MLflow and the program's runtime: a ``.pt2`` is
vetted by ``program_check.py`` (logged beside this file as the model's code, the check ``sigmanens predict`` runs)
before torch loads it; an ``.onnx`` runs in onnxruntime, with no torch at all. The metadata is read and checked by
``format.py`` (sigmanens_dist/export/format.py, logged beside this file too: the one definition ``predict`` reads
with), so a program of a later format version is refused here as there. ``predict`` takes float32 images
``(B, C, H, W)`` in [0, 1] (B ≥ 2 for a program normalising each batch by its own statistics alone:
``NormStats.min_batch``) and returns the program's outputs, a dict of arrays named as its metadata's ``outputs``.
A request of another shape or dtype is refused by MLflow's check of the model's signature, one with a value that is
not finite or outside [0, 1] here: both are INVALID_PARAMETER_VALUE, which ``mlflow models serve`` answers with HTTP
400, the reason in the message's last line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

PROGRAM = "program"  # the artifact holding the .pt2 or .onnx

Runner = Callable[[np.ndarray], dict[str, np.ndarray]]


def _format() -> Any:
    """``format.py``, the metadata's one definition, logged beside this file (the model's code_paths); imported when
    the model loads, not when MLflow reads this file to log it (the code paths are not importable then)."""
    import format as program_format

    return program_format


def _meta(path: Path, text: str | None) -> Any:
    """The program's metadata (a ``format.ProgramMeta``), refused unless it is of a format version this code reads
    and names the input shape and the outputs (what serving needs)."""
    try:
        return _format().ProgramMeta.from_json(text)
    except _format().ProgramMetaError as err:
        raise MlflowException(f"{path}: {err}", INVALID_PARAMETER_VALUE) from None


def _torch(path: Path) -> tuple[Runner, Any]:
    """A ``.pt2``, vetted first: ``torch.export.load`` can run code from the file (program_check.py says how)."""
    import program_check  # logged beside this file (the model's code_paths)
    import torch

    try:
        program_check.check_program(path)
    except program_check.ProgramError as err:
        raise MlflowException(str(err), INVALID_PARAMETER_VALUE) from None
    extra = {_format().METADATA_FILE: ""}
    module = torch.export.load(path, extra_files=extra).module()

    def run(images: np.ndarray) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {name: value.numpy() for name, value in module(torch.from_numpy(images)).items()}

    return run, _meta(path, extra[_format().METADATA_FILE])


def _onnx(path: Path) -> tuple[Runner, Any]:
    """An ``.onnx`` in onnxruntime on the CPU (ONNX holds no code to run)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    meta = _meta(path, session.get_modelmeta().custom_metadata_map.get(_format().METADATA_FILE))
    outputs = [o.name for o in session.get_outputs()]

    def run(images: np.ndarray) -> dict[str, np.ndarray]:
        return dict(zip(outputs, session.run(outputs, {meta.input.name: images}), strict=True))

    return run, meta


class Refusal(MlflowException):
    """A refused request. ``mlflow models serve`` prefixes the message with the whole request
    (``Failed to predict data '…'``, 168 lines for a batch of 7 small images): what it repeats is cut to
    :data:`ECHO` characters, the reason (the last line) kept whole."""

    @property
    def message(self) -> str:
        return self._text

    @message.setter
    def message(self, text: str) -> None:
        head, _, reason = str(text).rpartition("\n")
        if len(head) > ECHO:
            head = f"{head[:ECHO]}… ({len(head) - ECHO} characters of the request left out)"
        self._text = f"{head}\n{reason}" if head else reason


ECHO = 200  # characters of the request a refusal repeats


def _refuse(message: str) -> MlflowException:
    return Refusal(f"sigmanens program: {message}", INVALID_PARAMETER_VALUE)


class SigmanensProgram(mlflow.pyfunc.PythonModel):
    """A sigmanens program behind MLflow's pyfunc interface."""

    def load_context(self, context: Any) -> None:
        path = Path(context.artifacts[PROGRAM])
        self.run, self.meta = _onnx(path) if path.suffix == ".onnx" else _torch(path)
        self.low, self.high = self.meta.input.range

    # model_input has no annotation: MLflow reads predict's type hints as a signature, and this model has its own
    def predict(self, context: Any, model_input, params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        """The program's outputs for a batch of images. MLflow has checked the signature's shape and dtype before
        this runs; what it cannot check is refused here in one line."""
        least = self.meta.norm_stats.min_batch
        if len(model_input) < least:  # one image by its own statistics: every image would get one answer
            raise _refuse(f"{len(model_input)} image in the request, and this program normalises each batch by that "
                          f"batch's own BatchNorm statistics (exported with --norm-stats batch, prior 0), which one "
                          f"image cannot give: send {least} or more images per request, or register a program "
                          "exported with --norm-stats-prior N > 0 or --norm-stats train")
        finite = np.isfinite(model_input)
        if not finite.all():
            raise _refuse(f"{int((~finite).sum())} of {finite.size} values are NaN or infinite; give images in "
                          f"[{self.low:g}, {self.high:g}]")
        if model_input.min() < self.low or model_input.max() > self.high:
            raise _refuse(f"values from {model_input.min():g} to {model_input.max():g}; give images in "
                          f"[{self.low:g}, {self.high:g}] (e.g. 8-bit pixels divided by 255)")
        return self.run(np.ascontiguousarray(model_input))

mlflow.models.set_model(SigmanensProgram())
