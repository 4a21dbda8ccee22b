"""What ``sigmanens compare`` (and so ``sigmanens demo``) prints: the comparison for a person at a terminal of 100
columns. The files (``table.md``, ``table.csv``, ``runs.csv``) keep every column; this is a reading of them.

Up to :data:`FEW` configurations: the metrics as rows, grouped (accuracy, calibration, OOD, diversity, cost), the
configurations as columns, each score with a row beneath it holding the paired difference against the reference and
its 95% interval. More configurations: one row each with the few scores that matter most. The seed count is said
once, in the heading; methods go by the names people know (each method class's ``display``); counts in k / M units.
"""

from __future__ import annotations

import math
import shutil
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from sigmanens_dist.progress import WIDTH, near, text_console, wrap
from sigmanens_dist.training.tracking import ui_hint

if TYPE_CHECKING:
    from sigmanens_dist.experiments.compare import Group, Report

__all__ = ["FEW", "WIDTH", "display_name", "human", "render", "ui_lines", "written"]

FEW = 4  # up to this many configurations: metrics as rows, configurations as columns

# (heading, [(column of the report, label)]): the rows of the few-configurations layout, in order. A direction says
# which way is better.
SECTIONS: list[tuple[str, list[tuple[str, str]]]] = [
    ("Accuracy", [("acc", "accuracy ↑"), ("nll", "NLL ↓"), ("brier", "Brier ↓")]),
    ("Calibration", [("ece", "ECE ↓"), ("ece_shift", "ECE under shift ↓"), ("nll_shift", "NLL under shift ↓")]),
    ("OOD detection", [("ood_auroc", "AUROC ↑")]),
    ("Diversity", [("disagreement", "disagreement"), ("sharing", "members on (σ)")]),
    ("Cost", [("params", "parameters"), ("train_compute", "train compute"), ("inference_passes", "passes / image"),
              ("ms_per_image", "ms / image"), ("train_img_per_s", "train images/s")]),
]
# counts shown in k / M units, with their ratio to the reference's
RATIO = ("params", "train_compute", "ms_per_image")
# the many-configurations layout: these scores (means), then these paired differences
HEADLINE = [("acc", "accuracy ↑"), ("nll", "NLL ↓"), ("ece", "ECE ↓")]
HEADLINE_DIFFS = [("acc", "Δ accuracy"), ("nll", "Δ NLL")]


def display_name(method: str) -> str:
    """:func:`sigmanens_dist.methods.display_name`, imported on first use (methods import torch; --help does not)."""
    from sigmanens_dist.methods import display_name as name  # methods import torch: `--help` answers without it

    return name(method)


def human(x: float) -> str:
    """384000 → ``384k``, 25600 → ``25.6k``, 1493480 → ``1.49M``: three significant digits and a unit."""
    if math.isnan(x):
        return ""
    x = float(f"{x:.3g}")
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def _value(report: Report, g: Group, column: str, *, std: bool = True) -> str:
    mean, sd = g.mean(column), g.std(column)
    if math.isnan(mean):
        return ""
    if column in RATIO or column == "train_img_per_s":
        text = human(mean) if column != "ms_per_image" else f"{mean:.3g}"
        ref = report.reference_of(g)
        if column in RATIO and ref is not None and not math.isnan(ref.mean(column)) and ref.mean(column) > 0:
            text += f" ({mean / ref.mean(column):.3g}×)"
        return text
    if column == "inference_passes":
        return f"{mean:.0f}"
    fmt = "{:.3f}" if column == "sharing" else "{:.4f}"
    spread = f" ± {fmt.format(sd)}" if std and not math.isnan(sd) and sd != 0 else ""
    return fmt.format(mean) + spread


def _diff(report: Report, g: Group, column: str) -> str:
    """``+0.0200 ± 0.0100``: the paired difference and the half width of its 95% t interval (one seed: no interval);
    ``—`` for the reference itself, blank where nothing pairs."""
    if report.reference_of(g) is None and (g.method == report.reference or report.pair == "members"):
        return "—"
    diff = report.difference(g, column)
    if diff is None:
        return ""
    mean, lo, hi, n = diff
    return f"{mean:+.4f}" + (f" ± {(hi - lo) / 2:.4f}" if n > 1 and not math.isnan(hi - lo) else "")


def _one_seed(report: Report) -> bool:
    return all(len(g.runs) == 1 for g in report.groups)


def _seeds(report: Report) -> str:
    counts = sorted({len(g.runs) for g in report.groups})
    if counts == [1]:
        return "one seed (no spread, no interval: give --seeds 0,1,2 to the study)"
    if len(counts) == 1:
        return f"mean ± std over {counts[0]} seeds"
    return f"mean ± std over {counts[0]}–{counts[-1]} seeds (see the seeds row)"


def _heading(report: Report) -> list[str]:
    where = "test set" if report.split == "test" else "validation split"
    text = f"Scores on the {where}, {_seeds(report)}."
    if report.diffs:
        text += f" Δ: the difference to {report.difference_to(display_name, short=True)}" + (
            "." if _one_seed(report) else ", paired by seed, ± the half width of its 95% t interval.")
    return textwrap.wrap(text, WIDTH)


def _few(report: Report) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", expand=False)
    table.add_column("", no_wrap=True)
    for g in report.groups:
        table.add_column(g.label(), justify="right", overflow="fold")
    if len({len(g.runs) for g in report.groups}) > 1:
        table.add_row("seeds", *(str(len(g.runs)) for g in report.groups))
    present = {c[0] for c in report.columns}
    for heading, rows in SECTIONS:
        rows = [(c, label) for c, label in rows if c in present]
        if not rows:
            continue
        table.add_row(heading, *([""] * len(report.groups)), style="bold")
        for column, label in rows:
            table.add_row(f"  {label}", *(_value(report, g, column) for g in report.groups))
            if column in report.diffs:
                label = "    Δ" if _one_seed(report) else "    Δ ± 95% CI"
                table.add_row(label, *(_diff(report, g, column) for g in report.groups))
        table.add_row(*([""] * (len(report.groups) + 1)))
    return table


def _many(report: Report) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", expand=False)
    table.add_column("configuration", overflow="fold")
    shown = [c for c in HEADLINE if c[0] in {col[0] for col in report.columns}]
    diffs = [c for c in HEADLINE_DIFFS if c[0] in report.diffs]
    for _, label in shown:
        table.add_column(label, justify="right", no_wrap=True)
    for _, label in diffs:
        table.add_column(label, justify="right", no_wrap=True)
    for g in report.groups:
        table.add_row(g.label(), *(_value(report, g, c, std=False) for c, _ in shown),
                      *(_diff(report, g, c) for c, _ in diffs))
    return table


def render(report: Report, notes: list[str]) -> str:
    """The comparison as printed: heading, table, incomplete children, the warning on selecting by test scores."""
    width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns) if sys.stdout.isatty() else WIDTH
    console, buf = text_console(width)
    few = len(report.groups) <= FEW
    lines = _heading(report)
    if not few:
        lines += textwrap.wrap(f"{len(report.groups)} configurations: means of the headline scores here; spreads, "
                               "intervals and every other column in table.md.", WIDTH)
    console.print(_few(report) if few else _many(report))
    lines += ["", *buf.getvalue().rstrip().splitlines()]
    if notes:
        lines += ["", "Incomplete:", *(textwrap.fill(n, WIDTH, initial_indent="  ", subsequent_indent="    ")
                                       for n in notes)]
    if report.selection_on_test:
        lines += ["", *textwrap.wrap(
            f"Selection on the test set: this compares {len(report.groups)} configurations; a choice among them "
            "read off it is tuned on the test set: choose with `--split val`, then read this once for the "
            "configurations chosen.", WIDTH)]
    return "\n".join(line.rstrip() for line in lines)


def written(out: Path, files: list[Path]) -> str:
    """Where the files are: the folder, then the names in it."""
    tables = [p.name for p in files if p.suffix in (".md", ".csv")]
    plots = [p.name for p in files if p.suffix == ".png"]
    records = [p.name for p in files if p.suffix == ".jsonl"]
    text = f"Full table (every column) and plots in {near(out)}/: " + ", ".join(tables)
    text += f"; plots: {', '.join(plots)}" if plots else ""
    text += f"; the runs for --records: {', '.join(records)}" if records else ""
    return wrap(text)


def ui_lines(uri: str, experiment_id: str) -> str:
    """:func:`~sigmanens_dist.training.tracking.ui_hint` on lines of their own (its parts are separated by two
    spaces), a sqlite store below the working directory named relative to it."""
    if uri.startswith("sqlite:///"):
        uri = "sqlite:///" + near(Path(uri.removeprefix("sqlite:///")))
    first, *rest = ui_hint(uri, experiment_id).split("  ")
    if rest and ": " in first:  # "MLflow UI: mlflow ui …": the command on a line of its own
        title, command = first.split(": ", 1)
        return "\n".join([f"{title}:", f"  {command}", *(f"  {part}" for part in rest)])
    return "\n".join([first, *(f"  {part}" for part in rest)])
