"""Reading runs from an MLflow store (sqlite or a server) into :class:`RunRecord` s: the flattened config's params,
the test-set or validation scores, the shift and OOD extras, σN-Ens's sharing history; :class:`Group` (a grid point's
runs over seeds) and the metric names compare reads."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

import numpy as np
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic_core import ErrorDetails

from sigmanens_dist.atomic import write_text
from sigmanens_dist.config import Config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.experiments.study import DEFINITION, ROLE_TAG, method_table, read_definition
from sigmanens_dist.training.tracking import PARENT_TAG, check_server

__all__ = ["RECORDS_FILE", "CompareError", "Group", "RunRecord", "load_runs", "method_variant", "mlflow_client",
           "read_records", "save_records", "select_split"]

# table column -> the MLflow metric it is read from, per split: the loop's final validation, or the test-set
# evaluation of the trained (raw, not EMA) weights
SCORES = ("acc", "nll", "ece", "brier", "disagreement")
SPLIT_METRICS = {"val": {c: f"val/{c}" for c in SCORES} | {"sharing": "val/sharing/members_on"},
                 "test": {c: f"eval/test/raw/{c}" for c in SCORES} | {"sharing": "eval/test/raw/sharing/members_on"}}
SPLITS = ("auto", "test", "val")
PAIRINGS = {"epochs": "the same M, τ, λ (where both methods have them) and step budget: equal epochs",
            "compute": "the same training compute (images × members through the backbone) and τ, λ where both "
                       "methods have them: e.g. σN-Ens M=4 against the single model trained 4× the steps",
            "members": "the next smaller M (the same method, variant, τ, λ and step budget): what the last step "
                       "up in M bought (an M-scaling study's question: does it still improve, or saturate?)"}
PAIRED_AT = {"epochs": "at equal epochs", "compute": "at equal training compute",  # PAIRINGS, in short
             "members": "at the next smaller M"}
DIFFS = ("acc", "nll", "ece", "brier", "ood_auroc", "ece_shift", "nll_shift")  # paired against the reference
# "under shift": the mean over corruptions and these severities (the strong end, where calibration breaks)
SHIFT_SEVERITIES = (3, 5)
# what `sigmanens eval` logs: eval/<split>/<weights>/shift/<corruption>/s<k>/{ece,nll} and
# .../ood_<set>/<score>/auroc
_SEVERITY = re.compile(r"^(eval/[^/]+/[^/]+)/shift/[^/]+/s(\d+)/(ece|nll)$")
_AUROC = re.compile(r"^(eval/[^/]+/[^/]+)/ood_[^/]+/entropy/auroc$")  # predictive entropy, the README's OOD score
_MS_PER_IMAGE = re.compile(r"^eval/test/raw/k(\d+)/ms_per_image$")  # forward time of the k-member ensemble
RECORDS_FILE = "records.jsonl"  # every compared run as the table reads it, beside the table (read by --records)


class CompareError(UsageError):
    """Nothing to compare: a store, experiment or run that does not exist, no finished runs, a records file that is
    not one."""


# What a record read from a file may hold (read_records checks every field): the type, its limits, and the limits in
# words for the one-line refusal. The bounds are far beyond any run; a value past them is a damaged or hand-made file.
MAX_MEMBERS = 4096
MAX_BUDGET = 1000
MAX_SEED = 2**63 - 1  # an int64, what torch and MLflow keep
_Text = Annotated[str, Field(min_length=1, description="a non-empty string")]
_Members = Annotated[int, Field(ge=1, le=MAX_MEMBERS, description=f"an integer from 1 to {MAX_MEMBERS}")]
_Tau = Annotated[float | None, Field(gt=0, allow_inf_nan=False, description="null or a finite number > 0")]
_Lam = Annotated[float | None, Field(ge=0, allow_inf_nan=False, description="null or a finite number >= 0")]
_Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="an integer from 0 to 2**63 - 1")]
_Budget = Annotated[int, Field(ge=1, le=MAX_BUDGET, description=f"an integer from 1 to {MAX_BUDGET}")]
_Variant = Annotated[str, Field(description="a string")]
_Values = Annotated[dict[str, float], Field(description="a mapping of column name to number")]
_SplitValues = Annotated[dict[Literal["val", "test"], dict[str, float]],
                         Field(description="a mapping of split (val, test) to a mapping of column name to number")]
_Severity = Annotated[dict[Annotated[int, Field(ge=1)], float],
                      Field(description="a mapping of corruption severity (an integer >= 1) to number")]
_Sharing = Annotated[dict[Annotated[int, Field(ge=0)], tuple[float, list[float]]],
                     Field(description="a mapping of validation step (an integer >= 0) to [members on, [histogram]]")]


@with_config(ConfigDict(strict=True, extra="forbid"))  # "3" is no integer, true no M: a file holds what we wrote
@dataclass
class RunRecord:
    """One training run as the table needs it."""

    run_id: _Text
    name: _Text
    status: _Text
    method: _Text
    members: _Members
    tau: _Tau
    lam: _Lam
    seed: _Seed
    budget: _Budget = 1  # train.max_steps multiplier of a study's --budgets (1: the recipe's steps)
    variant: _Variant = ""  # the method's own knobs away from their defaults, e.g. "α=3" (EnsembleMethod.knobs)
    values: _Values = field(default_factory=dict)  # table columns
    split_values: _SplitValues = field(default_factory=dict)  # split -> score columns, as logged
    severity_ece: _Severity = field(default_factory=dict)  # corruption severity -> ECE, if logged
    severity_nll: _Severity = field(default_factory=dict)  # corruption severity -> NLL, if logged
    # σ runs: validation step -> (members on, histogram of σ(γ) over IMPORTANCE_BINS bins), read by load_runs
    sharing_history: _Sharing = field(default_factory=dict)

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

    @property
    def display(self) -> str:
        """The method by the name people know it (plots, terminal), with its variant: ``Packed-Ensembles (α=3)``."""
        from sigmanens_dist.methods import display_name  # methods import torch: only a report needs it

        return display_name(self.method) + (f" ({self.variant})" if self.variant else "")

    def label(self) -> str:
        """The configuration in words: ``σN-Ens M=4 τ=0.5 λ=0.01``."""
        parts = [self.display] + ([f"M={self.members}"] if _uses(self.method, "members") else [])
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


def mlflow_client(uri: str) -> Any:
    """An ``MlflowClient`` for ``uri`` that fails fast: a missing sqlite file is a :class:`CompareError`, a server
    that does not answer one :class:`~sigmanens_dist.errors.UnavailableError` line."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise CompareError(f"--uri {uri}: no such sqlite file (a study's store is <study folder>/mlflow.db)")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    check_server(uri)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient  # optional extra: mlflow

    return MlflowClient(uri)


def load_runs(uri: str, *, parent: str | None = None, experiment: str | None = None
              ) -> tuple[list[RunRecord], list[str], str | None]:
    """The runs of a study (``parent``) or of an experiment; also the lines about children that are missing, failed or
    still running, and the parent run id to log the report to (None when there is no single parent)."""
    from mlflow.exceptions import MlflowException  # optional extra: mlflow

    client = mlflow_client(uri)
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
    from sigmanens_dist.methods.sigma import IMPORTANCE_BINS  # methods import torch: only a report needs it

    def latest(key: str) -> dict[int, float]:
        return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}

    on = latest(SPLIT_METRICS["val"]["sharing"])
    bins = [latest(f"val/sharing/hist/{i}") for i in range(IMPORTANCE_BINS)]
    steps = sorted(set(on).intersection(*bins)) if bins[0] else []
    return {step: (on[step], [b[step] for b in bins]) for step in steps}


def _expected_children(client: Any, parent: str) -> list[str] | None:
    """Child names from the study definition logged to the parent run (None if it has none: a parent run not made by
    ``sigmanens study``). A definition this version cannot read (a later version) is refused in one line, as by
    ``study resume``: its children are not guessed."""
    names = [a.path for a in client.list_artifacts(parent)]
    if DEFINITION not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(client.download_artifacts(parent, DEFINITION, tmp)).read_text()
    definition = read_definition(Path(f"the {DEFINITION} logged to run {parent}"), text)
    return [c.name for c in definition.children]


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
    return _newest_per_point(records, notes), notes


def _newest_per_point(records: list[RunRecord], notes: list[str]) -> list[RunRecord]:
    """One run per grid point and seed, the last given (the newest) winning, with a note for each one replaced (two
    studies in one experiment, or two records files holding the same point)."""
    unique: dict[tuple[Any, ...], RunRecord] = {}
    for r in records:
        if (r.key, r.seed) in unique:
            notes.append(f"{unique[(r.key, r.seed)].name}: replaced by the newer run {r.name} of the same grid point "
                         "and seed")
        unique[(r.key, r.seed)] = r
    return list(unique.values())


# ---------------------------------------------------------------------------------------------------------------------
# Records files: the runs without their store


def save_records(records: list[RunRecord], path: Path) -> Path:
    """One JSON line per run, everything the table and plots read. A store need not outlive its machine (a scratch
    disk, a cluster left behind): runs saved this way are compared later, with runs from other stores, by
    ``sigmanens compare --records``. The score columns are left out: :func:`select_split` derives them from
    ``split_values`` for the split asked for."""
    derived = {col for names in SPLIT_METRICS.values() for col in names}
    lines = []
    for r in records:
        row = asdict(r)
        row["values"] = {k: v for k, v in r.values.items() if k not in derived}
        lines.append(json.dumps(row, sort_keys=True))
    return write_text(path, "".join(f"{line}\n" for line in lines))


def read_records(paths: Sequence[Path]) -> tuple[list[RunRecord], list[str]]:
    """The runs of records files written by :func:`save_records`, in order (a grid point and seed given twice: the
    later one counts, with a note)."""
    records = []
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as err:
            raise CompareError(f"--records {path}: cannot read it ({err.strerror}); a records file is the "
                               f"{RECORDS_FILE} that sigmanens compare writes beside its table") from err
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(_RECORD.validate_json(line))
            except ValidationError as err:
                raise CompareError(f"--records {path}, line {number}: not a run record: {_problems(err.errors())}") \
                    from None
    if not records:
        raise CompareError(f"--records {' '.join(map(str, paths))}: no runs in them")
    notes: list[str] = []
    return _newest_per_point(records, notes), notes


_RECORD = TypeAdapter(RunRecord)
# field -> what it may hold, in words: the description of its type
_ALLOWED = {name: hint.__metadata__[0].description
            for name, hint in get_type_hints(RunRecord, include_extras=True).items()}


def _problems(errors: list[ErrorDetails]) -> str:
    """A record's refusals in one line, each ``field: must be <what is allowed> (got <value>)`` in the words of the
    field's type, so a bad record among thousands is found and fixed from the message alone."""
    missing = [str(e["loc"][0]) for e in errors if e["type"] == "missing"]
    problems = [f"missing fields: {', '.join(missing)}"] if missing else []
    for err in errors:
        loc, kind, got = err["loc"], err["type"], repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        if not loc:  # the line as a whole
            what = (f"the line is not JSON ({err['msg'].removeprefix('Invalid JSON: ')})" if kind == "json_invalid"
                    else f"the line must be a JSON object (got {got})")
            problems.append(f"{what}; a records file is the {RECORDS_FILE} that sigmanens compare writes")
        elif kind == "unexpected_keyword_argument":
            problems.append(f"{loc[0]}: unknown field (a record has: {', '.join(_ALLOWED)})")
        elif kind != "missing":
            where = str(loc[0]) + "".join(f"[{part!r}]" for part in loc[1:] if part != "[key]")
            problems.append(f"{where}: must be {_ALLOWED[str(loc[0])]} (got {got})")
    return "; ".join(problems)


def _record(run: Any) -> RunRecord:
    params, tags, metrics = run.data.params, run.data.tags, run.data.metrics
    method = tags.get("sigmanens.method") or params.get("model.method") or tags.get("method") or "sigma"
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
