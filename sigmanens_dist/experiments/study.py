"""``sigmanens study``: a grid of training runs (M-scaling, τ or λ sweep, methods) as one MLflow parent run with one
child run per grid point, resumable, and defined by one file that a Slurm job array can submit unchanged.

    sigmanens study m-scaling --config configs/demo.yaml --members 1,2,4,8 --seeds 0,1,2 --out runs/m_scaling
    sigmanens study run-one --definition runs/m_scaling/study.yaml --index 3     (one child: a Slurm array element)
    sigmanens study resume runs/m_scaling          (continue it as defined, even after its recipe file was edited)

Every grid point is checked with the trainer's own config validation before anything is written or launched. Each
child runs through the normal trainer (``python -m sigmanens_dist.train``, under torchrun with ``--nproc`` > 1) in
``<out>/<child name>``; running the same command again skips finished children and resumes interrupted ones from
their newest checkpoint.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml

from sigmanens_dist.atomic import write_text
from sigmanens_dist.config import Config, ConfigError, ModelConfig, RegConfig, load_config, recipe_path
from sigmanens_dist.progress import shell_command, wrap
from sigmanens_dist.training.preemption import EXIT_PREEMPTED, MARKER
from sigmanens_dist.training.tracking import PARENT_TAG, default_tracking_uri, ensure_experiment

__all__ = ["KINDS", "LAMBDA_POLICIES", "METHOD_NAMES", "Child", "StudyError", "build_definition", "child_state",
           "main", "method_table", "run_one"]

log = logging.getLogger("sigmanens.study")

DEFINITION = "study.yaml"
BASE_CONFIG = "base_config.yaml"
ROLE_TAG, STUDY_TAG, CHILD_TAG = "sigmanens.role", "sigmanens.study", "sigmanens.child"


METHOD_NAMES = get_args(ModelConfig.model_fields["method"].annotation)  # the config's, without torch


def method_table() -> dict[str, Any]:
    """The method table (methods/): imported on first use, since it imports torch, which `sigmanens study --help`
    does not need (tests/test_cli_startup.py)."""
    from sigmanens_dist.methods import METHODS

    return METHODS


def __getattr__(name: str) -> Any:
    if name == "METHODS":  # re-exported: the table once lived here
        return method_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StudyError(ValueError):
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


@dataclass
class Child:
    """One grid point: its name (also its run directory and MLflow run name) and the trainer overrides."""

    index: int
    name: str
    point: dict[str, Any]
    overrides: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------------
# Defining a study


def build_definition(kind: str, config: Path | None, axes: dict[str, list[Any] | None], overrides: Sequence[str],
                     out: Path, *, nproc: int = 1, lambda_policy: str = "fixed",
                     max_backbone_batch: int | None = None) -> dict[str, Any]:
    """The study definition (a plain mapping, written as YAML): grid, base config, overrides and every child with
    its trainer overrides. Raises :class:`StudyError` listing every bad grid value and every child config the
    trainer would refuse, before anything is written."""
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
    return {
        "kind": kind,
        "name": out.name,
        "out": str(out),
        "base_config": BASE_CONFIG if config is not None else None,
        "overrides": list(overrides),
        "nproc": nproc,
        "lambda_policy": lambda_policy,
        "lambda_policy_text": LAMBDA_POLICIES[lambda_policy],
        "reg_normalize": normalize,
        "max_backbone_batch": max_backbone_batch,
        "global_batch": base.train.batch_size * base.train.grad_accum * nproc,
        "axes": grid,
        "tracking": {"uri": uri, "experiment": base.tracking.experiment, "parent_run_id": None},
        "children": [{"index": c.index, "name": c.name, "point": c.point, "overrides": c.overrides} for c in children],
    }


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
        log.warning("λ = 0 in the grid: at that point L_div is off and τ=%s has no effect (the unregularised "
                    "reference)", ",".join(map(str, grid["taus"])))
    if grid["budgets"] != [1] and base.train.max_steps is None:
        problems.append(f"--budgets {','.join(map(str, grid['budgets']))}: multiplies train.max_steps, which the base "
                        f"config does not set (it trains train.epochs={base.train.epochs}); give train.max_steps=N")
    return grid


def _children(grid: dict[str, list[Any]], base: Config, policy: str, max_backbone_batch: int | None, nproc: int,
              out: Path, uri: str | None) -> list[Child]:
    """The product of the axes, with axes that do not apply to a method collapsed, in a stable order."""
    children: list[Child] = []
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
        children.append(Child(len(children), name, point, [f"{k}={_yaml_value(v)}" for k, v in ov.items()]))
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


def _validate_children(config: Path | None, overrides: Sequence[str], children: list[Child]) -> None:
    """Every child's config through the trainer's own validation; all problems of all children in one error."""
    problems = []
    for child in children:
        try:
            load_config(config, [*overrides, *child.overrides])
        except ConfigError as err:
            problems.append(f"  {child.name}:\n" + "\n".join(f"  {p}" for p in err.problems))
    if problems:
        raise StudyError("grid points the trainer would refuse:\n" + "\n".join(problems))


# ---------------------------------------------------------------------------------------------------------------------
# The definition file and the parent run


def write_definition(definition: dict[str, Any], config: Path | None) -> Path:
    """Write ``<out>/study.yaml`` (and a copy of the base config beside it), or check that the one already there
    describes the same study; returns its path. A different study in the same folder is an error."""
    out = Path(definition["out"])
    path = out / DEFINITION
    base_copy = out / BASE_CONFIG
    config = recipe_path(config) if config is not None else None
    if path.is_file():
        old = yaml.safe_load(path.read_text())
        differs = [k for k in ("kind", "overrides", "nproc", "lambda_policy", "max_backbone_batch", "axes")
                   if old.get(k) != definition[k]]
        if [c["overrides"] for c in old["children"]] != [c["overrides"] for c in definition["children"]]:
            differs.append("children")
        if config is not None and (not base_copy.is_file() or base_copy.read_bytes() != config.read_bytes()):
            differs.append(f"base config ({config} differs from the copy in {base_copy})")
        if differs:
            raise StudyError(f"{path} defines a different study (differs in: {', '.join(differs)}); continue it as "
                             f"defined with `sigmanens study resume {out}`, or start this one with another --out")
        return path
    out.mkdir(parents=True, exist_ok=True)
    if config is not None:
        shutil.copyfile(config, base_copy)
    _save(path, definition)
    return path


def load_definition(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StudyError(f"--definition {path}: no such file (write it with `sigmanens study <kind> ... --prepare`)")
    definition = yaml.safe_load(path.read_text())
    if not isinstance(definition, dict) or "children" not in definition:
        raise StudyError(f"{path} is not a study definition (no 'children')")
    return definition


def _save(path: Path, definition: dict[str, Any]) -> None:
    write_text(path, "# written by `sigmanens study`; a Slurm array runs element I with\n"
               f"#   sigmanens study run-one --definition {path} --index $SLURM_ARRAY_TASK_ID\n"
               + yaml.safe_dump(definition, sort_keys=False, width=120))


def ensure_parent(definition: dict[str, Any], path: Path) -> str | None:
    """Create the parent run once (its id is stored in the definition file, which every child reads), log the grid
    to it, and mark it running. An unreachable store is a warning: the children still train and track locally."""
    tracking = definition["tracking"]
    if tracking["uri"] is None:
        return None
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking["uri"])
        if tracking["parent_run_id"] is None:
            exp_id = ensure_experiment(client, tracking["experiment"], tracking["uri"])
            run = client.create_run(exp_id, run_name=definition["name"],
                                    tags={ROLE_TAG: "parent", STUDY_TAG: definition["name"],
                                          "sigmanens.kind": definition["kind"]})
            tracking["parent_run_id"] = run.info.run_id
            _save(path, definition)
            client.log_batch(run.info.run_id, params=_parent_params(definition))
            client.log_artifact(run.info.run_id, str(path))
        else:
            client.update_run(tracking["parent_run_id"], status="RUNNING")
        return tracking["parent_run_id"]
    except Exception as err:  # an unreachable server must not stop the study; its children track locally
        log.warning("MLflow parent run at %s failed (%s: %s); the children run without one", tracking["uri"],
                    type(err).__name__, str(err).splitlines()[0][:200])
        return tracking["parent_run_id"]


def _parent_params(definition: dict[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    params = {"study.kind": definition["kind"], "study.children": len(definition["children"]),
              "study.base_config": definition["base_config"], "study.overrides": " ".join(definition["overrides"]),
              "study.nproc": definition["nproc"], "study.lambda_policy": definition["lambda_policy"],
              "study.lambda_policy_text": definition["lambda_policy_text"],
              "study.global_batch": definition["global_batch"],
              "study.max_backbone_batch": definition["max_backbone_batch"]}
    if definition["reg_normalize"] is not None:
        params["study.reg_normalize"] = definition["reg_normalize"]
    params.update({f"study.grid.{axis}": ",".join(map(str, values)) for axis, values in definition["axes"].items()})
    return [Param(k, str(v)[:500]) for k, v in params.items()]


def _finish_parent(definition: dict[str, Any], status: str) -> None:
    run_id = definition["tracking"]["parent_run_id"]
    if run_id is None:
        return
    try:
        from mlflow import MlflowClient

        MlflowClient(definition["tracking"]["uri"]).set_terminated(run_id, status=status)
    except Exception as err:
        log.warning("could not mark the parent run %s %s (%s)", run_id, status, err)


# ---------------------------------------------------------------------------------------------------------------------
# Running children


def child_state(definition: dict[str, Any], child: dict[str, Any], finished_in_mlflow: set[str]) -> str:
    """``finished`` (skip), ``resume`` (it has checkpoints) or ``start``."""
    run_dir = Path(definition["out"]) / child["name"]
    if (run_dir / "final_metrics.json").is_file() or child["name"] in finished_in_mlflow:
        return "finished"
    if any((run_dir / "checkpoints").glob("step_*.pt")):
        return "resume"
    return "start"


def _finished_in_mlflow(definition: dict[str, Any]) -> set[str]:
    """Children whose MLflow run is FINISHED (a child trained on another node leaves no final_metrics.json here)."""
    run_id, uri = definition["tracking"]["parent_run_id"], definition["tracking"]["uri"]
    if run_id is None:
        return set()
    try:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        exp_id = client.get_run(run_id).info.experiment_id
        runs = client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and "
                                                          "attributes.status = 'FINISHED'", max_results=50000)
        return {r.info.run_name for r in runs}
    except Exception as err:
        log.warning("cannot read finished children from %s (%s); relying on final_metrics.json", uri, err)
        return set()


def trainer_args(definition: dict[str, Any], child: dict[str, Any], def_path: Path) -> list[str]:
    """The trainer's arguments for ``child`` (after ``-m sigmanens_dist.train``): what any launcher runs."""
    config = ["--config", str(def_path.parent / definition["base_config"])] if definition["base_config"] else []
    parent = definition["tracking"]["parent_run_id"]
    return [*config, *definition["overrides"], *child["overrides"],
            *([f"tracking.parent_run_id={parent}"] if parent else []), "checkpoint.resume=auto"]


def _command(definition: dict[str, Any], child: dict[str, Any], def_path: Path) -> list[str]:
    nproc = definition["nproc"]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
                if nproc > 1 else [sys.executable, "-m"])
    return [*launcher, "sigmanens_dist.train", *trainer_args(definition, child, def_path)]


def run_one(def_path: Path, index: int, *, print_args: bool = False) -> int:
    """Run child ``index`` of the study (skip it if finished, resume it if interrupted); the trainer's exit status.
    With ``print_args`` only print the trainer's arguments, one per line, for a launcher of one's own (a multi-node
    Slurm element: slurm/m_scaling.sh)."""
    definition = load_definition(def_path)
    children = definition["children"]
    if not 0 <= index < len(children):
        raise StudyError(f"--index {index}: the study has children 0..{len(children) - 1}")
    if print_args:
        print("\n".join(trainer_args(definition, children[index], def_path)))
        return 0
    return _run_child(definition, children[index], def_path, _finished_in_mlflow(definition))


def _run_child(definition: dict[str, Any], child: dict[str, Any], def_path: Path, finished: set[str]) -> int:
    state = child_state(definition, child, finished)
    total = len(definition["children"])
    if state == "finished":
        print(f"[{child['index'] + 1}/{total}] {child['name']}: finished, skipped", flush=True)
        return 0
    cmd = _command(definition, child, def_path)
    print(f"[{child['index'] + 1}/{total}] {child['name']}: {'resuming' if state == 'resume' else 'starting'}\n"
          + shell_command(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        """A preemption signal sent to this process (not only to the child) must reach the trainer, and must not
        kill this process before the trainer has checkpointed. torchrun passes SIGTERM on to its workers."""
        received.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if definition["nproc"] > 1 else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _tag_child(definition, child)
    # torchrun rewrites a worker's exit status; the trainer's marker says "checkpointed after a signal"
    if received or (Path(definition["out"]) / child["name"] / MARKER).is_file():
        return EXIT_PREEMPTED
    return status


def _tag_child(definition: dict[str, Any], child: dict[str, Any]) -> None:
    """Name the grid point in the child's MLflow tags (nominal λ included, whatever the λ(M) policy made of it)."""
    run_id, uri = definition["tracking"]["parent_run_id"], definition["tracking"]["uri"]
    if run_id is None:
        return
    try:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        exp_id = client.get_run(run_id).info.experiment_id
        runs = client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and "
                                                          f"attributes.run_name = '{child['name']}'")
        point = child["point"]
        tags = {STUDY_TAG: definition["name"], CHILD_TAG: str(child["index"]), "sigmanens.method": point["method"],
                "sigmanens.lambda_policy": definition["lambda_policy"],
                **{f"sigmanens.grid.{k}": str(v) for k, v in point.items() if v is not None and k != "method"}}
        for run in runs:
            for key, value in tags.items():
                client.set_tag(run.info.run_id, key, value)
    except Exception as err:  # the tags are a convenience: compare reads the same values from the params
        log.warning("could not tag %s's MLflow run (%s)", child["name"], err)


def run_study(definition: dict[str, Any], def_path: Path) -> int:
    """Every child in order. A preempted child stops the study (exit 75, to requeue); a failed one is reported and
    the others still run; exit 1 if any failed."""
    ensure_parent(definition, def_path)
    finished = _finished_in_mlflow(definition)
    failed = []
    for child in definition["children"]:
        status = _run_child(definition, child, def_path, finished)
        if status == EXIT_PREEMPTED:
            _finish_parent(definition, "KILLED")
            print(f"{child['name']} was preempted; run the same command again to continue the study", flush=True)
            return EXIT_PREEMPTED
        if status != 0:
            failed.append(f"{child['name']} (exit {status})")
    _finish_parent(definition, "FAILED" if failed else "FINISHED")
    if failed:
        print("failed children: " + ", ".join(failed), file=sys.stderr)
        return 1
    tracking = definition["tracking"]
    print(f"study {definition['name']}: all {len(definition['children'])} children finished"
          + ("; compare them with\n" + shell_command(["sigmanens", "compare", "--parent", tracking["parent_run_id"],
                                                      "--uri", tracking["uri"]], prompt="  ")
             if tracking["parent_run_id"] else ""))
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def _list(kind_of: type) -> Any:
    def parse(text: str) -> list[Any]:
        values = []
        for part in text.split(","):
            part = part.strip()
            if kind_of is str:
                values.append(part)
                continue
            try:
                values.append(float(part) if kind_of is float else int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not {'a number' if kind_of is float else 'an integer'}"
                                                 ) from None
        return values

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s study] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if argv and argv[0] == "resume":
        ap = argparse.ArgumentParser(prog="sigmanens study resume", description="continue a study from its saved "
                                     "definition (the base config copied beside it, not the recipe as it is now): "
                                     "finished children are skipped, interrupted ones resume")
        ap.add_argument("study", type=Path, help=f"the study folder, or its {DEFINITION}")
        args = ap.parse_args(argv[1:])
        path = args.study / DEFINITION if args.study.is_dir() else args.study
        try:
            definition = load_definition(path)
        except StudyError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"study {definition['name']}: resuming {len(definition['children'])} children from {path}", flush=True)
        return run_study(definition, path)
    if argv and argv[0] == "run-one":
        ap = argparse.ArgumentParser(prog="sigmanens study run-one", description="run one child of a study "
                                     "(a Slurm array element): skip it if finished, resume it if interrupted")
        ap.add_argument("--definition", type=Path, required=True, help=f"the study's {DEFINITION}")
        ap.add_argument("--index", type=int, required=True, help="the child's index (0-based)")
        ap.add_argument("--print-args", action="store_true",
                        help="print the trainer's arguments (one per line) instead of running it")
        args = ap.parse_args(argv[1:])
        try:
            return run_one(args.definition, args.index, print_args=args.print_args)
        except StudyError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    ap = argparse.ArgumentParser(prog="sigmanens study", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=list(KINDS), help="what the study sweeps by default")
    ap.add_argument("--config", type=Path, help="the base YAML recipe every child starts from")
    ap.add_argument("--members", type=_list(int), help="M values, e.g. 1,2,4,8,16")
    ap.add_argument("--taus", type=_list(float), help="τ values, e.g. 0.1,0.25,0.5,1")
    ap.add_argument("--lambdas", type=_list(float), help="λ values (nominal; see --lambda-policy)")
    ap.add_argument("--methods", type=_list(str), help=f"methods, of {', '.join(METHOD_NAMES)}")
    ap.add_argument("--budgets", type=_list(int),
                    help="training-step multipliers (train.max_steps × b), e.g. 1,2,4,8: a single model at b=M has "
                         "the training compute of an M-member ensemble at b=1 (default 1)")
    ap.add_argument("--seeds", type=_list(int), help="seeds (default 0,1,2); the same seeds pair runs across methods")
    ap.add_argument("--nproc", type=int, default=1, help="processes per child (torchrun when > 1)")
    ap.add_argument("--lambda-policy", default="fixed", choices=list(LAMBDA_POLICIES),
                    help="; ".join(f"{k}: {v}" for k, v in LAMBDA_POLICIES.items()))
    ap.add_argument("--max-backbone-batch", type=int,
                    help="most images (batch × M) in one backbone pass; larger ones use more accumulation steps")
    ap.add_argument("--out", type=Path, help="the study folder (default runs/study-<kind>)")
    ap.add_argument("--prepare", action="store_true",
                    help="write the definition and the parent run only (for a Slurm array to run the children)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every child, e.g. train.max_steps=500")
    args = ap.parse_intermixed_args(argv)
    out = args.out or Path("runs") / f"study-{args.kind}"
    try:
        definition = build_definition(args.kind, args.config, {a: getattr(args, a) for a in AXES}, args.overrides,
                                      out, nproc=args.nproc, lambda_policy=args.lambda_policy,
                                      max_backbone_batch=args.max_backbone_batch)
        path = write_definition(definition, args.config)
        definition = load_definition(path)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(wrap(f"study {definition['name']}: {len(definition['children'])} children, definition {path}") + "\n"
          + wrap(f"λ policy: {definition['lambda_policy_text']}; global batch {definition['global_batch']} at every M"),
          flush=True)
    if args.prepare:
        ensure_parent(definition, path)
        print(f"prepared; a Slurm array of {len(definition['children'])} elements runs it with\n"
              f"  sigmanens study run-one --definition {path} --index $SLURM_ARRAY_TASK_ID")
        return 0
    return run_study(definition, path)


if __name__ == "__main__":
    sys.exit(main())
