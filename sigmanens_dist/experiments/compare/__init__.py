"""``sigmanens compare``: one table and one set of plots from the runs in an MLflow store (sqlite or a server).

Three parts, bottom first: ``records`` (reading runs from MLflow), ``statistics`` (groups over seeds, paired
differences), ``report`` (the table and CSV files) with ``plots``; the command's parser is
:mod:`sigmanens_dist.cli.compare`. The public names of the parts are importable from here.
"""

from __future__ import annotations

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
    load_runs,
    method_variant,
    mlflow_client,
    read_records,
    save_records,
    select_split,
)
from sigmanens_dist.experiments.compare.report import COLUMNS, Report, build_report, write_report
from sigmanens_dist.experiments.compare.statistics import group_runs, paired_difference, reference_for

__all__ = ["COLUMNS", "DIFFS", "PAIRINGS", "RECORDS_FILE", "SCORES", "SHIFT_SEVERITIES", "SPLITS", "SPLIT_METRICS",
           "CompareError", "Group", "Report", "RunRecord", "build_report", "group_runs", "load_runs", "method_variant",
           "mlflow_client", "paired_difference", "read_records", "reference_for", "save_records", "select_split",
           "write_report"]
