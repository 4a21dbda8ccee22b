"""Command-line options that several commands share, defined once so that their names, choices and help agree."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from typing import Literal, cast

from sigmanens_dist.config import EvalConfig, choices, from_options
from sigmanens_dist.errors import UsageError

__all__ = ["PROGRAM_FORMATS", "add_norm_stats_options", "parse_alphas", "parse_members", "parse_prior", "parse_score",
           "program_format"]

PROGRAM_FORMATS = {"torch": ".pt2", "onnx": ".onnx"}  # export --format -> the suffix that implies it


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


def parse_prior(text: str | None, mode: str) -> float:
    """``--norm-stats-prior N``: a number ≥ 0 (default 0), and only with ``--norm-stats batch`` (the config's rule,
    ``eval.norm_stats_prior``, checked by :class:`~sigmanens_dist.config.EvalConfig` itself)."""
    if text is None:
        return 0.0
    try:
        prior = float(text)
    except ValueError:
        prior = math.nan
    if not (math.isfinite(prior) and prior >= 0):
        raise UsageError(f"--norm-stats-prior {text!r}: give the prior strength N as a number ≥ 0 (0: the batch "
                         "statistics alone; e.g. 16: the training statistics count as 16 samples)")
    from_options(EvalConfig, {"norm_stats_prior": text}, norm_stats=mode, norm_stats_prior=prior)
    return prior


def parse_alphas(text: str | None, *, single: bool = False) -> list[float]:
    """``--conformal``'s miscoverages (eval's and export's): one α, or unless ``single`` several separated by commas,
    each strictly between 0 and 1; none when not asked for."""
    if text is None:
        return []
    alphas = []
    for part in text.split(","):
        try:
            alphas.append(float(part))
        except ValueError:
            alphas.append(math.nan)  # fails the range check below, naming the whole text
    wanted = ("one miscoverage α in (0, 1), e.g. 0.1" if single else "the miscoverage α as a number strictly between "
              "0 and 1 (e.g. 0.1), or several separated by commas (0.1,0.05)")
    if not all(0 < a < 1 for a in alphas) or (single and len(alphas) > 1):  # NaN fails the range too
        raise UsageError(f"--conformal {text!r}: give {wanted}")
    if len(set(alphas)) != len(alphas):
        raise UsageError(f"--conformal {text!r}: an α is given twice")
    return alphas


def parse_score(text: str | None, alpha: float | None) -> str:
    """``--conformal-score`` (default thr), which only goes with ``--conformal``."""
    from sigmanens_dist.inference.conformal import METHODS  # here, not at the top: `--help` answers without torch

    if text is not None and alpha is None:
        raise UsageError(f"--conformal-score {text} goes with --conformal ALPHA")
    if text is not None and text not in METHODS:
        raise UsageError(f"--conformal-score {text!r}: choose {', '.join(METHODS)}")
    return text or "thr"


def parse_members(text: str | None, num_members: int) -> list[int] | None:
    """``--members 0,2,3`` → ``[0, 2, 3]`` (distinct indices in 0..M-1); None for all members."""
    if text is None:
        return None
    try:
        members = [int(part) for part in text.split(",")] if text.strip() else []
    except ValueError:
        raise UsageError(f"--members {text!r}: give member indices separated by commas, e.g. 0,1") from None
    if not members or len(set(members)) != len(members) or not all(0 <= i < num_members for i in members):
        raise UsageError(f"--members {text!r}: give distinct member indices in 0..{num_members - 1}")
    return members


def program_format(fmt: str | None, out: Path) -> Literal["torch", "onnx"]:
    """``--format``, or the one OUT's suffix implies (``.onnx``: onnx, else torch); a contradiction is refused, and
    onnx without its packages (the ``deploy`` extra)."""
    if fmt is not None and fmt not in PROGRAM_FORMATS:
        raise UsageError(f"--format {fmt!r}: choose {' or '.join(PROGRAM_FORMATS)}")
    implied = next((name for name, suffix in PROGRAM_FORMATS.items() if out.suffix == suffix), None)
    if fmt is not None and implied is not None and fmt != implied:
        raise UsageError(f"--format {fmt} with OUT {out}: the suffix {out.suffix} means --format {implied}; give "
                         f"--format {implied} or an OUT ending in {PROGRAM_FORMATS[fmt]}")
    chosen = fmt or implied or "torch"
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if chosen == "onnx" and missing:
        raise UsageError(f"--format onnx needs {' and '.join(missing)}: pip install 'sigmanens-dist[deploy]'")
    return cast(Literal["torch", "onnx"], chosen)
