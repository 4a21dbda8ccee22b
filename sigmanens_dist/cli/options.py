"""Command-line options that several commands share, defined once so that their names, choices and help agree."""

from __future__ import annotations

import argparse

from sigmanens_dist.config import EvalConfig, choices

__all__ = ["add_norm_stats_options"]


def add_norm_stats_options(ap: argparse.ArgumentParser, condition: str = "") -> None:
    """``--norm-stats train|batch`` and ``--norm-stats-prior N`` (eval, export); ``condition`` prefixes the help
    (e.g. ``with --program: ``)."""
    ap.add_argument("--norm-stats", choices=choices(EvalConfig, "norm_stats"), default="train",
                    help=f"{condition}BatchNorm statistics at prediction: train (the running ones, default) or batch "
                         "(each member's re-estimated from each batch it predicts: predictions then depend on the "
                         "batch; the stored statistics are not changed)")
    ap.add_argument("--norm-stats-prior", metavar="N",
                    help="with --norm-stats batch: use (N·train + n·batch)/(N + n) for a batch of n (default 0: the "
                         "batch statistics alone)")
