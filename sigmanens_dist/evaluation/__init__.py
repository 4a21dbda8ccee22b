"""Evaluation: ``sigmanens eval`` and the end-of-training hook (see docs/eval.md): the scored passes, metrics,
reports and plots, on top of what a program computes (:mod:`sigmanens_dist.inference`)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["run_eval"]

# imported on first use: they import torch, which `sigmanens eval --help` does not need
_LAZY = {"run_eval": "sigmanens_dist.evaluation.run"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
