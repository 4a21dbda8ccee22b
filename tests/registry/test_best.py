"""``sigmanens_dist.registry.best`` without MLflow or an export: the choice of the best child (parse_by, _best) and
register_best's calls, made to fakes that record them (tests/registry/test_registry.py runs it against a server)."""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sigmanens_dist.errors import UsageError
from sigmanens_dist.experiments.compare import RunRecord
from sigmanens_dist.registry import best as best_module
from sigmanens_dist.registry.best import BY, _best, parse_by, register_best
from sigmanens_dist.registry.register import TAG_PREFIX

CHOICES = "val/nll, val/acc, val/ece, val/brier"
URI = "http://tracking.example:5000"


def record(name: str, val: dict[str, float] | None = None, test: dict[str, float] | None = None) -> RunRecord:
    """A finished child with the given validation (and test) score columns; none given: no split logged."""
    split_values: dict[str, dict[str, float]] = {}
    if val is not None:
        split_values["val"] = val
    if test is not None:
        split_values["test"] = test
    return RunRecord(run_id=f"id-{name}", name=name, status="FINISHED", method="sigma", members=2, tau=0.25, lam=0.0,
                     seed=0, split_values=split_values)


def refusal(call: Any, *args: Any) -> str:
    """The message of the UsageError (exactly that type) that ``call(*args)`` raises."""
    with pytest.raises(UsageError) as caught:
        call(*args)
    assert type(caught.value) is UsageError
    return str(caught.value)


# ---------------------------------------------------------------------------------------------------------- parse_by

def test_by_holds_the_four_validation_metrics_and_their_directions() -> None:
    """BY: accuracy higher is better, NLL, ECE and Brier lower, in this order."""
    assert BY == {"val/nll": False, "val/acc": True, "val/ece": False, "val/brier": False}


@pytest.mark.parametrize("by", list(BY))
def test_parse_by_accepts_every_validation_metric(by: str) -> None:
    """Each key of BY is returned as given."""
    assert parse_by(by) == by


@pytest.mark.parametrize("text", ["test/nll", "val/test", "eval/test/raw/nll", "test"])
def test_parse_by_refuses_a_test_metric(text: str) -> None:
    """A metric with a ``test`` part is refused: the best child is chosen on validation only."""
    assert refusal(parse_by, text) == (f"--by {text}: a test-set metric; the best child is chosen on validation only "
                                       f"(a test score that chose the model no longer measures it): choose {CHOICES}")


@pytest.mark.parametrize("text", ["val/loss", "nll", "", "val/latest", "testing/nll", "val/nll "])
def test_parse_by_refuses_anything_else(text: str) -> None:
    """Any other text is refused, quoted, with the choices."""
    assert refusal(parse_by, text) == f"--by {text!r}: choose one of {CHOICES} (validation metrics)"


# ------------------------------------------------------------------------------------------------------------- _best

# per metric: three distinct values and which of them is best; the other metrics rank the children the other way
DIRECTIONS = {"val/nll": ([0.9, 0.4, 0.6], 0.4), "val/acc": ([0.6, 0.8, 0.7], 0.8),
              "val/ece": ([0.05, 0.2, 0.01], 0.01), "val/brier": ([0.3, 0.5, 0.2], 0.2)}


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
@pytest.mark.parametrize("by", list(DIRECTIONS))
def test_best_follows_the_metric_direction(by: str, order: tuple[int, ...], capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    """NLL, ECE and Brier: the lowest wins, accuracy: the highest, in every order; other columns and the test split
    (which would choose otherwise) are not read."""
    values, winner = DIRECTIONS[by]
    column = by.removeprefix("val/")
    children = []
    for i in order:
        decoys = {other.removeprefix("val/"): 1.0 - values[i] for other in BY if other != by}
        children.append(record(f"c{i}", val={column: values[i], **decoys}, test={column: -values[i]}))
    best, value, among = _best(children, by)
    assert (best.name, value, among) == (f"c{values.index(winner)}", winner, 3)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("by", list(BY))
def test_best_keeps_the_first_of_a_tie(by: str) -> None:
    """Two children tied on the best value: the first given wins."""
    column = by.removeprefix("val/")
    good, bad = (0.9, 0.1) if BY[by] else (0.1, 0.9)
    children = [record("bad", val={column: bad}), record("first", val={column: good}),
                record("second", val={column: good})]
    assert _best(children, by)[0].name == "first"
    assert _best(children[::-1], by)[0].name == "second"


def test_best_ignores_children_without_the_metric() -> None:
    """Children without a validation split, or without this column, are no candidates and not counted."""
    children = [record("none"), record("other", val={"acc": 0.9}), record("test-only", test={"nll": 0.01}),
                record("worse", val={"nll": 0.9}), record("best", val={"nll": 0.4})]
    best, value, among = _best(children, "val/nll")
    assert (best.name, value, among) == ("best", 0.4, 2)


VALUES = {"diverged": math.nan, "worse": 0.6, "exploded": math.inf, "sunk": -math.inf, "best": 0.3, "none": None}


@pytest.mark.parametrize("by, expected", [("val/nll", 0.3), ("val/acc", 0.6)])
@pytest.mark.parametrize("order", list(itertools.permutations(VALUES))[::37])
def test_best_skips_non_finite_values_and_names_them(by: str, expected: float, order: tuple[str, ...],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """NaN, inf and -inf are never best (whichever direction) and not counted; each such child is printed, in the
    order given."""
    column = by.removeprefix("val/")
    children = [record(name, val=None if VALUES[name] is None else {column: VALUES[name]}) for name in order]
    best, value, among = _best(children, by)
    assert (value, among) == (expected, 2) and best.name == ("best" if expected == 0.3 else "worse")
    assert capsys.readouterr().out == "".join(
        f"skipped {name}: its {by} is {VALUES[name]} (the run diverged); a non-finite metric is never best\n"
        for name in order if VALUES[name] is not None and not math.isfinite(VALUES[name]))


@pytest.mark.parametrize("by", list(BY))
def test_best_refuses_when_no_value_is_finite(by: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every child scored but none finite: one line naming the metric."""
    column = by.removeprefix("val/")
    children = [record("nan", val={column: math.nan}), record("plain"), record("inf", val={column: math.inf})]
    assert refusal(_best, children, by) == (f"--register-best: no compared run has a finite value of {by} (logged by "
                                            "the training loop's validation)")
    assert capsys.readouterr().out.count("skipped ") == 2


@pytest.mark.parametrize("children", [[], [record("plain"), record("other", val={"xx": 0.1}),
                                           record("test-only", test={"nll": 0.1, "acc": 0.1, "ece": 0.1,
                                                                     "brier": 0.1})]])
@pytest.mark.parametrize("by", list(BY))
def test_best_refuses_when_no_child_has_the_metric(by: str, children: list[RunRecord]) -> None:
    """No child scored on the metric (none compared, or none logged it on validation): one line naming it."""
    assert refusal(_best, children, by) == (f"--register-best: no compared run has the validation metric {by} "
                                            "(logged by the training loop's validation)")


# ----------------------------------------------------------------------------------------------------- register_best

class Fakes:
    """register_best's collaborators in sigmanens_dist.registry.best, each recording its call into ``calls``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, run_dir: str | None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.run_dir = run_dir
        self.checkpoint = Path("/nowhere/checkpoint.pt")
        self.run = object()
        self.version = object()
        self.loaded = object()
        self.program: Path | None = None
        for name in ("mlflow_client", "resolve_checkpoint", "check_registration", "load_trained", "export_program",
                     "register_program"):
            monkeypatch.setattr(best_module, name, getattr(self, name))

    def mlflow_client(self, uri: str) -> Any:
        self.calls.append(("mlflow_client", uri))
        return SimpleNamespace(get_run=self.get_run)

    def get_run(self, run_id: str) -> Any:
        self.calls.append(("get_run", run_id))
        params = {"other": "x"} if self.run_dir is None else {"run_dir": self.run_dir, "other": "x"}
        return SimpleNamespace(data=SimpleNamespace(params=params))

    def resolve_checkpoint(self, *args: Any, **kwargs: Any) -> tuple[Path, str]:
        self.calls.append(("resolve_checkpoint", args, kwargs))
        return self.checkpoint, "the newest checkpoint"

    def check_registration(self, *args: Any, **kwargs: Any) -> object:
        self.calls.append(("check_registration", args, kwargs))
        return self.run

    def load_trained(self, *args: Any, **kwargs: Any) -> object:
        self.calls.append(("load_trained", args, kwargs))
        return self.loaded

    def export_program(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("export_program", args, kwargs))
        self.program = args[1]
        assert self.program.parent.is_dir() and not self.program.exists()

    def register_program(self, *args: Any, **kwargs: Any) -> object:
        self.calls.append(("register_program", args, kwargs))
        return self.version


CHILDREN = [record("worse", val={"nll": 0.9, "acc": 0.81234567}), record("best", val={"nll": 0.123456789, "acc": 0.7}),
            record("gone", val={"nll": math.nan}), record("mid", val={"nll": 0.5, "acc": 0.75})]


@pytest.mark.parametrize("by, child, value, among", [("val/nll", "best", 0.123456789, 3),
                                                     ("val/acc", "worse", 0.81234567, 3)])
@pytest.mark.parametrize("alias, study", [(None, None), ("champion", "study-7")])
def test_register_best_exports_and_registers_the_best_child(
        by: str, child: str, value: float, among: int, alias: str | None, study: str | None, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The best child's run gives the run directory; its checkpoint is checked for registration before it is
    exported into a temporary folder (gone afterwards), then registered, tagged with the choice (and the study)."""
    fakes = Fakes(monkeypatch, str(tmp_path))
    assert register_best(URI, CHILDREN, "model", by, alias, study) is fakes.version
    program = fakes.program
    assert program is not None and program.name == f"{child}.pt2"
    assert program.parent.name.startswith("sigmanens-best-")
    assert program.parent.parent == Path(tempfile.gettempdir()) and not program.parent.exists()
    tags = {f"{TAG_PREFIX}chosen_by": by, f"{TAG_PREFIX}chosen_value": repr(value),
            f"{TAG_PREFIX}chosen_among": str(among), f"{TAG_PREFIX}child": child}
    if study is not None:
        tags[f"{TAG_PREFIX}study"] = study
    assert fakes.calls == [
        ("mlflow_client", URI), ("get_run", f"id-{child}"),
        ("resolve_checkpoint", (str(tmp_path), "--register-best"), {}),
        ("check_registration", (URI, f"id-{child}", "model", alias), {}),
        ("load_trained", (fakes.checkpoint,), {}), ("export_program", (fakes.loaded, program), {}),
        ("register_program", (program, "model"), {"uri": URI, "run": fakes.run, "alias": alias, "tags": tags})]
    assert capsys.readouterr().out == ("skipped gone: its val/nll is nan (the run diverged); a non-finite metric is "
                                       "never best\n" if by == "val/nll" else "") + (
        f"best on {by}: {child} ({value:.4g}, of {among}); exporting the newest checkpoint\n")


@pytest.mark.parametrize("where", ["missing-param", "missing-dir", "a-file"])
def test_register_best_refuses_a_child_without_a_run_directory(where: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """No run_dir param, or one that is no folder here: one line naming the child, its value and the model, before
    any checkpoint is read, checked or exported."""
    (tmp_path / "a-file").write_text("not a folder")
    run_dir = None if where == "missing-param" else str(tmp_path / where)
    fakes = Fakes(monkeypatch, run_dir)
    message = refusal(register_best, URI, CHILDREN, "model", "val/nll", "champion", "study-7")
    assert message == ("--register-best: the best child best (val/nll 0.1235) has no run directory here "
                       f"({run_dir}); export and register it where it is: sigmanens export RUN --program OUT "
                       "--register model")
    assert fakes.calls == [("mlflow_client", URI), ("get_run", "id-best")]
