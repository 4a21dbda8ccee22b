"""The comparison's files: the table (Markdown and CSV), a CSV of every run, and the plots beside them."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sigmanens_dist.atomic import write_text
from sigmanens_dist.experiments.compare.plots import (
    _plot_cost,
    _plot_members,
    _plot_pareto,
    _plot_severity,
    _plot_sharing,
)
from sigmanens_dist.experiments.compare.records import (
    DIFFS,
    PAIRED_AT,
    PAIRINGS,
    RECORDS_FILE,
    CompareError,
    Group,
    RunRecord,
    _uses,
    save_records,
    select_split,
)
from sigmanens_dist.experiments.compare.statistics import group_runs, paired_difference, reference_for

__all__ = ["COLUMNS", "Report", "build_report", "write_report"]

COLUMNS = [("params", "params", "{:,.0f}"), ("train_compute", "train compute (img×M)", "{:.3g}"),
           ("inference_passes", "inference passes/img", "{:.0f}"), ("ms_per_image", "inference ms/img", "{:.3f}"),
           ("train_img_per_s", "train img/s", "{:.0f}"),
           ("acc", "acc", "{:.4f}"), ("nll", "NLL", "{:.4f}"), ("ece", "ECE", "{:.4f}"), ("brier", "Brier", "{:.4f}"),
           ("ood_auroc", "OOD AUROC", "{:.4f}"), ("ece_shift", "ECE shift s3,s5", "{:.4f}"),
           ("nll_shift", "NLL shift s3,s5", "{:.4f}"), ("disagreement", "disagreement", "{:.4f}"),
           ("sharing", "sharing (members on)", "{:.3f}")]


def build_report(records: list[RunRecord], reference: str | None, *, pair: str = "epochs", split: str = "auto"
                 ) -> Report:
    """The grouped runs, their columns and the reference they pair with: what the files and the terminal show."""
    if pair not in PAIRINGS:
        raise CompareError(f"--pair {pair!r}: choose one of {', '.join(PAIRINGS)}")
    if pair == "members" and reference is not None:
        raise CompareError(f"--reference {reference!r} plays no part with --pair members (each configuration is "
                           "paired with itself at the next smaller M); give one or the other")
    split = select_split(records, split)
    groups = group_runs(records)
    methods = [g.method for g in groups]
    if reference is None:
        reference = next((m for m in ("single", "sigma") if m in methods), methods[0])
    elif reference not in methods:
        raise CompareError(f"--reference {reference!r}: no finished runs of that method; methods here: "
                           f"{', '.join(dict.fromkeys(methods))}")
    columns = [c for c in COLUMNS if any(c[0] in r.values for r in records)]
    # with one method every group would pair with itself (except with the next smaller M): no difference columns
    paired = len(set(methods)) > 1 or pair == "members"
    diffs = [c for c in DIFFS if any(c in r.values for r in records)] if paired else []
    return Report(groups, columns, diffs, reference, pair, split)


def write_report(records: list[RunRecord], notes: list[str], out: Path, reference: str | None, *,
                 pair: str = "epochs", split: str = "auto") -> list[Path]:
    """``table.md``, ``table.csv``, ``runs.csv``, the records (``records.jsonl``) and the plots in ``out``; returns
    the files written."""
    report = build_report(records, reference, pair=pair, split=split)
    groups = report.groups
    out.mkdir(parents=True, exist_ok=True)
    files = [_markdown(report, notes, out / "table.md"), _csv(report, out / "table.csv"),
             _runs_csv(records, out / "runs.csv"), save_records(records, out / RECORDS_FILE)]
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
class Report:
    """The grouped runs with their columns and paired differences: what the table writers (files, terminal) share."""

    groups: list[Group]
    columns: list[tuple[str, str, str]]
    diffs: list[str]
    reference: str
    pair: str
    split: str

    @property
    def against(self) -> str:
        """What the differences are taken against, in a column name: the reference method, or the smaller M."""
        return "smaller M" if self.pair == "members" else self.reference

    def difference_to(self, name: Callable[[str], str] = str, short: bool = False) -> str:
        """Whom a Δ is taken against, in words: the reference method (as ``name`` spells it) or, with ``--pair
        members``, each configuration itself; then the pairing, ``short`` for the terminal's heading."""
        subject = "the same configuration" if self.pair == "members" else name(self.reference)
        return f"{subject} {PAIRED_AT[self.pair]}" if short else f"{subject} at {PAIRINGS[self.pair]}"

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


def difference_text(mean: float, lo: float, hi: float, pairs: int) -> str:
    """A paired difference as every table writes it: mean and 95% interval, or the mean alone from one seed."""
    return f"{mean:+.4f}" + (f" [{lo:+.4f}, {hi:+.4f}]" if pairs > 1 else " (1 seed)")


def _diff_cell(report: Report, group: Group, column: str) -> str:
    diff = report.difference(group, column)
    return "" if diff is None else difference_text(*diff)


def _axis_cells(g: Group) -> list[str]:
    """Method, M, τ, λ as the table shows them (an axis the method does not have is blank)."""
    return [g.name, str(g.members) if _uses(g.method, "members") else "1",
            "" if g.tau is None else f"{g.tau:g}", "" if g.lam is None else f"{g.lam:g}"]


def _markdown_row(cells: Sequence[str]) -> str:
    """A table row whose cells stay cells: a ``|`` in a name (a method, a variant, a reference) would end its cell
    and shift every column after it, so it is escaped; a line break would end the table, so it becomes a space."""
    return "| " + " | ".join(" ".join(c.replace("|", "\\|").splitlines()) for c in cells) + " |"


def _markdown(report: Report, notes: list[str], path: Path) -> Path:
    axes = ["method", "M", "τ", "λ", *(["steps"] if report.budgets else []), "seeds"]
    head = [*axes, *(c[1] for c in report.columns),
            *(f"Δ{d} vs {report.against} [95% CI]" for d in report.diffs)]
    lines = [_markdown_row(head), "|" + "|".join(["---"] * len(axes) + ["---:"] * (len(head) - len(axes))) + "|"]
    for g in report.groups:
        cells = [*_axis_cells(g), *([f"{g.budget}×"] if report.budgets else []), str(len(g.runs)),
                 *(_cell(g, c[0], c[2]) for c in report.columns),
                 *(_diff_cell(report, g, d) for d in report.diffs)]
        lines.append(_markdown_row(cells))
    where = ("the test set (the trained weights' `eval/test/raw/*`)" if report.split == "test" else
             "the validation split (the loop's final `val/*`)")
    text = "\n".join(lines) + f"\n\nScores on {where}; mean ± std over seeds. "
    if report.selection_on_test:
        text += (f"**Selection on the test set:** this table compares {len(report.groups)} configurations; a choice "
                 "among them read off it is tuned on the test set: choose with `--split val`, then read this table "
                 "once for the configurations chosen. ")
    text += (f"Δ: the paired difference (same seed) against {report.difference_to()}, with the "
             "95% t interval; it excludes 0 when both ends have the same sign. " if report.diffs else
             "One method only: no paired differences (a study with `--methods sigma,single` has a reference). ")
    text += "Steps: the recipe's train.max_steps × this budget. " if report.budgets else ""
    text += ("Train compute: optimiser steps × global batch × M (images × members through the backbone); inference "
             "passes: backbone passes per predicted image.\n")
    if notes:
        text += "\nIncomplete:\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    write_text(path, text)
    return path


# what makes a spreadsheet (Excel, LibreOffice, Google Sheets) read a cell as a formula
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _write_csv(path: Path, rows: Iterable[Sequence[Any]]) -> Path:
    """Every CSV compare writes: a text cell that begins like a formula (a run, method or variant name is whatever
    was logged) gets a leading ``'``, OWASP's advice against CSV injection, so opening the file runs nothing;
    numbers are written as they are."""
    text = io.StringIO(newline="")
    w = csv.writer(text)
    for row in rows:
        w.writerow([f"'{v}" if isinstance(v, str) and v.startswith(_FORMULA_START) else v for v in row])
    return write_text(path, text.getvalue())  # atomic: a reader never sees half a table


def _csv(report: Report, path: Path) -> Path:
    rows: list[list[Any]] = [["method", "M", "tau", "lambda", "budget", "seeds", "split", "pair",
                              *(f"{c[0]}_{s}" for c in report.columns for s in ("mean", "std")),
                              *(f"diff_{d}_vs_{report.against.replace(' ', '_')}_{s}" for d in report.diffs
                                for s in ("mean", "lo", "hi", "pairs"))]]
    for g in report.groups:
        row: list[Any] = [*_axis_cells(g), g.budget, len(g.runs), report.split, report.pair]
        row += [v for c in report.columns for v in (g.mean(c[0]), g.std(c[0]))]
        ref = report.reference_of(g)
        for d in report.diffs:
            row += list(paired_difference(g, ref, d)) if ref is not None else ["", "", "", 0]
        rows.append(["" if isinstance(v, float) and math.isnan(v) else v for v in row])
    return _write_csv(path, rows)


def _runs_csv(records: list[RunRecord], path: Path) -> Path:
    keys = sorted({k for r in records for k in r.values})
    severities = sorted({s for r in records for s in r.severity_ece})
    nll_severities = sorted({s for r in records for s in r.severity_nll})
    rows: list[list[Any]] = [["run_id", "name", "method", "M", "tau", "lambda", "budget", "seed", *keys,
                              *(f"ece_severity{s}" for s in severities),  # means over the corruptions evaluated
                              *(f"nll_severity{s}" for s in nll_severities)]]
    rows += [[r.run_id, r.name, r.method, r.members, r.tau, r.lam, r.budget, r.seed,
              *(r.values.get(k, "") for k in keys), *(r.severity_ece.get(s, "") for s in severities),
              *(r.severity_nll.get(s, "") for s in nll_severities)] for r in sorted(records, key=lambda r: r.name)]
    return _write_csv(path, rows)
