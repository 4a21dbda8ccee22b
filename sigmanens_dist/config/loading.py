"""Reading a config: a YAML recipe (a path, or a packaged recipe by name) plus ``dotted.key=value`` overrides,
validated against the schema with every problem reported at once; saving it back, and flattening it for MLflow."""

from __future__ import annotations

import copy
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from sigmanens_dist.atomic import check_writable_folder, write_text
from sigmanens_dist.catalog.datasets import DATASETS, converted_classes_file, convertible, resolve_root
from sigmanens_dist.config.messages import (
    ConfigError,
    _did_you_mean,
    _from_pydantic,
    _keys_of,
    _line,
    _model_at,
    _problem,
)
from sigmanens_dist.config.schema import Config, DataConfig
from sigmanens_dist.errors import UsageError
from sigmanens_dist.storage.remote import RemotePath

__all__ = ["RECIPES", "check_paths", "check_run_paths", "config_from_dict", "flatten", "from_options", "load_config",
           "recipe_path", "recipes", "save_config"]

_S = TypeVar("_S", bound=BaseModel)


_REPLACES = {"train.max_steps": "train.epochs", "train.epochs": "train.max_steps"}


_FILE = "(file)"  # the path shown for problems with the file as a whole


class _Loader(yaml.SafeLoader):
    """safe_load, plus: ``1e-3`` is a float (YAML 1.1 wants ``1.0e-3``), dates stay strings (a run name like
    2024-05-01 must not become a date), and a key given twice is recorded instead of the first one silently losing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                self.duplicates.append(_line(key, f"key given twice, on lines {seen[key]} and {line}", key))
            elif isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _parse_yaml(text: str) -> tuple[Any, list[str]]:
    loader = _Loader(text)
    try:
        return loader.get_single_data(), loader.duplicates
    finally:
        loader.dispose()


def _recipes_dir() -> Path:
    """Where the recipes are: inside the package in an installed wheel (pyproject's force-include copies them there),
    else the checkout's top-level ``configs/`` (a source tree or an editable install: the one copy)."""
    package = Path(__file__).resolve().parent.parent  # sigmanens_dist/
    shipped = package / "configs"
    return shipped if shipped.is_dir() else package.parent / "configs"


RECIPES = _recipes_dir()


def recipe_path(path: str | Path) -> Path:
    """``path`` itself when it exists or names a folder; else the packaged recipe of that name (``demo`` or
    ``demo.yaml``), so ``--config NAME`` works after a plain ``pip install``."""
    p = Path(path)
    if p.exists() or p.parent != Path("."):
        return p
    packaged = RECIPES / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
    return packaged if packaged.is_file() else p


def recipes() -> list[str]:
    """The names of the packaged recipes."""
    return sorted(q.stem for q in RECIPES.glob("*.yaml"))


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, check_data: bool = True) -> Config:
    """The config in the YAML file ``path`` (None: the defaults) with ``dotted.key=value`` ``overrides`` applied.

    Override values are YAML (``8``, ``0.25``, ``true``, ``null``, ``[a, b]``); a dotted key may reach into a
    dict field (``model.kwargs.img_size=32``). With ``check_data`` the data root must exist unless the data is
    synthetic. Raises one :class:`ConfigError` listing every problem found.
    """
    path = recipe_path(path) if path is not None else None
    source = str(path) if path is not None else "<defaults>"
    problems: list[str] = []
    raw = _read_file(path, problems) if path is not None else {}
    if raw is None:  # the file itself is unusable: validating the rest would only add misleading lines
        _apply_overrides({}, overrides, problems)
        raise ConfigError(source, problems)
    return _validated(raw, overrides, source, problems, check_data)


def config_from_dict(raw: dict[str, Any], overrides: Sequence[str] = (), *, source: str,
                     check_data: bool = True) -> Config:
    """A config saved as a dict (a checkpoint's), through the same validation as :func:`load_config`; ``source``
    names where it came from in the error."""
    return _validated(_as_it_ran(copy.deepcopy(raw), source), overrides, source, [], check_data)


def from_options(section: type[_S], typed: Mapping[str, str] | None = None, **values: Any) -> _S:
    """``section(**values)``: a command's options checked by the config section's own validators, so that each rule
    is written once for the config file and the command line. A refusal is one :class:`UsageError` line in the
    command's words: a field is its option ``--field-name``, shown with its value as ``typed`` holds it (else as
    given), and every ``eval.field`` a message names becomes ``--field-name`` (``eval.field=v``: ``--field-name v``).
    A section-level message starts with the value it refuses, so it follows the option directly."""
    try:
        return section(**values)
    except ValidationError as err:
        key = next(name for name, field in Config.model_fields.items() if field.annotation is section)

        def option(match: re.Match[str]) -> str:
            return f"--{match[1].replace('_', '-')}{' ' if match[2] else ''}"

        lines = []
        for problem in err.errors(include_url=False):
            loc = list(problem["loc"])
            _, what, got = _problem(problem, loc, section)  # a section-level problem's loc gains its field
            field = str(loc[0])
            what = re.sub(rf"\b{key}\.(\w+)(=?)", option, what)
            shown = "" if problem["type"] == "config_field" else f" {(typed or {}).get(field, got)}:"
            lines.append(f"--{field.replace('_', '-')}{shown} {what}")
        raise UsageError("; ".join(lines)) from None


def _as_it_ran(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A run saved before ``train.randaugment`` was refused for datasets whose readers never applied it trained
    without it: read as null, saying so in one warning, so its checkpoint still evaluates and exports (neither command
    takes a ``train.`` override)."""
    train, data = raw.get("train"), raw.get("data", {})
    if isinstance(train, dict) and train.get("randaugment") and isinstance(data, dict):
        dataset = data.get("dataset", DataConfig.model_fields["dataset"].default)
        if dataset in DATASETS and not DATASETS[dataset].randaugment:
            warnings.warn(f"{source}: train.randaugment={train['randaugment']!r} was never applied to "
                          f"data.dataset={dataset!r} (its readers ignored it); read as null, as the run trained",
                          UserWarning, stacklevel=3)
            train["randaugment"] = None
    return raw


def _validated(raw: dict[str, Any], overrides: Sequence[str], source: str, problems: list[str],
               check_data: bool) -> Config:
    _apply_overrides(raw, overrides, problems)
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        problems.extend(_from_pydantic(err.errors(include_url=False), Config))
    if check_data:
        data = cfg.data if cfg is not None else _valid_or_none(DataConfig, raw.get("data", {}))
        if data is not None:
            problems.extend(_data_problems(data))
    if problems:
        raise ConfigError(source, problems)
    assert cfg is not None  # for the type checker: a failed validation left a problem, raised above
    return cfg


def check_paths(cfg: Config, source: str = "<config>") -> None:
    """Raise :class:`ConfigError` if the data root is unset or missing (synthetic data needs none)."""
    problems = _data_problems(cfg.data)
    if problems:
        raise ConfigError(source, problems)


def check_run_paths(cfg: Config) -> None:
    """What a run needs of the file system and the data server beyond what validation reads, checked as the trainer
    finds it but writing nothing: a run directory that can be made and written, and converted data's ``classes.json``
    (a URL root: one HEAD). ``sigmanens train --check`` and the run itself call it before anything is built, so a
    config that --check passes is not refused for these later. Raises a :class:`~sigmanens_dist.errors.UsageError`
    (a data server that does not answer: :class:`~sigmanens_dist.errors.UnavailableError`)."""
    check_writable_folder(Path(cfg.run_dir), "run_dir=")
    data = cfg.data
    if data.format != "raw" and data.dataset in convertible():
        root = resolve_root(data.dataset, data.root)
        converted_classes_file(data.format, root if isinstance(root, RemotePath) else Path(root))


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write ``cfg`` fully resolved (every default spelt out) as YAML, atomically: a reader or a crash mid-write
    never sees half a file. :func:`load_config` on the result gives back an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False, default_flow_style=False)
    return write_text(path, text)


def flatten(cfg: Config) -> dict[str, Any]:
    """``{"model.num_members": 4, "reg.lambda": 0.001, ...}``: scalars under dotted keys, for MLflow params.
    Lists and empty dicts become JSON strings; dict fields such as ``model.kwargs`` are flattened too."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        elif isinstance(value, (dict, list)):
            out[prefix] = json.dumps(value)
        else:
            out[prefix] = value

    walk("", cfg.model_dump(mode="json", by_alias=True))
    return out


def _read_file(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The file's mapping with null sections as ``{}``; None (and a problem) if it cannot be used at all."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        problems.append(_line(_FILE, f"cannot read the config file: {err.strerror or err} (a path, or a packaged "
                                     f"recipe: {', '.join(recipes())})", str(path)))
        return None
    try:
        raw, duplicates = _parse_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problems.append(_line(_FILE, f"not valid YAML: {getattr(err, 'problem', None) or err}{where}", str(path)))
        return None
    problems.extend(duplicates)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.append(_line(_FILE, "the top level must be a mapping of sections (model:, train:, ...)", raw))
        return None
    for key in _SECTIONS:
        if key in raw and raw[key] is None:
            raw[key] = {}
    return raw


def _apply_overrides(raw: dict[str, Any], overrides: Sequence[str], problems: list[str]) -> None:
    top = _keys_of(Config)
    given: dict[str, Any] = {}
    for text in overrides:
        key, sep, value_text = text.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not all(parts):
            problems.append(_line(key or text, "an override must look like dotted.key=value", text))
            continue
        if parts[0] not in top:
            problems.append(_line(key, f"unknown top-level key {parts[0]!r}{_did_you_mean(parts[0], top)}; known: "
                                       f"{', '.join(sorted(Config.model_fields))}", text))
            continue
        try:
            value, _ = _parse_yaml(value_text)
        except yaml.YAMLError as err:
            problems.append(_line(key, f"the value is not valid YAML ({getattr(err, 'problem', None) or err})",
                                  value_text))
            continue
        node = raw
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                problems.append(_line(key, f"{'.'.join(parts[:depth + 1])} is not a mapping, so it has no key "
                                           f"{parts[depth + 1]!r}", text))
                break
            node = child
        else:
            for twin in _twins(parts):  # `reg.lambda=` over a recipe's `lam:` replaces it, not a both-given error
                node.pop(twin, None)
            node[parts[-1]] = value
            given[key] = value
    for key, value in given.items():
        other = _REPLACES.get(key)
        if value is not None and other is not None and other not in given:
            section, field = other.split(".")
            raw.setdefault(section, {})[field] = None


_SECTIONS = [n for n, f in Config.model_fields.items() if issubclass(f.annotation, BaseModel)]


def _twins(parts: Sequence[str]) -> list[str]:
    """The other spellings (name or alias) of the field at ``parts``."""
    model = _model_at(Config, parts[:-1])
    if model is None:
        return []
    for name, field in model.model_fields.items():
        spellings = {name, field.alias} - {None}
        if parts[-1] in spellings:
            return sorted(spellings - {parts[-1]})
    return []


def _valid_or_none(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError:
        return None


def _data_problems(data: DataConfig) -> list[str]:
    spec = DATASETS[data.dataset]
    if spec.kind == "synthetic":
        return []
    root, hint = resolve_root(data.dataset, data.root), spec.hint
    if root is None:
        return [_line("data.root", f"must be set for data.dataset={data.dataset!r}; {hint}", None)]
    if not isinstance(root, RemotePath) and not root.exists():  # a URL: its loader reads the manifest first
        default = f" (the default for {data.dataset})" if data.root is None else ""
        return [_line("data.root", f"{root}{default} does not exist; {hint}", data.root)]
    return []
