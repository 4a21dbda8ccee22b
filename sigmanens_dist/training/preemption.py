"""Preemption: a signal becomes "finish this step, checkpoint on every rank, write a marker, exit 75".

SIGUSR1 (Slurm's ``--signal``) and SIGTERM (Slurm's preemption, torchrun forwarding a signal) only set a flag; the
loop acts between steps, so a signal can never interrupt a checkpoint write. The ranks agree on the flag with an
all-reduce started after one step and read after the next (``PreemptionCheck``), so the hot loop never blocks on it:
a signal is acted on within two steps of its arrival. Once the preemption checkpoint is complete, rank 0 writes
``<run_dir>/preempted.json``: a batch script requeues on that marker, not on an exit status that torchrun rewrites.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a run polls: `sigmanens study` reads EXIT_PREEMPTED and MARKER from here
    import torch

    from sigmanens_dist.distributed.env import DistEnv

from sigmanens_dist.atomic import write_text

__all__ = ["EXIT_PREEMPTED", "MARKER", "PreemptionCheck", "PreemptionFlag", "clear_marker", "write_marker"]

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
            self._previous[sig] = signal.signal(sig, self._handle)
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
        import torch
        import torch.distributed as dist

        self.flag, self.env = flag, env
        self.signum: int | None = None
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._device = env.device if env.distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    def poll(self) -> bool:
        import torch
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


def write_marker(run_dir: Path, step: int, signum: int | None) -> Path:
    """Atomically write the marker that says "a complete preemption checkpoint of ``step`` exists"."""
    name = signal.Signals(signum).name if signum is not None else "unknown"
    return write_text(Path(run_dir) / MARKER, json.dumps({"step": step, "signal": name}))


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / MARKER).unlink(missing_ok=True)
