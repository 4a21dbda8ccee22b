"""Training throughput: images per second of training time, evaluation and checkpoints excluded."""

from __future__ import annotations

import time

import torch

__all__ = ["Throughput"]


class Throughput:
    """Images per second of training time (evaluation and checkpoints excluded), per log window and overall.

    On a CUDA device each step is timed by CUDA events recorded at its start and end: a step's time is when the
    GPU finished its work, not when the host finished queueing it (the host runs ahead, and the GPU would catch up
    outside the window, at the next synchronisation). On the CPU the clock is read at both ends."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.images = self.seconds = self.all_images = self.all_seconds = 0.0
        self.stream = torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    def start(self) -> torch.cuda.Event | float:
        """Mark the start of a step; pass what it returns to :meth:`stop`."""
        if self.stream is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def stop(self, start: torch.cuda.Event | float, images: int) -> None:
        """Mark the end of the step begun at ``start``, which trained on ``images`` images (read lazily on a GPU:
        the events are read when a rate is asked for, so a step never waits for the GPU here)."""
        if isinstance(start, float):
            self.add(time.perf_counter() - start, images)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self.pending.append((start, end, images))

    def add(self, seconds: float, images: int) -> None:
        self.seconds += seconds
        self.images += images
        self.all_seconds += seconds
        self.all_images += images

    def _settle(self) -> None:
        """Add the GPU-timed steps, waiting for the last one's end."""
        for start, end, images in self.pending:
            end.synchronize()
            self.add(start.elapsed_time(end) / 1e3, images)
        self.pending.clear()

    def take_rate(self) -> float:
        self._settle()
        rate = self.images / max(self.seconds, 1e-9)
        self.images = self.seconds = 0.0
        return rate

    def total_rate(self) -> float:
        self._settle()
        return self.all_images / max(self.all_seconds, 1e-9)
