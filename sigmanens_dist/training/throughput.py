"""Training throughput: images per second of training time, evaluation and checkpoints excluded."""

from __future__ import annotations

__all__ = ["Throughput"]


class Throughput:
    """Images per second of training time (evaluation and checkpoints excluded), per log window and overall."""

    def __init__(self) -> None:
        self.images = self.seconds = self.all_images = self.all_seconds = 0.0

    def add(self, seconds: float, images: int) -> None:
        self.seconds += seconds
        self.images += images
        self.all_seconds += seconds
        self.all_images += images

    def take_rate(self) -> float:
        rate = self.images / max(self.seconds, 1e-9)
        self.images = self.seconds = 0.0
        return rate

    def total_rate(self) -> float:
        return self.all_images / max(self.all_seconds, 1e-9)
