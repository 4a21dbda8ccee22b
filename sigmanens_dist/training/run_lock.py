"""One owner per run directory: an advisory ``flock`` on ``<run_dir>/.lock``, held for the owner's life.

Two trainers on one run directory (a Slurm requeue racing a manual restart, a pasted command run twice) would
interleave their records and rotate each other's checkpoints away. The lock makes the second one refuse in one line
naming the holder. The kernel drops a ``flock`` when its process dies, however it dies, so a stale lock cannot
exist; the PID, host and Slurm job written into the file only name the holder in the refusal. A requeued Slurm job
may start while its own previous attempt is still checkpointing on another node: a holder with the same Slurm job id
is waited for (``wait_s``) instead of refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sigmanens_dist.atomic import check_writable_folder
from sigmanens_dist.errors import UsageError

if TYPE_CHECKING:  # torch only where a trainer takes the lock: the preemption guard reads LOCK_FILE from here
    from sigmanens_dist.distributed.env import DistEnv

__all__ = ["LOCK_FILE", "RunLock", "RunLockedError", "holder", "own_run_containing", "own_run_dir",
           "run_containing"]

LOCK_FILE = ".lock"


class RunLockedError(UsageError):
    """Another live process owns the run directory. Not recorded in the run directory: it is the holder's."""


class RunLock:
    """``with RunLock(run_dir, "train"):`` or :meth:`acquire` / :meth:`release` for an owner that outlives a block.
    ``flag`` names the folder in refusals as the user gave it (``run_dir=``; ``--out `` for predict's folder)."""

    def __init__(self, run_dir: Path | str, purpose: str, *, wait_s: float = 300.0, flag: str = "run_dir=") -> None:
        self.run_dir, self.purpose, self.wait_s, self.flag = Path(run_dir), purpose, wait_s, flag
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise :class:`RunLockedError` naming its holder (after waiting for a previous attempt
        of this same Slurm job)."""
        _make_run_dir(self.run_dir, self.flag)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                owner = holder(self.run_dir)
                for _ in range(20):  # the owner writes its name right after taking the lock
                    if owner:
                        break
                    time.sleep(0.05)
                    owner = holder(self.run_dir)
                job = os.environ.get("SLURM_JOB_ID")
                if job and owner.get("slurm_job_id") == job and time.monotonic() < deadline:
                    time.sleep(1.0)  # our own previous attempt is still finishing its checkpoint
                    continue
                os.close(fd)
                raise RunLockedError(f"{self.flag}{self.run_dir} is in use by {_describe(owner)}: one process owns "
                                     f"a folder at a time; wait for it to end, or give another "
                                     f"{self.flag.strip(' =')}") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "purpose": self.purpose,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        data = (json.dumps(info) + "\n").encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)  # the next reader finds no holder to name
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def own_run_dir(run_dir: Path, env: DistEnv, purpose: str = "trainer") -> RunLock | None:
    """The lock of a job of several ranks: rank 0 takes it (the others get None), and every rank raises rank 0's
    refusal (a second trainer on the run directory, a path that cannot be a run directory), so all stop alike."""
    # lazy: torch; `sigmanens train --help` imports this module
    from sigmanens_dist.distributed.env import all_gather_object

    lock, refusal = None, None
    if env.is_main:
        try:
            lock = RunLock(run_dir, purpose).acquire()
        except UsageError as err:
            refusal = err
    refusal = all_gather_object(refusal, env)[0]
    if refusal is not None:
        raise refusal
    return lock


def run_containing(path: Path) -> Path | None:
    """The run directory ``path`` would be written into (a folder above it with a trainer's ``config.yaml`` and
    ``checkpoints/``), or None: what ``eval`` and ``export`` lock before writing there."""
    for folder in Path(path).resolve().parents:
        if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
            return folder
    return None


def own_run_containing(path: Path, purpose: str, env: DistEnv | None = None) -> RunLock | None:
    """The lock of the run directory ``path`` would be written into (None when it is in none): a command that writes
    there (eval's report, an export) owns the run meanwhile, so a trainer still rotating its checkpoints refuses it
    in one line naming the trainer. Under several ranks (``env``) rank 0 holds it and every rank gets the refusal."""
    run_dir = run_containing(path)
    if run_dir is None:
        return None
    return own_run_dir(run_dir, env, purpose) if env is not None else RunLock(run_dir, purpose).acquire()


def _make_run_dir(run_dir: Path, flag: str) -> None:
    """Create the run directory, or say in one line why it cannot be one (what ``train --check`` checks too)."""
    check_writable_folder(run_dir, flag)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UsageError(f"{flag}{run_dir}: a part of this path is a file, not a folder") from None
    except OSError as err:
        raise UsageError(f"{flag}{run_dir} cannot be created ({err.strerror})") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}{run_dir} is not writable (read-only file system or permissions)")


def holder(run_dir: Path) -> dict[str, Any]:
    """What the owner of ``run_dir`` wrote of itself (pid, host, purpose, slurm_job_id, since); {} when unknown."""
    with contextlib.suppress(OSError, ValueError):
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text() or "{}")
        if isinstance(info, dict):
            return info
    return {}


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "another process (it has not written its name yet)"
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return (f"{owner.get('purpose', 'a process')} PID {owner.get('pid')} on host {owner.get('host')}{job}, "
            f"since {owner.get('since')}")
