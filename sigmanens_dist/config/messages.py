"""What the user reads when a config is wrong: :class:`ConfigError` (every problem at once, one
``  - dotted.path: what is wrong (got value)`` line each) and the wording of those lines (pydantic's error kinds in
plain words, "did you mean" suggestions)."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sigmanens_dist.errors import UsageError

__all__ = ["ConfigError"]


class ConfigError(UsageError):
    """Every problem found in one config, one ``  - dotted.path: what is wrong (got value)`` line each."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source, self.problems = source, list(problems)
        count = len(self.problems)
        super().__init__(f"{source}: {count} problem{'' if count == 1 else 's'} in the config:\n"
                         + "\n".join(self.problems))


def _model_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The section class at a dotted location below ``root`` (``()`` is ``root`` itself, the whole
    :class:`~sigmanens_dist.config.schema.Config`); None inside non-section fields."""
    model: type[BaseModel] = root
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _keys_of(model: type[BaseModel]) -> list[str]:
    return [k for n, f in model.model_fields.items() for k in (n, f.alias) if k]


_MESSAGES = {"greater_than": "must be > {gt}", "greater_than_equal": "must be >= {ge}", "less_than": "must be < {lt}",
             "less_than_equal": "must be <= {le}", "finite_number": "must be a finite number",
             "int_parsing": "must be an integer", "int_from_float": "must be a whole number",
             "float_parsing": "must be a number", "bool_parsing": "must be true or false",
             "string_too_short": "must not be empty", "literal_error": "must be {expected}",
             "string_type": "must be a string", "dict_type": "must be a mapping", "list_type": "must be a list",
             "tuple_type": "must be a list", "too_short": "must have {min_length} items",
             "too_long": "must have {max_length} items"}


def _from_pydantic(err: dict[str, Any], root: type[BaseModel]) -> str:
    """One problem line from a pydantic error of validating ``root``."""
    loc, got, kind, ctx = list(err["loc"]), err.get("input"), err["type"], err.get("ctx") or {}
    if kind == "config_field":
        loc.append(ctx["field"])
        got, what = ctx["got"], err["msg"]
    elif kind == "extra_forbidden":
        section = _model_at(root, loc[:-1])
        what = "unknown key" + (_did_you_mean(str(loc[-1]), _keys_of(section)) if section else "")
    elif kind in _MESSAGES:
        what = _MESSAGES[kind].format(**ctx)
    else:
        what = err["msg"].removeprefix("Value error, ")
        what = what[:1].lower() + what[1:]
    return _line(_dotted(loc), what, got)


def _dotted(loc: Sequence[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "(top level)"


def _line(path: str, what: str, got: Any) -> str:
    shown = repr(str(got)) if isinstance(got, Path) else repr(got)
    if len(shown) > 100:
        shown = shown[:97] + "..."
    return f"  - {path}: {what} (got {shown})"


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
