"""A study's grid: the kinds (M-scaling, τ or λ sweep, methods) and their default axes, the grid points as child
runs with their trainer overrides, each checked by the trainer's own config validation before anything is written."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import yaml

from sigmanens_dist.config import Config, ConfigError, ModelConfig, RegConfig, load_config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.experiments.study.definition import ChildSpec, StudyDefinition, StudyTracking
from sigmanens_dist.training.tracking import default_tracking_uri

log = logging.getLogger("sigmanens.study")

__all__ = ["AXES", "BASE_CONFIG", "CHILD_TAG", "DEFINITION", "KINDS", "LAMBDA_POLICIES", "METHOD_NAMES", "ROLE_TAG",
           "STUDY_TAG", "StudyError", "build_definition", "method_table"]

DEFINITION = "study.yaml"
BASE_CONFIG = "base_config.yaml"
ROLE_TAG, STUDY_TAG, CHILD_TAG = "sigmanens.role", "sigmanens.study", "sigmanens.child"


METHOD_NAMES = get_args(ModelConfig.model_fields["method"].annotation)  # the config's, without torch


def method_table() -> dict[str, Any]:
    """The method table (methods/): imported on first use, since it imports torch, which `sigmanens study --help`
    does not need (tests/cli/test_cli_startup.py)."""
    from sigmanens_dist.methods import METHODS  # methods import torch: `study --help` answers without it

    return METHODS


class StudyError(UsageError):
    """A study that cannot start: every problem found, one line each."""


# What each kind sweeps by default; any axis can also be given explicitly (then it is part of the grid too).
KINDS: dict[str, dict[str, list[Any]]] = {
    "m-scaling": {"members": [1, 2, 4, 8, 16]},
    "tau-sweep": {"taus": [0.05, 0.1, 0.25, 0.5, 1.0, 2.0]},
    "lambda-sweep": {"lambdas": [1e-4, 1e-3, 1e-2, 1e-1]},
    "methods": {"methods": []},  # filled with every method the installed config supports
}
# L_div sums over members, so at a fixed λ its weight against the (member-averaged) task loss grows with M.
LAMBDA_POLICIES = {
    "fixed": "reg.lambda is the same at every M (L_div sums over members, so its weight grows in proportion to M)",
    "per-member": "reg.lambda = λ / M (L_div's weight per member stays constant as M grows)",
}
# τ acts only through L_div: a τ sweep on a recipe with λ = 0 runs at this documented strength (the default λ,
# README "Long budget") unless --lambdas says otherwise.
TAU_SWEEP_LAMBDA = 0.01
AXES = ("methods", "members", "taus", "lambdas", "budgets", "seeds")


# ---------------------------------------------------------------------------------------------------------------------
# Defining a study


def build_definition(kind: str, config: Path | None, axes: dict[str, list[Any] | None], overrides: Sequence[str],
                     out: Path, *, nproc: int = 1, lambda_policy: str = "fixed",
                     max_backbone_batch: int | None = None) -> StudyDefinition:
    """The study definition: grid, base config, overrides and every child with its trainer overrides. Raises
    :class:`StudyError` listing every bad grid value and every child config the trainer would refuse, before
    anything is written."""
    problems: list[str] = []
    if kind not in KINDS:
        raise StudyError(f"unknown study kind {kind!r}; choose one of: {', '.join(KINDS)}")
    if lambda_policy not in LAMBDA_POLICIES:
        problems.append(f"--lambda-policy {lambda_policy!r} is not one of: {', '.join(LAMBDA_POLICIES)}")
    if nproc < 1:
        problems.append(f"--nproc {nproc} must be at least 1")
    if max_backbone_batch is not None and max_backbone_batch < 1:
        problems.append(f"--max-backbone-batch {max_backbone_batch} must be at least 1")
    # Loaded as the first method given, so a knob of that method (model.packed_alpha=3 for a Packed-only study) is
    # valid here; each child is validated with its own method below.
    first = (axes.get("methods") or [None])[0]
    selected = [f"model.method={first}"] if first in method_table() else []
    try:
        base = load_config(config, [*selected, *overrides])
    except ConfigError as err:
        raise StudyError(f"the base config does not load:\n{err}") from err

    grid = _grid_axes(kind, axes, base, problems)
    swept = {_AXIS_KEYS[a] for a, values in axes.items() if values is not None and a in _AXIS_KEYS}
    swept |= {_AXIS_KEYS[a] for a in KINDS[kind] if a in _AXIS_KEYS}
    for text in overrides:
        key = text.partition("=")[0].strip()
        if key in swept or (key == "reg.lam" and "reg.lambda" in swept) or key in _OWNED:
            problems.append(f"override {text!r}: {key} is set by the study (its grid or bookkeeping); drop it")
    if problems:
        raise StudyError("the study grid is invalid:\n" + "\n".join(f"  - {p}" for p in problems))

    out = out.resolve()
    uri = default_tracking_uri(out / "child", base.tracking.uri) if base.tracking.enabled else None
    children = _children(grid, base, lambda_policy, max_backbone_batch, nproc, out, uri)
    _validate_children(config, overrides, children)
    normalize = getattr(base.reg, "normalize", None) if "normalize" in RegConfig.model_fields else None
    return StudyDefinition(
        kind=kind, name=out.name, out=str(out), base_config=BASE_CONFIG if config is not None else None,
        overrides=list(overrides), nproc=nproc, lambda_policy=lambda_policy,
        lambda_policy_text=LAMBDA_POLICIES[lambda_policy], reg_normalize=normalize,
        max_backbone_batch=max_backbone_batch, global_batch=base.train.batch_size * base.train.grad_accum * nproc,
        axes=grid, tracking=StudyTracking(uri=uri, experiment=base.tracking.experiment), children=children)


_AXIS_KEYS = {"members": "model.num_members", "taus": "reg.tau", "lambdas": "reg.lambda"}
_OWNED = {"run_dir", "seed", "tracking.parent_run_id", "tracking.run_name", "checkpoint.resume",
          "model.method"}


def _grid_axes(kind: str, axes: dict[str, list[Any] | None], base: Config, problems: list[str]) -> dict[str, list]:
    """Each axis: given values, else the kind's default sweep, else the base config's single value; checked."""
    known = list(method_table())
    defaults: dict[str, list[Any]] = {"methods": [base.model.method],
                                      "members": [base.model.num_members], "taus": [base.reg.tau],
                                      "lambdas": [base.reg.lam], "budgets": [1], "seeds": [0, 1, 2]}
    kind_defaults = {**KINDS[kind], **({"methods": known} if kind == "methods" else {})}
    if kind == "tau-sweep" and axes.get("lambdas") is None and base.reg.lam == 0:
        log.info("the recipe has reg.lambda=0, which leaves τ inert: the τ sweep runs at λ=%g (docs/quality.md); "
                 "--lambdas sets another", TAU_SWEEP_LAMBDA)
        kind_defaults["lambdas"] = [TAU_SWEEP_LAMBDA]
    grid: dict[str, list[Any]] = {}
    for axis in AXES:
        values = axes.get(axis)
        values = list(values) if values is not None else list(kind_defaults.get(axis, defaults[axis]))
        if not values:
            problems.append(f"--{axis}: no values given")
        if len(set(map(str, values))) != len(values):
            problems.append(f"--{axis}: a value is given twice ({', '.join(map(str, values))})")
        grid[axis] = values
    for m in grid["methods"]:
        if m not in method_table():
            problems.append(f"--methods: unknown method {m!r}; available: {', '.join(known)}")
    checks = {"members": (int, lambda v: v >= 1, "a whole number >= 1"), "seeds": (int, lambda v: v >= 0,
              "a whole number >= 0"), "taus": (float, lambda v: v > 0, "a number > 0"),
              "lambdas": (float, lambda v: v >= 0, "a number >= 0"),
              "budgets": (int, lambda v: v >= 1, "a whole number >= 1")}
    for axis, (kind_of, ok, what) in checks.items():
        for v in grid[axis]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind_of is int and not float(v).is_integer())\
                    or not ok(v) or v != v or v in (float("inf"), float("-inf")):
                problems.append(f"--{axis}: {v!r} is not {what}")
        if all(isinstance(v, (int, float)) for v in grid[axis]):
            grid[axis] = [kind_of(v) for v in grid[axis]]
    regularized = any(method_table()[m].regularized for m in grid["methods"] if m in method_table())
    if regularized and len(grid["taus"]) > 1 and 0 in grid["lambdas"]:
        problems.append(f"--taus {','.join(map(str, grid['taus']))} with λ = 0: L_div is off, so τ changes nothing "
                        "(every τ trains the same model); give --lambdas 0.01, the documented τ-sweep strength "
                        "(docs/quality.md)")
    elif regularized and 0 in grid["lambdas"]:
        log.warning("λ = 0 in the grid: at that point L_div is off and τ=%s has no effect (the unregularized "
                    "reference)", ",".join(map(str, grid["taus"])))
    if grid["budgets"] != [1] and base.train.max_steps is None:
        problems.append(f"--budgets {','.join(map(str, grid['budgets']))}: multiplies train.max_steps, which the base "
                        f"config does not set (it trains train.epochs={base.train.epochs}); give train.max_steps=N")
    return grid


def _children(grid: dict[str, list[Any]], base: Config, policy: str, max_backbone_batch: int | None, nproc: int,
              out: Path, uri: str | None) -> list[ChildSpec]:
    """The product of the axes, with axes that do not apply to a method collapsed, in a stable order."""
    children: list[ChildSpec] = []
    seen: set[str] = set()
    for method, m, tau, lam, budget, seed in itertools.product(*(grid[a] for a in AXES)):
        spec = method_table()[method]
        point: dict[str, Any] = {"method": method, "members": m if spec.member_axis else 1,
                                 "tau": tau if spec.regularized else None,
                                 "lambda": lam if spec.regularized else None, "budget": budget, "seed": seed}
        name = _child_name(point)
        if name in seen:
            continue
        seen.add(name)
        ov: dict[str, Any] = {"model.method": method, "seed": seed}
        if spec.member_axis:
            ov["model.num_members"] = m
        if spec.regularized:
            ov["reg.tau"] = tau
            ov["reg.lambda"] = lam / m if policy == "per-member" else lam
        if budget != 1:
            ov["train.max_steps"] = base.train.max_steps * budget
        ov.update(_micro_batching(base, point["members"], max_backbone_batch, name))
        ov.update({"run_dir": str(out / name), "tracking.run_name": name})
        if uri is not None:
            ov["tracking.uri"] = uri
        children.append(ChildSpec(index=len(children), name=name, point=point,
                                  overrides=[f"{k}={_yaml_value(v)}" for k, v in ov.items()]))
    return children


def _micro_batching(base: Config, members: int, limit: int | None, name: str) -> dict[str, int]:
    """The global batch stays fixed at every M; when ``batch × M`` images would exceed ``limit`` in one pass through
    the backbone, the batch is split into more accumulation steps (the smallest split that fits)."""
    if limit is None or base.train.batch_size * members <= limit:
        return {}
    batch = base.train.batch_size
    for split in range(2, batch + 1):
        if batch % split == 0 and batch // split * members <= limit:
            return {"train.batch_size": batch // split, "train.grad_accum": base.train.grad_accum * split}
    raise StudyError(f"{name}: even one image per member ({members} images) exceeds --max-backbone-batch {limit}")


def _child_name(point: dict[str, Any]) -> str:
    parts = [point["method"]]
    if method_table()[point["method"]].member_axis:
        parts.append(f"M{point['members']}")
    if point["tau"] is not None:
        parts.append(f"tau{point['tau']:g}")
    if point["lambda"] is not None:
        parts.append(f"lam{point['lambda']:g}")
    if point.get("budget", 1) != 1:  # definitions written before the budget axis have none
        parts.append(f"x{point['budget']}")
    parts.append(f"s{point['seed']}")
    return "-".join(parts)


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _validate_children(config: Path | None, overrides: Sequence[str], children: list[ChildSpec]) -> None:
    """Every child's config through the trainer's own validation; all problems of all children in one error."""
    problems = []
    for child in children:
        try:
            load_config(config, [*overrides, *child.overrides])
        except ConfigError as err:
            problems.append(f"  {child.name}:\n" + "\n".join(f"  {p}" for p in err.problems))
    if problems:
        raise StudyError("grid points the trainer would refuse:\n" + "\n".join(problems))
