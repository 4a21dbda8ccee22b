"""The MLflow pyfunc of a registered program: the one code file logged with the model (MLflow's models from code),
run by ``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` and ``mlflow models serve``.

It imports neither sigmanens_dist nor timm, so a service needs only MLflow and the program's runtime: a ``.pt2`` is
vetted by ``program_check.py`` (logged beside this file as the model's code, the check ``sigmanens predict`` runs)
before torch loads it; an ``.onnx`` runs in onnxruntime, with no torch at all. The metadata is read and checked by
``program_meta.py`` (logged beside this file too: the one definition ``predict`` reads
with), so a program of a later format version is refused here as there. ``predict`` takes float32 images
``(B, C, H, W)`` in [0, 1], or a table of one column of image files (bytes; base64 text in JSON), decoded and made
what the program takes by ``image_input.py`` (logged beside this file: the transform ``sigmanens predict`` runs), and
returns the program's outputs, a dict of arrays named as its metadata's ``outputs``, one row per image. B ≥ 2 for a
program normalising each batch by its own statistics alone (``NormStats.min_batch``), at most :data:`MAX_IMAGES`.
The model has no input signature (no one signature describes both forms): every input is checked here instead, and
what the program cannot take is INVALID_PARAMETER_VALUE, which ``mlflow models serve`` answers with HTTP 400, the
reason in the message's last line.
"""

from __future__ import annotations

import base64
import binascii
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
    """``program_meta.py``, the metadata's one definition, logged beside this file (the model's code_paths); imported
    when the model loads, not when MLflow reads this file to log it (the code paths are not importable then)."""
    import program_meta  # logged beside this file (the model's code_paths)

    return program_meta


def _meta(path: Path, text: str | None) -> Any:
    """The program's metadata (a ``program_meta.ProgramMeta``), refused unless it is of a format version this code reads
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
    import onnxruntime  # optional extra: deploy (onnxruntime)

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

    # model_input is annotated np.ndarray, a type MLflow infers no schema from: it then neither wraps predict nor
    # warns that type hints are missing. A table of image files (a pandas DataFrame) is taken too: no one signature
    # describes both forms, so both are checked here.
    def predict(self, context: Any, model_input: np.ndarray, params: dict[str, Any] | None = None
                ) -> dict[str, np.ndarray]:
        """The program's outputs, one row per image in the order given, for float images ``(B, C, H, W)`` or a
        table of one column of image files (bytes, or base64 text as JSON carries them). What the program cannot
        take is refused in one line: the whole request, naming the first rows at fault."""
        if len(model_input) > MAX_IMAGES:
            raise _refuse(f"{len(model_input)} images in one request; at most {MAX_IMAGES} (split the request)")
        images = self._files(model_input) if _is_table(model_input) else self._floats(model_input)
        least = self.meta.norm_stats.min_batch
        if len(images) < least:  # one image by its own statistics: every image would get one answer
            raise _refuse(f"{len(images)} image in the request, and this program normalises each batch by that "
                          f"batch's own BatchNorm statistics (exported with --norm-stats batch, prior 0), which one "
                          f"image cannot give: send {least} or more images per request, or register a program "
                          "exported with --norm-stats-prior N > 0 or --norm-stats train")
        return self.run(images)

    def _floats(self, model_input: Any) -> np.ndarray:
        """Float images as given, checked: shape, a number type, finite, in the program's range."""
        array = np.asarray(model_input)
        chw = tuple(self.meta.input.chw)
        if array.ndim != 4 or tuple(array.shape[1:]) != chw:
            raise _refuse(f"images of shape {array.shape}; the program takes (B, {', '.join(map(str, chw))}) float "
                          "images, or a column of image files")
        if array.dtype.kind not in "fiu":
            raise _refuse(f"values of type {array.dtype}; give float32 images in [{self.low:g}, {self.high:g}]")
        finite = np.isfinite(array)
        if not finite.all():
            raise _refuse(f"{int((~finite).sum())} of {finite.size} values are NaN or infinite; give images in "
                          f"[{self.low:g}, {self.high:g}]")
        if array.min() < self.low or array.max() > self.high:
            raise _refuse(f"values from {array.min():g} to {array.max():g}; give images in "
                          f"[{self.low:g}, {self.high:g}] (e.g. 8-bit pixels divided by 255)")
        return np.ascontiguousarray(array, dtype=np.float32)

    def _files(self, table: Any) -> np.ndarray:
        """A table's image files decoded and made what the program takes by ``image_input.py`` (the transform
        ``sigmanens predict`` runs), as float32 in [0, 1]."""
        import image_input  # logged beside this file (the model's code_paths)

        if "image" not in table.columns and len(table.columns) != 1:
            raise _refuse(f"a table of columns {list(table.columns)[:5]}; give one column 'image' of image files "
                          "(bytes, or base64 text)")
        column = table["image"] if "image" in table.columns else table.iloc[:, 0]
        channels, height, width = self.meta.input.chw
        images, bad = [], []
        for row, value in enumerate(column):
            try:
                data = value if isinstance(value, bytes | bytearray) else _base64(value)
                images.append(image_input.pixels(bytes(data), channels, (height, width), self.meta.input.crop_ratio,
                                                 f"row {row}"))
            except image_input.ImageError as err:
                bad.append(f"row {row}: {err}")
        if bad:
            more = f" (and {len(bad) - 3} more rows)" if len(bad) > 3 else ""
            raise _refuse(f"{len(bad)} of {len(column)} images cannot be used, so none is predicted: "
                          f"{'; '.join(bad[:3])}{more}")
        return np.stack(images).astype(np.float32) / 255 if images else np.zeros((0, channels, height, width),
                                                                                  np.float32)


MAX_IMAGES = 1024  # images one request may hold: a larger batch is refused (400), the server keeps answering


def _is_table(model_input: Any) -> bool:
    """A pandas DataFrame (``dataframe_split`` over HTTP, a Spark batch), not an array of floats."""
    return hasattr(model_input, "columns") and hasattr(model_input, "iloc")


def _base64(value: Any) -> bytes:
    """An image file sent as base64 text (JSON has no bytes)."""
    import image_input  # logged beside this file (the model's code_paths)

    if not isinstance(value, str):
        raise image_input.ImageError(f"a {type(value).__name__}, not an image file (bytes, or base64 text)")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise image_input.ImageError("text that is not base64 (give the image file's bytes base64-encoded)") \
            from None


mlflow.models.set_model(SigmanensProgram())
