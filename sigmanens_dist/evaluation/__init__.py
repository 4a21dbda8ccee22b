"""Evaluation: ``sigmanens eval`` and the end-of-training hook (see docs/eval.md)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EvalCheckpoint", "load_for_eval", "run_eval", "sub_ensemble"]

# imported on first use: they import torch, which `sigmanens eval --help` does not need
_LAZY = {"EvalCheckpoint": "sigmanens_dist.evaluation.load", "load_for_eval": "sigmanens_dist.evaluation.load",
         "run_eval": "sigmanens_dist.evaluation.run", "sub_ensemble": "sigmanens_dist.evaluation.run"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
