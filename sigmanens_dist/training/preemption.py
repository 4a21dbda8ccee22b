"""Preemption: a signal becomes "finish this step, checkpoint on every rank, write a marker, exit 75".

SIGUSR1 (Slurm's ``--signal``) and SIGTERM (Slurm's preemption, torchrun forwarding a signal) only set a flag; the
loop acts between steps, so a signal can never interrupt a checkpoint write. The ranks agree on the flag with an
all-reduce started after one step and read after the next (``PreemptionCheck``), so the hot loop never blocks on it:
a signal is acted on within two steps of its arrival. Once the preemption checkpoint is complete, rank 0 writes
``<run_dir>/preempted.json``: a batch script requeues on that marker, not on an exit status that torchrun rewrites.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a run polls: `sigmanens study` reads EXIT_PREEMPTED and MARKER from here
    import torch

    from sigmanens_dist.distributed.env import DistEnv

from sigmanens_dist.atomic import write_text
from sigmanens_dist.training.run_lock import LOCK_FILE, holder

__all__ = ["EXIT_PREEMPTED", "MARKER", "PreemptionCheck", "PreemptionFlag", "StartupGuard", "clear_marker",
           "write_marker"]

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "checkpointed after a signal, requeue me", for a batch script to test
MARKER = "preempted.json"


class PreemptionFlag:
    """Installs the handlers on ``__enter__`` and restores the previous ones on ``__exit__`` (a library must not
    leave process-wide handlers behind)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)) -> None:
        self.signals = signals
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionFlag:
        for sig in self.signals:
            previous = signal.signal(sig, self._handle)
            # the start-up guard's time ends here: once training is over a signal is not "before the first step"
            self._previous[sig] = signal.SIG_DFL if previous == StartupGuard._exit else previous
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:
            log.warning("received %s: will checkpoint within two steps and exit with status %d",
                        signal.Signals(signum).name, EXIT_PREEMPTED)
        self.signum = signum

    @property
    def raised(self) -> bool:
        return self.signum is not None


class PreemptionCheck:
    """True on every rank once any rank's flag was set, one step late on several ranks: the all-reduce launched
    after step t is waited for after step t+1, by which time it has long completed (no per-step host sync). The
    ranks reduce the signal numbers (max: SIGTERM, which must not be requeued, wins over SIGUSR1), so every rank
    knows which signal arrived, wherever it arrived (``signum``)."""

    def __init__(self, flag: PreemptionFlag, env: DistEnv) -> None:
        import torch  # torch only where a run polls (see the top)
        import torch.distributed as dist

        self.flag, self.env = flag, env
        self.signum: int | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._device = env.device if env.distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    def poll(self) -> bool:
        import torch  # torch only where a run polls (see the top)
        import torch.distributed as dist

        if not self.env.distributed:
            self.signum = self.flag.signum
            return self.flag.raised
        agreed = False
        if self._pending is not None:
            work, value = self._pending
            work.wait()
            agreed = bool(value.item())
            self.signum = int(value.item()) or None
        value = torch.tensor([self.flag.signum or 0], device=self._device)
        self._pending = (dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True), value)
        return agreed

    def drain(self) -> None:
        """Complete the outstanding all-reduce (every rank must, before the process group is torn down)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


def write_marker(run_dir: Path, step: int | None, signum: int | None) -> Path:
    """Atomically write the marker that says "a complete preemption checkpoint of ``step`` exists" (``step`` None:
    the signal came before the first step, so the run's newest checkpoint, if any, is where it continues)."""
    name = signal.Signals(signum).name if signum is not None else "unknown"
    when = {"when": "before the first step"} if step is None else {}
    return write_text(Path(run_dir) / MARKER, json.dumps({"step": step, "signal": name, **when}))


class StartupGuard:
    """Preemption from the first instruction of the trainer's process until :class:`PreemptionFlag` takes over: a
    SIGTERM or SIGUSR1 during imports, config checks or set-up (seconds to minutes on a busy node) exits at once
    with ``EXIT_PREEMPTED`` and, on rank 0, the marker saying "before the first step" (nothing to checkpoint yet),
    so a batch script tells a preemption from a crash. The marker goes into the run directory only when no other
    live process owns it (its lock is free or ours)."""

    run_dir: Path | None = None

    @classmethod
    def install(cls, argv: list[str], noted: Sequence[int] = ()) -> None:
        """``argv``'s ``run_dir=`` override (what the Slurm scripts pass) names the run directory until the config
        is read (:meth:`set_run_dir`). ``noted``: signals a handler installed before this module's import recorded
        (the trainer's first statement), answered now."""
        found = [a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")]
        cls.run_dir = Path(found[-1]) if found else None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, cls._exit)
        if noted:
            cls._exit(noted[0], None)

    @classmethod
    def set_run_dir(cls, run_dir: Path | str) -> None:
        cls.run_dir = Path(run_dir)

    @classmethod
    def stand_down(cls) -> None:
        """Training is over: default handlers again (a library must not leave process-wide handlers behind)."""
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            if signal.getsignal(sig) == cls._exit:
                signal.signal(sig, signal.SIG_DFL)

    @classmethod
    def _exit(cls, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        print(f"received {name} before the first step: nothing to checkpoint yet; exiting with status "
              f"{EXIT_PREEMPTED}", file=sys.stderr, flush=True)
        if cls.run_dir is not None and os.environ.get("RANK", "0") == "0" and _free_or_ours(cls.run_dir):
            write_marker(cls.run_dir, None, signum)
        os._exit(EXIT_PREEMPTED)


def _free_or_ours(run_dir: Path) -> bool:
    """Whether no other process holds the run directory's lock (a flock is per open file: ours, taken through
    another descriptor, is refused here too, so the holder's PID tells)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return holder(run_dir).get("pid") == os.getpid()
    finally:
        os.close(fd)


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / MARKER).unlink(missing_ok=True)
