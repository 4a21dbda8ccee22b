"""Whether the installed timm has a model architecture, read from timm's sources instead of importing it.

``import timm`` imports torch (seconds); the config checks ``model.name`` on every ``--check`` and every command that
loads a recipe. The architectures a timm release registers are its ``@register_model`` functions, so a name found
there is known without the import. A name not found there (a misspelling, or an alias timm keeps for a deprecated
name) is left to :func:`timm.is_model`, which stays the authority: this only makes the common case fast.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

__all__ = ["registered_without_import"]

_REGISTERED = re.compile(r"^@register_model\s*\n(?:@[^\n]*\n)*def\s+(\w+)\s*\(", re.MULTILINE)


def registered_without_import(name: str) -> bool:
    """True when ``name``'s architecture (the part before a pretrained tag: ``resnet50`` of ``resnet50.a1_in1k``,
    as timm's ``get_arch_name``) is a ``@register_model`` function of the installed timm; False when not found
    there, which is not a refusal."""
    return name.split(".", 1)[0] in _registered()


@functools.cache
def _registered() -> frozenset[str]:
    spec = importlib.util.find_spec("timm")  # locates the package without running it
    if spec is None or spec.origin is None:
        return frozenset()
    names: set[str] = set()
    for source in (Path(spec.origin).parent / "models").glob("*.py"):
        try:
            names.update(_REGISTERED.findall(source.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError):
            continue
    return frozenset(names)
