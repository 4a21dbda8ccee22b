"""Train one run: ``sigmanens train`` or, under torchrun, ``python -m sigmanens_dist.train``.

    sigmanens train --config configs/demo.yaml model.num_members=8 reg.tau=0.25
    torchrun --nproc_per_node 8 -m sigmanens_dist.train --config imagenet_vit strategy.name=fsdp
    sigmanens train --config imagenet_vit --check      (validate the recipe and overrides, print the run directory)

The recipe (a YAML path or a packaged name) plus dotted ``key=value`` overrides is checked first: a bad key or value
is one message and exit status 2, without importing torch (``--check`` stops there). Exit status 0 when done,
75 (``EXIT_PREEMPTED``) after a signal-triggered checkpoint; the trainer itself is :mod:`sigmanens_dist.trainer`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sigmanens_dist.atomic import write_text
from sigmanens_dist.config import check_run_paths, load_config
from sigmanens_dist.errors import EXIT_UNAVAILABLE, EXIT_USAGE, USAGE_MARKER, UnavailableError, UsageError
from sigmanens_dist.training.preemption import StartupGuard
from sigmanens_dist.training.run_lock import RunLockedError

if TYPE_CHECKING:
    from sigmanens_dist.config import Config

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sigmanens_dist.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, help="YAML recipe (default: built-in defaults)")
    ap.add_argument("--resume", help="'auto', 'none' or a checkpoint path (overrides checkpoint.resume)")
    ap.add_argument("--check", action="store_true",
                    help="validate the recipe and overrides, print the run directory and exit (0, or 2 with the "
                         "problems): what the Slurm scripts run before anything is queued")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_members=8 reg.tau=0.25")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point. A :class:`UsageError` (a bad config, a missing path, a checkpoint of another run) is one
    message from rank 0 and exit status 2, recorded in ``<run_dir>/usage_error.txt`` so batch scripts do not retry
    it; a server that does not answer (:class:`UnavailableError`) is one line and exit status 1, which batch scripts
    retry; any other exception keeps its traceback (exit 1). torch and the trainer are imported only once the config
    and the run's paths are checked and ``--check`` was not asked for."""
    StartupGuard.install(list(sys.argv[1:] if argv is None else argv))  # a preemption before the first step
    args = parser().parse_intermixed_args(argv)  # flags and overrides in any order
    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    cfg = None
    trainer = None
    try:
        cfg = load_config(args.config, overrides)
        check_run_paths(cfg)  # the run directory, converted data: --check refuses what the run would refuse
        if args.check:
            print(f"config ok: run_dir={cfg.run_dir}")
            return 0
        StartupGuard.set_run_dir(cfg.run_dir)
        from sigmanens_dist import trainer  # after the config check: `--help` and `--check` answer without torch

        return trainer.fit(cfg)
    except UsageError as err:
        if os.environ.get("SIGMANENS_TRACEBACK"):
            raise
        return _usage_error(err, cfg)
    except UnavailableError as err:  # a server that did not answer: one line, exit 1, which batch scripts retry
        if os.environ.get("SIGMANENS_TRACEBACK"):
            raise
        _say(err)
        return EXIT_UNAVAILABLE
    finally:
        StartupGuard.stand_down()
        if trainer is not None:
            trainer.shutdown()


def _usage_error(err: UsageError, cfg: Config | None) -> int:
    """Rank 0 (every rank raised the same error) prints the message alone and records it for the batch script."""
    _say(err)
    ours = cfg is not None and Path(cfg.run_dir).is_dir() and not isinstance(err, RunLockedError)  # held: the holder's
    if ours and int(os.environ.get("RANK", "0")) == 0:
        write_text(Path(cfg.run_dir) / USAGE_MARKER, f"{err}\n")
    return EXIT_USAGE


def _say(err: Exception) -> None:
    """The message alone, from rank 0 (every rank raised the same error)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {err}", file=sys.stderr, flush=True)
    else:  # torchrun stops every worker once one exits: give rank 0 the time to say why
        time.sleep(3)

