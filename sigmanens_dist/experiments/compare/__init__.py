"""``sigmanens compare``: one table and one set of plots from the runs in an MLflow store (sqlite or a server).

Three parts, bottom first: ``records`` (reading runs from MLflow), ``statistics`` (groups over seeds, paired
differences), ``report`` (the table and CSV files) with ``plots``; the command's parser is
:mod:`sigmanens_dist.cli.compare`. Every name this module had as one file is importable from here (``main``, with a
DeprecationWarning, for one release).
"""

from __future__ import annotations

from sigmanens_dist.deprecation import moved
from sigmanens_dist.experiments.compare.plots import _frontier
from sigmanens_dist.experiments.compare.records import (
    DIFFS,
    PAIRINGS,
    RECORDS_FILE,
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
    read_records,
    save_records,
    select_split,
)
from sigmanens_dist.experiments.compare.report import COLUMNS, _Report, build_report, write_report
from sigmanens_dist.experiments.compare.statistics import group_runs, paired_difference, reference_for

__all__ = ["COLUMNS", "DIFFS", "PAIRINGS", "RECORDS_FILE", "SCORES", "SHIFT_SEVERITIES", "SPLITS", "SPLIT_METRICS",
           "CompareError", "Group", "RunRecord", "build_report", "group_runs", "load_runs", "method_variant",
           "paired_difference", "read_records", "reference_for", "save_records", "select_split", "write_report"]
# private names the tests and the terminal table reach through this module
_PRIVATE = (_Report, _frontier, _pick_runs, _record, _sharing_history, _uses)


# the command's parser moved to sigmanens_dist.cli.compare (0.3)
__getattr__ = moved(__name__, {"main": "sigmanens_dist.cli.compare"})
