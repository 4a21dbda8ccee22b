"""A program head written as one file, in either format, with its metadata inside: a ``torch.export`` program
(``.pt2``, the metadata JSON as an extra file, run with torch alone) or an ONNX model exported with torch's dynamo
exporter (``.onnx``, the metadata in its ``metadata_props``, run with onnxruntime alone: ``get_modelmeta()
.custom_metadata_map``). Both take the input ``images`` with a batch axis free from the program's smallest batch up and
give one output per name in the metadata's ``outputs``, in that order (docs/deploy.md)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch
from torch import nn

from sigmanens_dist.atomic import atomic_write

__all__ = ["QUIET_EXPORT_WARNINGS", "TRANSLATIONS", "write_program"]

QUIET_EXPORT_WARNINGS = (
    # torch.export.save on weights that are views of one storage (the σN-Ens members'): they are on the CPU here
    (r"No complete tensor found in the group! Returning the first one\. This may cause issues when your weights "
     r"are not on CPU\.", UserWarning),
)


def _stable_sort(self: Any, stable: bool | None = None, dim: int = -1, descending: bool = False) -> tuple[Any, Any]:
    """``aten.sort.stable`` (the APS/RAPS scores' sort), which torch's ONNX library lacks: ONNX ``TopK`` over the
    whole axis, sorted, breaks ties by the lower index first, which is what a stable sort does."""
    from onnxscript import opset18 as op  # optional extra: deploy (onnxscript)

    size = op.Reshape(op.Gather(op.Shape(self), dim, axis=0), op.Constant(value_ints=[1]))
    return op.TopK(self, size, axis=dim, largest=descending, sorted=True)


TRANSLATIONS = {torch.ops.aten.sort.stable: _stable_sort}  # torch.onnx.export's custom_translation_table


def write_program(head: nn.Module, example: torch.Tensor, metadata: tuple[str, str], min_batch: int,
                  fmt: Literal["torch", "onnx"], out: Path) -> None:
    """Export ``head`` (traced at ``example``; outputs named by its ``outputs``; below ``min_batch`` the program
    itself refuses a batch) as a ``fmt`` program with ``metadata`` (key, JSON text), written atomically at ``out``."""
    batch = torch.export.Dim("batch", min=min_batch)
    with torch.no_grad():
        write = _onnx(head, example, batch, metadata) if fmt == "onnx" else _torch(head, example, batch, metadata)
    atomic_write(out, write)


def _torch(head: nn.Module, example: torch.Tensor, batch: Any, metadata: tuple[str, str]
           ) -> Callable[[BinaryIO], Any]:
    program = torch.export.export(head, (example,), dynamic_shapes={"x": {0: batch}})

    def save(f: BinaryIO) -> None:
        """``torch.export.save`` without the warnings :data:`QUIET_EXPORT_WARNINGS` names (each benign here)."""
        with warnings.catch_warnings():
            for message, category in QUIET_EXPORT_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
            torch.export.save(program, f, extra_files=dict([metadata]))

    return save


def _onnx(head: nn.Module, example: torch.Tensor, batch: Any, metadata: tuple[str, str]
          ) -> Callable[[BinaryIO], Any]:
    import onnx  # optional extra: deploy (onnx)

    program = torch.onnx.export(head, (example,), dynamo=True, input_names=["images"],
                                output_names=list(head.outputs), dynamic_shapes={"x": {0: batch}},
                                custom_translation_table=TRANSLATIONS, verbose=False)
    model = program.model_proto
    onnx.helper.set_model_props(model, dict([metadata]))
    data = model.SerializeToString()
    return lambda f: f.write(data)
