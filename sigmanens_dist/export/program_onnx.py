"""``sigmanens export RUN --program OUT.onnx``: the same program head as the torch program (``program.ProgramHead``),
exported with torch's dynamo ONNX exporter, so that onnxruntime alone runs it (docs/deploy.md). Input ``images`` with a
free batch axis, one output per name in the metadata's ``outputs`` (same order), and the metadata JSON in the model's
``metadata_props`` under ``sigmanens.json`` (onnxruntime reads it: ``get_modelmeta().custom_metadata_map``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from sigmanens_dist.atomic import atomic_write

__all__ = ["TRANSLATIONS", "write_onnx"]


def _stable_sort(self: Any, stable: bool | None = None, dim: int = -1, descending: bool = False) -> tuple[Any, Any]:
    """``aten.sort.stable`` (the APS/RAPS scores' sort), which torch's ONNX library lacks: ONNX ``TopK`` over the
    whole axis, sorted, breaks ties by the lower index first, which is what a stable sort does."""
    from onnxscript import opset18 as op  # optional extra: deploy (onnxscript)

    size = op.Reshape(op.Gather(op.Shape(self), dim, axis=0), op.Constant(value_ints=[1]))
    return op.TopK(self, size, axis=dim, largest=descending, sorted=True)


TRANSLATIONS = {torch.ops.aten.sort.stable: _stable_sort}  # torch.onnx.export's custom_translation_table


def write_onnx(head: nn.Module, example: torch.Tensor, metadata: tuple[str, str], min_batch: int, out: Path
               ) -> None:
    """Export ``head`` (traced at ``example``, batch axis free from ``min_batch`` up; outputs named by its
    ``outputs``) and write it, with ``metadata`` (key, JSON text) in its ``metadata_props``, atomically at ``out``."""
    import onnx  # optional extra: deploy (onnx)

    batch = torch.export.Dim("batch", min=min_batch)
    with torch.no_grad():
        program = torch.onnx.export(head, (example,), dynamo=True, input_names=["images"],
                                    output_names=list(head.outputs), dynamic_shapes={"x": {0: batch}},
                                    custom_translation_table=TRANSLATIONS, verbose=False)
    model = program.model_proto
    onnx.helper.set_model_props(model, dict([metadata]))
    atomic_write(out, lambda f: f.write(model.SerializeToString()))
