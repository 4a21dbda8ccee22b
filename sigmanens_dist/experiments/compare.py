"""``sigmanens compare``: one table and one set of plots from the runs in an MLflow store (sqlite or a server).

    sigmanens compare --parent RUN_ID --uri sqlite:///runs/study-m-scaling/mlflow.db [--out DIR] [--reference single]
    sigmanens compare --experiment sigmanens --uri http://127.0.0.1:5000

Runs are grouped by grid point (method, M, τ, λ, step budget) and summarised over seeds as mean ± std; the
difference to the reference method is paired by seed, with a 95% t interval, at equal epochs (the reference at the
same budget) or at equal training compute (``--pair compute``: the reference whose images × members through the
backbone are the same). Everything is read from what the trainer logs to MLflow: the params (the flattened config),
the test-set evaluation (``eval/test/raw/*``, from ``eval.at_end`` or ``sigmanens eval``) or the final ``val/*``
metrics, and the ``final/*`` extras. The table (Markdown and CSV, plus a CSV of every run) and the plots are logged
back to the study's parent run.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.figure import Figure
from scipy import stats

from sigmanens_dist.config import Config
from sigmanens_dist.experiments.study import DEFINITION, ROLE_TAG, method_table
from sigmanens_dist.training.tracking import PARENT_TAG

__all__ = ["CompareError", "Group", "RunRecord", "build_report", "group_runs", "load_runs", "main",
           "paired_difference", "select_split", "write_report"]

# table column -> the MLflow metric it is read from, per split: the loop's final validation, or the test-set
# evaluation of the trained (raw, not EMA) weights
SCORES = ("acc", "nll", "ece", "brier", "disagreement")
SPLIT_METRICS = {"val": {c: f"val/{c}" for c in SCORES} | {"sharing": "val/sharing/members_on"},
                 "test": {c: f"eval/test/raw/{c}" for c in SCORES} | {"sharing": "eval/test/raw/sharing/members_on"}}
SPLITS = ("auto", "test", "val")
PAIRINGS = {"epochs": "the same M, τ, λ (where both methods have them) and step budget: equal epochs",
            "compute": "the same training compute (images × members through the backbone) and τ, λ where both "
                       "methods have them: e.g. σN-Ens M=4 against the single model trained 4× the steps"}
DIFFS = ("acc", "nll", "ece", "brier", "ood_auroc", "ece_shift", "nll_shift")  # paired against the reference
# "under shift": the mean over corruptions and these severities (the strong end, where calibration breaks)
SHIFT_SEVERITIES = (3, 5)
# what `sigmanens eval` logs: eval/<split>/<weights>/shift/<corruption>/s<k>/{ece,nll} and
# .../ood_<set>/<score>/auroc
_SEVERITY = re.compile(r"^(eval/[^/]+/[^/]+)/shift/[^/]+/s(\d+)/(ece|nll)$")
_AUROC = re.compile(r"^(eval/[^/]+/[^/]+)/ood_[^/]+/entropy/auroc$")  # predictive entropy, the README's OOD score
_MS_PER_IMAGE = re.compile(r"^eval/test/raw/k(\d+)/ms_per_image$")  # forward time of the k-member ensemble


class CompareError(ValueError):
    """Nothing to compare: a store, experiment or run that does not exist, or no finished runs."""


@dataclass
class RunRecord:
    """One training run as the table needs it."""

    run_id: str
    name: str
    status: str
    method: str
    members: int
    tau: float | None
    lam: float | None
    seed: int
    budget: int = 1  # train.max_steps multiplier of a study's --budgets (1: the recipe's steps)
    variant: str = ""  # the method's own knobs away from their defaults, e.g. "α=3" (EnsembleMethod.knobs)
    values: dict[str, float] = field(default_factory=dict)  # table columns
    split_values: dict[str, dict[str, float]] = field(default_factory=dict)  # split -> score columns, as logged
    severity_ece: dict[int, float] = field(default_factory=dict)  # corruption severity -> ECE, if logged
    severity_nll: dict[int, float] = field(default_factory=dict)  # corruption severity -> NLL, if logged
    # σ runs: validation step -> (members on, histogram of σ(γ) over IMPORTANCE_BINS bins), read by load_runs
    sharing_history: dict[int, tuple[float, list[float]]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, int, float | None, float | None, int]:
        return self.method, self.variant, self.members, self.tau, self.lam, self.budget


@dataclass
class Group:
    """The runs of one grid point, one per seed."""

    method: str
    members: int
    tau: float | None
    lam: float | None
    budget: int
    runs: dict[int, RunRecord]
    variant: str = ""

    def values(self, column: str) -> np.ndarray:
        return np.array([r.values[column] for r in self.runs.values() if column in r.values], dtype=float)

    def mean(self, column: str) -> float:
        v = self.values(column)
        return float(v.mean()) if len(v) else math.nan

    def std(self, column: str) -> float:
        v = self.values(column)
        return float(v.std(ddof=1)) if len(v) > 1 else math.nan

    @property
    def name(self) -> str:
        """The method, with its variant if any: ``packed (α=3)``."""
        return f"{self.method} ({self.variant})" if self.variant else self.method

    def label(self) -> str:
        parts = [self.name] + ([f"M={self.members}"] if _uses(self.method, "members") else [])
        parts += [f"τ={self.tau:g}"] if self.tau is not None else []
        parts += [f"λ={self.lam:g}"] if self.lam is not None else []
        parts += [f"{self.budget}× steps"] if self.budget != 1 else []
        return " ".join(parts)


def _uses(method: str, axis: str) -> bool:
    spec = method_table().get(method)
    if spec is None:  # a method this version does not know: show every axis
        return True
    return spec.member_axis if axis == "members" else spec.regularized


# ---------------------------------------------------------------------------------------------------------------------
# Reading runs


def _client(uri: str) -> Any:
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise CompareError(f"--uri {uri}: no such sqlite file (a study's store is <study folder>/mlflow.db)")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient

    return MlflowClient(uri)


def load_runs(uri: str, *, parent: str | None = None, experiment: str | None = None
              ) -> tuple[list[RunRecord], list[str], str | None]:
    """The runs of a study (``parent``) or of an experiment; also the lines about children that are missing, failed or
    still running, and the parent run id to log the report to (None when there is no single parent)."""
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    expected: list[str] | None = None
    if parent is not None:
        try:
            parent_run = client.get_run(parent)
        except MlflowException as err:
            raise CompareError(f"--parent {parent}: no such run in {uri} ({err.error_code})") from err
        runs = client.search_runs([parent_run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{parent}'",
                                  max_results=50000)
        expected = _expected_children(client, parent)
        if not runs and not expected:
            raise CompareError(f"--parent {parent}: the run has no child runs in {uri}")
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = ", ".join(sorted(e.name for e in client.search_experiments())) or "none"
            raise CompareError(f"--experiment {experiment!r}: no such experiment in {uri} (it has: {names})")
        runs = [r for r in client.search_runs([exp.experiment_id], max_results=50000)
                if r.data.tags.get(ROLE_TAG) != "parent"]
        if not runs:
            raise CompareError(f"--experiment {experiment!r} in {uri} has no runs")
        parents = {r.data.tags.get(PARENT_TAG) for r in runs}
        parent = parents.pop() if len(parents) == 1 else None

    records, notes = _pick_runs(runs, expected)
    if not records:
        raise CompareError("no finished runs to compare yet:\n" + "\n".join(notes))
    for r in records:
        if r.tau is not None:
            r.sharing_history = _sharing_history(client, r.run_id)
    return records, notes, parent


def _sharing_history(client: Any, run_id: str) -> dict[int, tuple[float, list[float]]]:
    """Members on and the σ(γ) histogram at every validation step of a σ run (empty for runs that did not log the
    histogram). A step logged twice (a resumed run re-did it) keeps its newest value."""
    from sigmanens_dist.methods.sigma import IMPORTANCE_BINS

    def latest(key: str) -> dict[int, float]:
        return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}

    on = latest(SPLIT_METRICS["val"]["sharing"])
    bins = [latest(f"val/sharing/hist/{i}") for i in range(IMPORTANCE_BINS)]
    steps = sorted(set(on).intersection(*bins)) if bins[0] else []
    return {step: (on[step], [b[step] for b in bins]) for step in steps}


def _expected_children(client: Any, parent: str) -> list[str] | None:
    """Child names from the study definition logged to the parent run (None if it has none)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(parent, DEFINITION, tmp)
            definition = yaml.safe_load(Path(path).read_text())
        return [c["name"] for c in definition["children"]]
    except Exception:
        return None


def _pick_runs(runs: list[Any], expected: list[str] | None) -> tuple[list[RunRecord], list[str]]:
    """The newest FINISHED run of each grid point, variant and seed; a note for every expected child without one.
    (One child name can hold two variants: ``packed-M4-s0`` of a study at α = 2 and of another at α = 3.)"""
    by_name: dict[str, list[Any]] = defaultdict(list)
    for run in runs:
        by_name[run.info.run_name].append(run)
    records, notes = [], []
    names = list(expected) if expected is not None else []
    names += sorted(n for n in by_name if n not in names)
    for name in names:
        candidates = sorted(by_name.get(name, []), key=lambda r: r.info.start_time or 0)
        finished = [r for r in candidates if r.info.status == "FINISHED"]
        if finished:
            records.extend(_record(r) for r in finished)  # oldest first: the newest of a point wins below
        elif not candidates:
            notes.append(f"{name}: missing (not started)")
        else:
            status = candidates[-1].info.status
            what = {"RUNNING": "running (or killed without a chance to report)", "KILLED": "interrupted",
                    "FAILED": "failed", "SCHEDULED": "scheduled"}.get(status, status.lower())
            notes.append(f"{name}: {what} (run {candidates[-1].info.run_id})")
    # the same grid point and seed twice (two studies in one experiment): keep the newest
    unique: dict[tuple[Any, ...], RunRecord] = {}
    for r in records:
        if (r.key, r.seed) in unique:
            notes.append(f"{unique[(r.key, r.seed)].name}: replaced by the newer run {r.name} of the same grid point "
                         "and seed")
        unique[(r.key, r.seed)] = r
    return list(unique.values()), notes


def _record(run: Any) -> RunRecord:
    params, tags, metrics = run.data.params, run.data.tags, run.data.metrics
    method = (tags.get("sigmanens.method") or params.get("model.method") or tags.get("method")
              or ("sigma" if params.get("model.ensemble", "True") == "True" else "single"))  # runs before model.method
    members = int(tags.get("num_members") or params.get("model.num_members", 1))
    budget = int(tags.get("sigmanens.grid.budget") or 1)
    tau = _float(tags.get("sigmanens.grid.tau") or params.get("reg.tau")) if _uses(method, "reg") else None
    lam = _float(tags.get("sigmanens.grid.lambda") or params.get("reg.lambda")) if _uses(method, "reg") else None
    split_values = {split: {col: metrics[key] for col, key in names.items() if key in metrics}
                    for split, names in SPLIT_METRICS.items()}
    values = {"train_img_per_s": metrics["final/train_img_per_s"]} if "final/train_img_per_s" in metrics else {}
    timed = sorted((int(m.group(1)), v) for k, v in metrics.items() if (m := _MS_PER_IMAGE.match(k)))
    if timed:
        values["ms_per_image"] = timed[-1][1]  # the full ensemble's
    n_params = metrics.get("final/params", _float(tags.get("params")))
    if n_params is not None:
        values["params"] = n_params
    images = metrics.get("final/train_images")
    if images is None and "final/steps" in metrics:  # runs from before final/train_images: from the params
        images = metrics["final/steps"] * (int(params.get("train.batch_size", 0))
                                           * int(params.get("train.grad_accum", 1)) * int(tags.get("world_size") or 1))
    if images is not None:
        values["train_images"] = images
        values["train_compute"] = images * members  # images × members through the backbone
    values["inference_passes"] = float(members)  # backbone passes per predicted image
    def raw_first(key: str) -> tuple[bool, str]:  # the trained weights before their EMA
        return not key.endswith("/raw"), key

    auroc = sorted((k for k in metrics if _AUROC.match(k)), key=lambda k: raw_first(_AUROC.match(k).group(1)))
    if auroc:
        values["ood_auroc"] = metrics[auroc[0]]
    shifted = [(m.group(1), int(m.group(2)), m.group(3), v) for k, v in metrics.items() if (m := _SEVERITY.match(k))]
    first = min((prefix for prefix, _, _, _ in shifted), key=raw_first, default=None)
    by_severity: dict[str, dict[int, list[float]]] = {"ece": defaultdict(list), "nll": defaultdict(list)}
    for prefix, sev, score, v in shifted:
        if prefix == first:
            by_severity[score][sev].append(v)
    severity = {score: {sev: float(np.mean(vs)) for sev, vs in by.items()}  # mean over corruptions
                for score, by in by_severity.items()}
    for score, by in severity.items():
        if all(s in by for s in SHIFT_SEVERITIES):
            values[f"{score}_shift"] = float(np.mean([by[s] for s in SHIFT_SEVERITIES]))
    return RunRecord(run.info.run_id, run.info.run_name, run.info.status, method, members, tau, lam,
                     int(params.get("seed", 0)), budget, method_variant(method, params), values, split_values,
                     severity["ece"], severity["nll"])


def method_variant(method: str, params: dict[str, str]) -> str:
    """The method's knobs (``EnsembleMethod.knobs``) that the run set away from the config's defaults, as
    ``α=3 γ=2``."""
    spec = method_table().get(method)
    parts = []
    for key, short in (spec.knobs if spec else {}).items():
        text, default = params.get(key), _config_default(key)
        if key == "model.affine_init":  # saved as auto resolved: divide with a source, plain from scratch
            source = params.get("model.init_from") not in (None, "None") or params.get("model.pretrained") == "True"
            default = "divide" if source else "plain"
        if text is None:
            continue
        value = _float(text)
        if value is None:  # a word (member_batches=shared), or a word-valued default such as "num_members"
            if text != str(default):
                parts.append(f"{short}={text}")
        elif value != default:
            parts.append(f"{short}={value:g}")
    return " ".join(parts)


def _config_default(dotted: str) -> Any:
    node: Any = Config()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def select_split(records: list[RunRecord], split: str) -> str:
    """Put the chosen split's scores into every record's columns. ``auto``: the test set when every run has a
    test-set evaluation, else the validation split. Returns the split used."""
    if split not in SPLITS:
        raise CompareError(f"--split {split!r}: choose one of {', '.join(SPLITS)}")
    without_test = [r.name for r in records if "acc" not in r.split_values.get("test", {})]
    if split == "auto":
        split = "val" if without_test else "test"
    elif split == "test" and without_test:
        raise CompareError(f"--split test: {len(without_test)} run(s) have no test-set evaluation "
                           f"(eval.at_end: true, or `sigmanens eval`): {', '.join(without_test[:10])}"
                           f"{' …' if len(without_test) > 10 else ''}; use --split val")
    for r in records:
        r.values.update(r.split_values.get(split, {}))
    return split


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------------------------------
# Statistics


def group_runs(records: list[RunRecord]) -> list[Group]:
    groups: dict[tuple[Any, ...], Group] = {}
    for r in records:
        g = groups.setdefault(r.key, Group(r.method, r.members, r.tau, r.lam, r.budget, {}, r.variant))
        g.runs[r.seed] = r
    order = {m: i for i, m in enumerate(method_table())}

    def sort_key(g: Group) -> tuple[Any, ...]:
        return (order.get(g.method, len(order)), g.method, g.variant, g.budget, g.members,
                -1 if g.tau is None else g.tau, -1 if g.lam is None else g.lam)

    return sorted(groups.values(), key=sort_key)


def paired_difference(group: Group, ref: Group, column: str) -> tuple[float, float, float, int]:
    """Mean of (group − reference) over the seeds both have, and its 95% t interval; NaN interval below 2 pairs."""
    seeds = sorted(s for s in group.runs.keys() & ref.runs.keys()
                   if column in group.runs[s].values and column in ref.runs[s].values)
    d = np.array([group.runs[s].values[column] - ref.runs[s].values[column] for s in seeds], dtype=float)
    if len(d) == 0:
        return math.nan, math.nan, math.nan, 0
    if len(d) == 1:
        return float(d[0]), math.nan, math.nan, 1
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    return float(d.mean()), float(d.mean()) - half, float(d.mean()) + half, len(d)


def reference_for(group: Group, groups: list[Group], reference: str, pair: str = "epochs") -> Group | None:
    """The reference method's group to pair ``group`` with (``PAIRINGS``); None if not exactly one."""
    candidates = [g for g in groups if g.method == reference]
    axes = [("reg", "tau"), ("reg", "lam")] + ([("members", "members")] if pair == "epochs" else [])
    for axis, attr in axes:
        if _uses(reference, axis) and _uses(group.method, axis):
            candidates = [g for g in candidates if getattr(g, attr) == getattr(group, attr)]
    if pair == "epochs":
        candidates = [g for g in candidates if g.budget == group.budget]
    else:
        compute = group.mean("train_compute")
        candidates = [g for g in candidates if math.isclose(g.mean("train_compute"), compute, rel_tol=0.01)]
    return candidates[0] if len(candidates) == 1 else None


# ---------------------------------------------------------------------------------------------------------------------
# The report

COLUMNS = [("params", "params", "{:,.0f}"), ("train_compute", "train compute (img×M)", "{:.3g}"),
           ("inference_passes", "inference passes/img", "{:.0f}"), ("ms_per_image", "inference ms/img", "{:.3f}"),
           ("train_img_per_s", "train img/s", "{:.0f}"),
           ("acc", "acc", "{:.4f}"), ("nll", "NLL", "{:.4f}"), ("ece", "ECE", "{:.4f}"), ("brier", "Brier", "{:.4f}"),
           ("ood_auroc", "OOD AUROC", "{:.4f}"), ("ece_shift", "ECE shift s3,s5", "{:.4f}"),
           ("nll_shift", "NLL shift s3,s5", "{:.4f}"), ("disagreement", "disagreement", "{:.4f}"),
           ("sharing", "sharing (members on)", "{:.3f}")]


def build_report(records: list[RunRecord], reference: str | None, *, pair: str = "epochs", split: str = "auto"
                 ) -> _Report:
    """The grouped runs, their columns and the reference they pair with: what the files and the terminal show."""
    if pair not in PAIRINGS:
        raise CompareError(f"--pair {pair!r}: choose one of {', '.join(PAIRINGS)}")
    split = select_split(records, split)
    groups = group_runs(records)
    methods = [g.method for g in groups]
    if reference is None:
        reference = next((m for m in ("single", "sigma") if m in methods), methods[0])
    elif reference not in methods:
        raise CompareError(f"--reference {reference!r}: no finished runs of that method; methods here: "
                           f"{', '.join(dict.fromkeys(methods))}")
    columns = [c for c in COLUMNS if any(c[0] in r.values for r in records)]
    # with one method every group would pair with itself: no difference columns
    diffs = [c for c in DIFFS if any(c in r.values for r in records)] if len(set(methods)) > 1 else []
    return _Report(groups, columns, diffs, reference, pair, split)


def write_report(records: list[RunRecord], notes: list[str], out: Path, reference: str | None, *,
                 pair: str = "epochs", split: str = "auto") -> list[Path]:
    """``table.md``, ``table.csv``, ``runs.csv`` and the plots in ``out``; returns the files written."""
    report = build_report(records, reference, pair=pair, split=split)
    groups = report.groups
    out.mkdir(parents=True, exist_ok=True)
    files = [_markdown(report, notes, out / "table.md"), _csv(report, out / "table.csv"),
             _runs_csv(records, out / "runs.csv")]
    files += [p for p in (_plot_members(groups, out / "metric_vs_members.png"),
                          _plot_pareto(groups, out / "acc_vs_ece.png"),
                          _plot_cost(groups, out / "nll_vs_cost.png"),
                          _plot_severity(groups, out / "ece_vs_severity.png"),
                          _plot_sharing(groups, out / "sharing_vs_step.png")) if p is not None]
    return files


def _cell(group: Group, column: str, fmt: str) -> str:
    mean, std = group.mean(column), group.std(column)
    if math.isnan(mean):
        return ""
    return fmt.format(mean) + ("" if math.isnan(std) or std == 0 else " ± " + fmt.format(std))


@dataclass
class _Report:
    """What the table writers share."""

    groups: list[Group]
    columns: list[tuple[str, str, str]]
    diffs: list[str]
    reference: str
    pair: str
    split: str

    @property
    def budgets(self) -> bool:  # a step-budget column only where budgets vary
        return any(g.budget != 1 for g in self.groups)

    @property
    def selection_on_test(self) -> bool:  # enough configurations on test scores that choosing among them tunes
        return self.split == "test" and len(self.groups) > 2

    def reference_of(self, group: Group) -> Group | None:
        ref = reference_for(group, self.groups, self.reference, self.pair)
        return None if ref is group else ref

    def difference(self, group: Group, column: str) -> tuple[float, float, float, int] | None:
        """The paired difference against the group's reference (mean, 95% interval, pairs), or None where nothing
        pairs: what the file's table and the terminal summary both print, each in its own format."""
        ref = self.reference_of(group)
        if ref is None:
            return None
        diff = paired_difference(group, ref, column)
        return diff if diff[3] else None


def _diff_cell(report: _Report, group: Group, column: str) -> str:
    diff = report.difference(group, column)
    if diff is None:
        return ""
    mean, lo, hi, n = diff
    return f"{mean:+.4f}" + (f" [{lo:+.4f}, {hi:+.4f}]" if n > 1 else " (1 seed)")


def _axis_cells(g: Group) -> list[str]:
    """Method, M, τ, λ as the table shows them (an axis the method does not have is blank)."""
    return [g.name, str(g.members) if _uses(g.method, "members") else "1",
            "" if g.tau is None else f"{g.tau:g}", "" if g.lam is None else f"{g.lam:g}"]


def _markdown(report: _Report, notes: list[str], path: Path) -> Path:
    axes = ["method", "M", "τ", "λ", *(["steps"] if report.budgets else []), "seeds"]
    head = [*axes, *(c[1] for c in report.columns),
            *(f"Δ{d} vs {report.reference} [95% CI]" for d in report.diffs)]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * len(axes) + ["---:"] * (len(head) - len(axes))) + "|"]
    for g in report.groups:
        cells = [*_axis_cells(g), *([f"{g.budget}×"] if report.budgets else []), str(len(g.runs)),
                 *(_cell(g, c[0], c[2]) for c in report.columns),
                 *(_diff_cell(report, g, d) for d in report.diffs)]
        lines.append("| " + " | ".join(cells) + " |")
    where = ("the test set (the trained weights' `eval/test/raw/*`)" if report.split == "test" else
             "the validation split (the loop's final `val/*`)")
    text = "\n".join(lines) + f"\n\nScores on {where}; mean ± std over seeds. "
    if report.selection_on_test:
        text += (f"**Selection on the test set:** this table compares {len(report.groups)} configurations; a choice "
                 "among them read off it is tuned on the test set: choose with `--split val`, then read this table "
                 "once for the configurations chosen. ")
    text += (f"Δ: the paired difference (same seed) against {report.reference} at {PAIRINGS[report.pair]}, with the "
             "95% t interval; it excludes 0 when both ends have the same sign. " if report.diffs else
             "One method only: no paired differences (a study with `--methods sigma,single` has a reference). ")
    text += "Steps: the recipe's train.max_steps × this budget. " if report.budgets else ""
    text += ("Train compute: optimiser steps × global batch × M (images × members through the backbone); inference "
             "passes: backbone passes per predicted image.\n")
    if notes:
        text += "\nIncomplete:\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    path.write_text(text)
    return path


def _csv(report: _Report, path: Path) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "M", "tau", "lambda", "budget", "seeds", "split", "pair",
                    *(f"{c[0]}_{s}" for c in report.columns for s in ("mean", "std")),
                    *(f"diff_{d}_vs_{report.reference}_{s}" for d in report.diffs
                      for s in ("mean", "lo", "hi", "pairs"))])
        for g in report.groups:
            row: list[Any] = [*_axis_cells(g), g.budget, len(g.runs), report.split, report.pair]
            row += [v for c in report.columns for v in (g.mean(c[0]), g.std(c[0]))]
            ref = report.reference_of(g)
            for d in report.diffs:
                row += list(paired_difference(g, ref, d)) if ref is not None else ["", "", "", 0]
            w.writerow(["" if isinstance(v, float) and math.isnan(v) else v for v in row])
    return path


def _runs_csv(records: list[RunRecord], path: Path) -> Path:
    keys = sorted({k for r in records for k in r.values})
    severities = sorted({s for r in records for s in r.severity_ece})
    nll_severities = sorted({s for r in records for s in r.severity_nll})
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "name", "method", "M", "tau", "lambda", "budget", "seed", *keys,
                    *(f"ece_severity{s}" for s in severities),  # means over the corruptions evaluated
                    *(f"nll_severity{s}" for s in nll_severities)])
        for r in sorted(records, key=lambda r: r.name):
            w.writerow([r.run_id, r.name, r.method, r.members, r.tau, r.lam, r.budget, r.seed,
                        *(r.values.get(k, "") for k in keys), *(r.severity_ece.get(s, "") for s in severities),
                        *(r.severity_nll.get(s, "") for s in nll_severities)])
    return path


def _series(groups: list[Group]) -> dict[str, list[Group]]:
    """Groups per line in a plot: a method with its τ and λ."""
    lines: dict[str, list[Group]] = defaultdict(list)
    budgeted = {g.method for g in groups if g.budget != 1}
    for g in groups:
        extra = (f" τ={g.tau:g}" if g.tau is not None else "") + (f" λ={g.lam:g}" if g.lam is not None else "")
        if g.method in budgeted:
            extra += " (steps × budget)"  # the equal-compute line: budget b is drawn at M = b
        lines[g.name + extra].append(g)
    return lines


def _errorbar(ax: Any, xs: list[float], groups: list[Group], column: str, label: str, color: Any = None) -> None:
    ys = [g.mean(column) for g in groups]
    es = [0.0 if math.isnan(g.std(column)) else g.std(column) for g in groups]
    ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label, color=color)


def _colors(n: int) -> list[Any]:
    """``n`` distinct colours (matplotlib's default cycle repeats after 10 lines)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _plot_members(groups: list[Group], path: Path) -> Path | None:
    """Accuracy, NLL and ECE against M, one line per method (and τ, λ); needs two or more values of M."""
    if len({g.members * g.budget for g in groups}) < 2:
        return None
    series = _series(groups)
    fig = Figure(figsize=(17, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for (label, gs), color in zip(series.items(), _colors(len(series)), strict=True):
        gs = sorted(gs, key=lambda g: g.members * g.budget)
        for ax, column in zip(axes, ("acc", "nll", "ece"), strict=True):
            _errorbar(ax, [g.members * g.budget for g in gs], gs, column, label, color)
    for ax, title in zip(axes, ("accuracy", "NLL", "ECE"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("members M")
        ax.set_title(f"{title} vs M (mean ± std over seeds)")
        ax.grid(alpha=0.3)
    budgeted = any(g.budget != 1 for g in groups)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title="a single model at b× the steps\nis drawn at M = b (equal compute)" if budgeted else None,
               title_fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The Pareto frontier of (ECE, accuracy) points: those no other point beats on both, by increasing ECE."""
    frontier: list[tuple[float, float]] = []
    for ece, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if not frontier or acc > frontier[-1][1]:
            frontier.append((ece, acc))
    return frontier


def _plot_pareto(groups: list[Group], path: Path) -> Path | None:
    """The paper's figure: accuracy against ECE, and against ECE under shift (mean of severities 3 and 5) where the
    runs were evaluated on corruptions; one point per grid point, a σN-Ens point labelled with τ and its measured
    members on per feature; the Pareto frontier (no other point is both more accurate and better calibrated) drawn
    as a staircase through the points on it."""
    panels = [(c, t) for c, t in (("ece", "ECE"), ("ece_shift", "ECE under shift (mean of severities 3 and 5)"))
              if sum(not math.isnan(g.mean(c) + g.mean("acc")) for g in groups) >= 2]
    if not panels:
        return None
    fig = Figure(figsize=(7 * len(panels) + 2, 5.5), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels)))
    methods = list(dict.fromkeys(g.name for g in groups))
    colors = dict(zip(methods, _colors(len(methods)), strict=True))
    for ax, (column, title) in zip(axes, panels, strict=True):
        points = [(g.mean(column), g.mean("acc"), g) for g in groups if not math.isnan(g.mean(column) + g.mean("acc"))]
        for method in methods:
            mine = [p for p in points if p[2].name == method]
            if not mine:
                continue
            ax.scatter([p[0] for p in mine], [p[1] for p in mine], label=method, s=40, color=colors[method])
            for x, y, g in mine:
                label = " ".join(
                    ([f"τ={g.tau:g}"] if g.tau is not None else []) + ([f"λ={g.lam:g}"] if g.lam == 0 else [])
                    + ([f"M={g.members}"] if _uses(method, "members") and len({p[2].members for p in points}) > 1
                       else []) + ([f"{g.mean('sharing'):.2f} on"] if not math.isnan(g.mean("sharing")) else [])
                    + ([f"{g.budget}× steps"] if g.budget != 1 else []))
                ax.annotate(label, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        frontier = _frontier([(x, y) for x, y, _ in points])
        xs = [frontier[0][0], *(x for x, _ in frontier[1:] for _ in (0, 1))]
        ys = [y for _, y in frontier for _ in (0, 1)][: len(xs)]
        xmax = max(x for x, _, _ in points)
        ax.plot([*xs, xmax], [*ys, frontier[-1][1]], "k--", lw=1, label="Pareto frontier")
        ax.ticklabel_format(useOffset=False)
        ax.set_xlabel(f"{title} (lower is better)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"accuracy vs {title.split(' (')[0]}")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8,
               title="σN-Ens points: τ and\nmembers on per feature", title_fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _plot_sharing(groups: list[Group], path: Path) -> Path | None:
    """How τ sets the sharing during training: per σN-Ens grid point (its first seed), the histogram of the
    importances σ(γ) at every validation step as a heat map, with the members on per feature above it."""
    series = [(g, g.runs[min(g.runs)]) for g in groups if g.tau is not None and g.runs[min(g.runs)].sharing_history]
    if not series:
        return None
    from sigmanens_dist.methods.sigma import IMPORTANCE_BINS

    fig = Figure(figsize=(3.2 * len(series) + 1, 5.5), layout="constrained")
    axes = fig.subplots(2, len(series), squeeze=False, sharex="col", height_ratios=[1, 2.2])
    image = None
    for col, (g, run) in enumerate(series):
        steps = sorted(run.sharing_history)
        on = [run.sharing_history[s][0] for s in steps]
        hist = np.array([run.sharing_history[s][1] for s in steps]).T  # bins × steps
        axes[0, col].plot(steps, on, marker=".", color="k")
        axes[0, col].set_ylim(0, g.members + 0.3)
        axes[0, col].set_title(f"τ={g.tau:g} λ={g.lam:g} M={g.members}\n(seed {min(g.runs)})", fontsize=9)
        axes[0, col].grid(alpha=0.3)
        image = axes[1, col].imshow(hist, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1,
                                    extent=(steps[0], steps[-1], 0, 1), interpolation="nearest")
        axes[1, col].set_xlabel("step")
    axes[0, 0].set_ylabel("members on\nper feature")
    axes[1, 0].set_ylabel(f"σ(γ) ({IMPORTANCE_BINS} bins)")
    fig.colorbar(image, ax=axes[1, :].tolist(), label="fraction of member × feature importances")
    fig.suptitle("importance trajectories: σ(γ) over training, per τ")
    fig.savefig(path, dpi=110)
    return path


def _plot_cost(groups: list[Group], path: Path) -> Path | None:
    """NLL against parameter count and against training compute, one line per method (and τ, λ)."""
    if not any("params" in r.values or "train_compute" in r.values for g in groups for r in g.runs.values()):
        return None
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    for label, gs in _series(groups).items():
        for ax, column in zip(axes, ("params", "train_compute"), strict=True):
            mine = sorted((g for g in gs if not math.isnan(g.mean(column))), key=lambda g: g.mean(column))
            if mine:
                _errorbar(ax, [g.mean(column) for g in mine], mine, "nll", label)
    for ax, xlabel in zip(axes, ("parameters", "training compute (images × members through the backbone)"),
                          strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("NLL")
        ax.grid(alpha=0.3)
    axes[0].set_title("NLL vs parameters")
    axes[1].set_title("NLL vs training compute")
    with_lines = [ax for ax in axes if ax.get_legend_handles_labels()[0]]  # runs may lack one of the two columns
    if with_lines:
        with_lines[0].legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def _plot_severity(groups: list[Group], path: Path) -> Path | None:
    """ECE against corruption severity per grid point, when the runs logged per-severity ECE metrics."""
    if not any(r.severity_ece for g in groups for r in g.runs.values()):
        return None
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.subplots()
    for g in groups:
        sev = sorted({s for r in g.runs.values() for s in r.severity_ece})
        if sev:
            means = [float(np.mean([r.severity_ece[s] for r in g.runs.values() if s in r.severity_ece])) for s in sev]
            ax.plot(sev, means, marker="o", label=g.label())
    ax.set_xlabel("corruption severity")
    ax.set_ylabel("ECE")
    ax.set_title("ECE vs corruption severity (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--experiment", help="every run of this MLflow experiment (study parents excluded)")
    which.add_argument("--parent", help="the child runs of this study parent run")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                    help="tracking URI, sqlite:///path/mlflow.db or http://host:port (default $MLFLOW_TRACKING_URI)")
    ap.add_argument("--out", type=Path, help="where the table and plots go (default runs/compare-<parent|experiment>)")
    ap.add_argument("--reference", help="the method differences are paired against (default single, else sigma)")
    ap.add_argument("--pair", choices=list(PAIRINGS), default="epochs",
                    help="; ".join(f"{k}: {v}" for k, v in PAIRINGS.items()))
    ap.add_argument("--split", choices=list(SPLITS), default="auto",
                    help="scores from the test-set evaluation or the validation split (auto: test when every run "
                         "has it)")
    args = ap.parse_args(argv)
    if not args.uri:
        print("error: give --uri (e.g. sqlite:///runs/study-m-scaling/mlflow.db) or set MLFLOW_TRACKING_URI",
              file=sys.stderr)
        return 2
    out = args.out or Path("runs") / f"compare-{args.parent or args.experiment}"
    try:
        records, notes, parent = load_runs(args.uri, parent=args.parent, experiment=args.experiment)
        files = write_report(records, notes, out, args.reference, pair=args.pair, split=args.split)
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from sigmanens_dist.experiments import terminal  # the table for a person; the files keep every column

    print(terminal.render(build_report(records, args.reference, pair=args.pair, split=args.split), notes))
    print()
    print(terminal.written(out, files))
    if parent is not None:
        try:
            _client(args.uri).log_artifacts(parent, str(out), "compare")
            print(f"logged to the parent run {parent} under compare/")
        except Exception as err:  # the report is on disk; a store that refuses artifacts only loses the copy
            print(f"warning: could not log the report to the parent run {parent}: {err}", file=sys.stderr)
    print(terminal.ui_lines(args.uri, _client(args.uri).get_run(records[0].run_id).info.experiment_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
