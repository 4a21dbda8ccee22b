"""``python -m sigmanens_dist.train`` (or ``torchrun … -m sigmanens_dist.train``): the training command as a module a
launcher runs, the same as ``sigmanens train`` (:mod:`sigmanens_dist.cli.train`: its parser, exit statuses and
refusals). A module of its own, on the command line's floor, so that the trainer (:mod:`sigmanens_dist.trainer`)
imports nothing from ``cli/``.
"""

from __future__ import annotations

import signal
import sys

if __name__ == "__main__":
    # the first statement run: a signal is noted until the guard (an import away) answers it, so a preemption
    # during the seconds of imports before the first step is one too
    _EARLY: list[int] = []
    for _sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(_sig, lambda signum, _frame: _EARLY.append(signum))
    from sigmanens_dist.training.preemption import StartupGuard

    StartupGuard.install(sys.argv[1:], noted=_EARLY)

    from sigmanens_dist.cli.train import main

    sys.exit(main())
