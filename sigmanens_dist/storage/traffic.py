"""What remote shard reads receive, counted for the trainer's throughput line (storage/remote.py reads, the trainer
logs).

One :data:`TRAFFIC` per process: a DataLoader worker is a separate process, so it reports what it received with
each batch and the loader merges it into the trainer's count.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["TRAFFIC", "Traffic"]


class Traffic:
    """Bytes received from remote objects and downloads under way, in this process and, as reported with each batch
    (:meth:`report`, :meth:`merge`), in its DataLoader workers, which are separate processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received = 0  # bytes, every attempt's
        self.active = 0  # this process's downloads under way
        self._workers: dict[int, int] = {}  # each worker's downloads under way, as last reported
        self._reported = 0  # in a worker: the bytes already passed on
        self._since = (time.monotonic(), 0)  # the last line's time and byte count

    def add(self, received: int = 0, active: int = 0) -> None:
        with self._lock:
            self.received += received
            self.active += active

    def report(self) -> tuple[int, int]:
        """In a worker: the bytes received since the last report, and the downloads under way now."""
        with self._lock:
            new, self._reported = self.received - self._reported, self.received
            return new, self.active

    def merge(self, worker: int, received: int, active: int) -> None:
        with self._lock:
            self.received += received
            self._workers[worker] = active

    def workers_done(self) -> None:
        """The workers of an epoch have exited: their downloads are over."""
        with self._lock:
            self._workers.clear()

    def _forked(self) -> None:
        """In a forked DataLoader worker: the parent's lock may be held, and its downloads and bytes are not ours."""
        self._lock = threading.Lock()
        self.active, self._workers, self._reported = 0, {}, self.received

    def line(self) -> str | None:
        """MB/s since the last line and downloads under way; None while nothing was ever received."""
        with self._lock:
            now, received = time.monotonic(), self.received
            active = self.active + sum(self._workers.values())
            (then, before), self._since = self._since, (now, received)
        if received == 0:
            return None
        return (f"remote data: {(received - before) / 1e6 / max(now - then, 1e-9):.1f} MB/s over {now - then:.1f} s, "
                f"{received / 1e6:.1f} MB so far, {active} shard download(s) in flight")


TRAFFIC = Traffic()  # per process; a forked DataLoader worker reports what it receives with each batch
os.register_at_fork(after_in_child=TRAFFIC._forked)
