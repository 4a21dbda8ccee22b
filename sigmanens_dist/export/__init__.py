"""What leaves a run for use elsewhere: a checkpoint's weights as a plain state dict (:mod:`.state_dict`), the
ensemble as one program file, a ``torch.export`` ``.pt2`` (:mod:`.program`) or an ONNX model (:mod:`.program_onnx`),
whose metadata record is :mod:`sigmanens_dist.program_meta` (torch-free and standalone: what ``sigmanens predict``
and a registered model read). See docs/deploy.md."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["export_program", "load_model"]

# imported on first use: they import torch, which `sigmanens export --help` does not need
_LAZY = {"export_program": "sigmanens_dist.export.program", "load_model": "sigmanens_dist.export.state_dict"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
