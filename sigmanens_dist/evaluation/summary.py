"""What ``sigmanens eval`` prints: the report for a person at a terminal of 100 columns. ``eval.md`` and
``eval.json`` keep everything (:func:`sigmanens_dist.evaluation.report.markdown` writes the Markdown); here the shift
scores are the mean over the corruptions per severity, the rest is as in the file, in tables that fit."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from sigmanens_dist.evaluation.report import (
    DIAGNOSIS_COLUMNS,
    FIT_SPLITS,
    diagnosis_rows,
    diversity_text,
    temperature_label,
)
from sigmanens_dist.methods import display_name
from sigmanens_dist.progress import WIDTH, near, text_console

__all__ = ["summary", "written"]

KEYS = ("acc", "nll", "ece", "aece", "brier", "aurc")  # evaluation.run.SUB_KEYS: the per-model scores
LABELS = {"acc": "acc ↑", "nll": "NLL ↓", "ece": "ECE ↓", "aece": "aECE ↓", "brier": "Brier ↓", "aurc": "AURC ↓"}
OOD = ("msp", "entropy", "mutual_information")  # evaluation.run.OOD_SCORES
# the diagnosis columns (their order), in short: the under-shift table fits 100 columns
SHIFT_LABELS = {**DIAGNOSIS_COLUMNS, "acc": "acc ↑", "nll": "NLL ↓", "member_mean/nll": "NLL mem", "ece": "ECE ↓",
                "member_mean/ece": "ECE mem", "disagreement": "disagree"}


def _fmt(value: Any) -> str:
    return "nan" if value != value else f"{value:.4f}"  # NaN is the one value unequal to itself


def _table(first: str, columns: list[str]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    table.add_column(first)
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    return table


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def summary(report: dict[str, Any]) -> str:
    """The report within 100 columns: per weights (raw, EMA) the ensemble, its members and their mean, diversity,
    the sub-ensembles, the mean scores under shift per severity and the OOD scores."""
    console, buf = text_console(WIDTH)
    where = near(Path(report["checkpoint"])) if report["checkpoint"] else "end of training"
    head = _wrap(f"Evaluation of {where} (step {report['step']}): {display_name(report['method'])}, "
                 f"{report['members']} of {report['num_members']} members, {report['dataset']} "
                 f"{report['split']} split.")
    head += [line for note in report["notes"] for line in _wrap(f"Note: {note}", "  ")]
    for variant, part in report["weights"].items():
        m = part["metrics"]
        console.print(f"\n{variant} weights, {int(m['num_samples'])} samples", style="bold", highlight=False)
        table = _table("", [LABELS[k] for k in KEYS])
        rows = [("ensemble", "")] + [(f"member {i}", f"member{i}/") for i in range(report["members"])]
        rows += [("mean of members", "member_mean/")] if report["members"] > 1 else []
        for label, prefix in rows:
            table.add_row(label, *(_fmt(m[prefix + k]) for k in KEYS))
        console.print(table)
        diversity = (f"{diversity_text(m, report['members'])}, predictive entropy {_fmt(m['entropy'])}"
                     + (f", members on per feature {_fmt(part['sharing']['all'])}" if "sharing" in part else ""))
        console.print("\n".join(_wrap(diversity, "  ")), highlight=False)
        if part["sub_ensembles"]:
            table = _table("k members", [*(LABELS[k] for k in KEYS), "ms / image"])
            for row in part["sub_ensembles"]:
                table.add_row(str(row["k"]), *(_fmt(row[k]) for k in KEYS), f"{row['ms_per_image']:.3f}")
            console.print("\nSub-ensembles (the first k members)", style="bold", highlight=False)
            console.print(table)
        if "shift" in part:
            corruptions = [name for name in part["shift"] if name != "mean"]
            which = "validation" if report.get("shift_split") == "val" else "test"
            table = _table("", list(SHIFT_LABELS.values()))
            for label, cells in diagnosis_rows(part, report["members"], every=False):
                table.add_row(label, *cells)
            console.print(f"\nUnder shift ({which} corruptions): mean over {len(corruptions)} corruption(s), per "
                          "corruption in eval.md", style="bold", highlight=False)
            console.print(table)
            console.print("\n".join(_wrap("mem: the mean member; disagree: member pairs that differ; MI: mutual "
                                           "information; MI AUROC: corrupted vs clean inputs told apart by MI"
                                           + ("; — undefined with one member" if report["members"] == 1 else ""),
                                           "  ")), highlight=False)
        _posthoc(console, part)
        if "ood" in part:
            ood = part["ood"]
            table = _table("score", ["AUROC ↑", "AUPR-in ↑", "AUPR-out ↑", "FPR@95TPR ↓"])
            for score in OOD:
                r = ood[score]
                table.add_row(score, *(_fmt(r[k]) for k in ("auroc", "aupr_in", "aupr_out", "fpr95")))
            console.print(f"\nOOD: {ood['set']} ({ood['num_out']} OOD vs {ood['num_in']} in-distribution, OOD "
                          "positive)", style="bold", highlight=False)
            console.print(table)
    return "\n".join(line.rstrip() for line in [*head, *buf.getvalue().rstrip().splitlines()])


def _posthoc(console: Any, part: dict[str, Any]) -> None:
    """The ensemble before and after temperature scaling (and after member temperatures, when fitted), and each
    conformal method's coverage and set size."""
    if "calibration" in part:
        cal, members = part["calibration"], part.get("member_calibration")
        table = _table("ensemble", [LABELS[k] for k in KEYS])
        rows = [("before", part["metrics"]), ("after", cal["metrics"])]
        rows += [("after, T_m", members["metrics"])] if members is not None else []
        for when, values in rows:
            table.add_row(when, *(_fmt(values[k]) for k in KEYS))
        console.print(f"\n{temperature_label(cal)}, fitted on {cal['num_fit']} {FIT_SPLITS[cal['fitted_on']]} "
                      "samples (under shift in eval.md)", style="bold", highlight=False)
        if members is not None:
            console.print(temperature_label(members), style="bold", highlight=False)
        console.print(table)
    for conf in part.get("conformal", []):
        table = _table("method", ["coverage", "mean set size"])
        for method, r in conf["methods"].items():
            table.add_row(method, _fmt(r["coverage"]), _fmt(r["set_size"]))
        console.print(f"\nConformal sets at α = {conf['alpha']} (per class and under shift in eval.md)", style="bold",
                      highlight=False)
        console.print(table)


def written(out: Path) -> str:
    return "\n".join(_wrap(f"Full report in {near(out)}/: eval.json, eval.md and the plots", "  "))
