"""``python -m sigmanens_dist.cli.tracking set-status RUN_DIR STATUS``: mark a run's MLflow run, for the Slurm
scripts (slurm/common.sh) when they give up on a job."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sigmanens_dist.training.tracking import set_status

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m sigmanens_dist.cli.tracking set-status RUN_DIR STATUS`` (slurm/common.sh, on giving up)."""
    ap = argparse.ArgumentParser(prog="python -m sigmanens_dist.cli.tracking")
    ap.add_argument("command", choices=["set-status"])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("status", choices=["FAILED", "KILLED", "FINISHED"])
    args = ap.parse_args(argv)
    run_id = set_status(args.run_dir, args.status)
    print(f"MLflow run {run_id}: {args.status}" if run_id else f"{args.run_dir}: no MLflow run recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
