"""``sigmanens compare``: one table and one set of plots from the runs in an MLflow store (sqlite or a server).

    sigmanens compare --parent RUN_ID --uri sqlite:///runs/study-m-scaling/mlflow.db [--out DIR] [--reference single]
    sigmanens compare --experiment sigmanens --uri http://127.0.0.1:5000
    sigmanens compare --records results/a/records.jsonl results/b/records.jsonl --split val

Runs are grouped by grid point (method, M, τ, λ, step budget) and summarised over seeds as mean ± std; the
difference to the reference method is paired by seed, with a 95% t interval, at equal epochs (the reference at the
same budget) or at equal training compute (``--pair compute``: the reference whose images × members through the
backbone are the same); ``--pair members`` pairs each configuration with itself at the next smaller M (does
doubling M still help?). Everything is read from what the trainer logs to MLflow: the params (the flattened config),
the test-set evaluation (``eval/test/raw/*``, from ``eval.at_end`` or ``sigmanens eval``) or the final ``val/*``
metrics, and the ``final/*`` extras. The table (Markdown and CSV, plus a CSV of every run) and the plots are logged
back to the study's parent run. Every compared run is also saved, store-free, in ``records.jsonl`` beside the
table: ``--records`` compares such files (runs from stores that were not kept, or from several stores) as it would
the store.

``--register-best NAME [--by val/nll] [--alias ALIAS]`` then exports the run that is best on that validation metric
(never a test metric) as a program and registers it in the store's Model Registry as a version of NAME, tagged with
the study and the choice (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.errors import EXIT_UNAVAILABLE, EXIT_USAGE, UnavailableError, UsageError
from sigmanens_dist.experiments.compare.records import (
    PAIRINGS,
    RECORDS_FILE,
    SPLITS,
    load_runs,
    mlflow_client,
    read_records,
)
from sigmanens_dist.experiments.compare.report import build_report, write_report

__all__ = ["main"]

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--experiment", help="every run of this MLflow experiment (study parents excluded)")
    which.add_argument("--parent", help="the child runs of this study parent run")
    which.add_argument("--records", nargs="+", type=Path, metavar="FILE",
                       help=f"the runs saved in these {RECORDS_FILE} files (written beside every table); a grid "
                            "point and seed in two files: the later file's run")
    ap.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                    help="tracking URI, sqlite:///path/mlflow.db or http://host:port (default $MLFLOW_TRACKING_URI)")
    ap.add_argument("--out", type=Path,
                    help="where the table and plots go (default runs/compare-<parent|experiment|records>)")
    ap.add_argument("--reference", help="the method differences are paired against (default single, else sigma)")
    ap.add_argument("--pair", choices=list(PAIRINGS), default="epochs",
                    help="; ".join(f"{k}: {v}" for k, v in PAIRINGS.items()))
    ap.add_argument("--split", choices=list(SPLITS), default="auto",
                    help="scores from the test-set evaluation or the validation split (auto: test when every run "
                         "has it)")
    ap.add_argument("--register-best", metavar="NAME", help="export the run best on --by and register it as a "
                                                            "version of NAME in the store's Model Registry")
    ap.add_argument("--by", help="with --register-best: the validation metric that picks it: val/nll (default), "
                                 "val/acc, val/ece or val/brier")
    ap.add_argument("--alias", help="with --register-best: point this alias of NAME at the new version")
    args = ap.parse_args(argv)
    if not args.uri and not args.records:
        print("error: give --uri (e.g. sqlite:///runs/study-m-scaling/mlflow.db) or set MLFLOW_TRACKING_URI",
              file=sys.stderr)
        return 2
    out = args.out or Path("runs") / f"compare-{args.parent or args.experiment or 'records'}"
    try:
        by = _registering(args)
        if args.records:
            (records, notes), parent = read_records(args.records), None
        else:
            records, notes, parent = load_runs(args.uri, parent=args.parent, experiment=args.experiment)
        files = write_report(records, notes, out, args.reference, pair=args.pair, split=args.split)
    except UsageError as err:  # a CompareError: the user's to fix, the message alone, exit 2 (errors.py)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except UnavailableError as err:  # a tracking server that does not answer: one line, exit 1
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    from sigmanens_dist.experiments import terminal  # the table for a person; the files keep every column

    print(terminal.render(build_report(records, args.reference, pair=args.pair, split=args.split), notes))
    print()
    print(terminal.written(out, files))
    if parent is not None:
        try:
            mlflow_client(args.uri).log_artifacts(parent, str(out), "compare")
            print(f"logged to the parent run {parent} under compare/")
        except Exception as err:  # the report is on disk; a store that refuses artifacts only loses the copy
            print(f"warning: could not log the report to the parent run {parent}: {err}", file=sys.stderr)
    if not args.records:
        print(terminal.ui_lines(args.uri, mlflow_client(args.uri).get_run(records[0].run_id).info.experiment_id))
    if by is not None:
        from sigmanens_dist.registry.best import register_best  # here, not at the top: `--help` answers without torch

        try:
            version = register_best(args.uri, records, args.register_best, by, args.alias,
                                    parent or args.experiment)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE
        except UnavailableError as err:  # the server stopped answering since the runs were read: exit 1
            print(f"error: {err}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"registered it as models:/{args.register_best}/{version.version}"
              f"{f' (models:/{args.register_best}@{args.alias})' if args.alias else ''} in {args.uri}")
    return 0


def _registering(args: argparse.Namespace) -> str | None:
    """``--by`` of ``--register-best`` (None without it), every registry flag checked before any run is read."""
    if args.register_best is None:
        if args.by is not None or args.alias is not None:
            raise UsageError("--by and --alias go with --register-best NAME")
        return None
    # here, not at the top: `--help` answers without torch
    from sigmanens_dist.registry import check_alias, check_name, check_store
    from sigmanens_dist.registry.best import parse_by

    if args.records:
        raise UsageError("--register-best needs the runs' store (--parent or --experiment with --uri), not --records")
    check_store(args.uri)
    check_name(args.register_best, "--register-best")
    check_alias(args.alias)
    return parse_by(args.by or "val/nll")
