"""``sigmanens compare``: one table and one set of plots from the runs in an MLflow store (sqlite or a server).

Four parts, bottom first: ``records`` (reading runs from MLflow), ``statistics`` (groups over seeds, paired
differences), ``report`` (the table and CSV files) with ``plots``, and ``cli`` (``main``, also
``python -m sigmanens_dist.experiments.compare``). Every name this module had as one file is importable from here.
"""

from __future__ import annotations

from sigmanens_dist.experiments.compare.cli import main
from sigmanens_dist.experiments.compare.plots import _frontier
from sigmanens_dist.experiments.compare.records import (
    DIFFS,
    PAIRINGS,
    SCORES,
    SHIFT_SEVERITIES,
    SPLIT_METRICS,
    SPLITS,
    CompareError,
    Group,
    RunRecord,
    _pick_runs,
    _record,
    _sharing_history,
    _uses,
    load_runs,
    method_variant,
    select_split,
)
from sigmanens_dist.experiments.compare.report import COLUMNS, _Report, build_report, write_report
from sigmanens_dist.experiments.compare.statistics import group_runs, paired_difference, reference_for

__all__ = ["COLUMNS", "DIFFS", "PAIRINGS", "SCORES", "SHIFT_SEVERITIES", "SPLITS", "SPLIT_METRICS", "CompareError",
           "Group", "RunRecord", "build_report", "group_runs", "load_runs", "main", "method_variant",
           "paired_difference", "reference_for", "select_split", "write_report"]
# private names the tests and the terminal table reach through this module
_PRIVATE = (_Report, _frontier, _pick_runs, _record, _sharing_history, _uses)
