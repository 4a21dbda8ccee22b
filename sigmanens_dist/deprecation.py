"""Names that moved, served from their old module for one release with a DeprecationWarning: one helper, so that every
moved name warns the same way and the old module imports nothing of the new one until the name is asked for."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["moved"]


def moved(old: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the module ``old`` that serves each name from its new module ``names[name]``."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} moved to {names[name]}.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(names[name]), name)

    return __getattr__
