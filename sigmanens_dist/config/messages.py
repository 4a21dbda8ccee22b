"""What the user reads when a config is wrong: :class:`ConfigError` (every problem at once, one
``  - dotted.path: what is wrong (got value)`` line each) and the wording of those lines (pydantic's error kinds in
plain words, "did you mean" suggestions)."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

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
    :class:`~sigmanens_dist.config.schema.Config`), an optional one (``train.augmix``) included; None inside
    non-section fields."""
    model: type[BaseModel] = root
    for part in loc:
        field = _field(model, part)
        found = field is not None and next((a for a in (field.annotation, *typing.get_args(field.annotation))
                                            if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if not found:
            return None
        model = found
    return model


def _field(model: type[BaseModel], key: Any) -> FieldInfo | None:
    """The field of ``model`` spelt ``key`` (its name or alias)."""
    return next((f for n, f in model.model_fields.items() if key in (n, f.alias)), None)


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


def _from_pydantic(errors: Sequence[dict[str, Any]], root: type[BaseModel]) -> list[str]:
    """The problem lines of pydantic's errors of validating ``root``. A union field's alternatives (``float |
    'num_members'``) each fail, under labels such as ``literal['num_members']``: they make one line, ``must be a
    number, not a string, or 'num_members'``, instead of one per alternative under a path no key has."""
    lines: list[tuple[str, list[str], Any]] = []
    unions: dict[str, list[str]] = {}
    for err in errors:
        loc, labelled = _without_union_label(root, list(err["loc"]))
        path, what, got = _problem(err, loc, root)
        if labelled and path in unions:
            unions[path].append(what.removeprefix("must be "))
            continue
        lines.append((path, [what], got))
        if labelled:
            unions[path] = lines[-1][1]
    return [_line(path, ", or ".join(whats), got) for path, whats, got in lines]


def _without_union_label(root: type[BaseModel], loc: list[Any]) -> tuple[list[Any], bool]:
    """``loc`` without the label pydantic appends after a union field for each alternative, and whether it had one."""
    section = _model_at(root, loc[:-2]) if len(loc) >= 2 else None
    field = _field(section, loc[-2]) if section is not None else None
    if field is None or not isinstance(loc[-1], str):
        return loc, False
    alternatives = [a for a in typing.get_args(field.annotation) if a is not type(None)]
    is_union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType) and len(alternatives) > 1
    return (loc[:-1], True) if is_union else (loc, False)


def _problem(err: dict[str, Any], loc: list[Any], root: type[BaseModel]) -> tuple[str, str, Any]:
    """(dotted path, what is wrong, the value given) of one pydantic error at ``loc``."""
    got, kind, ctx = err.get("input"), err["type"], err.get("ctx") or {}
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
    return _dotted(loc), what, got


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
