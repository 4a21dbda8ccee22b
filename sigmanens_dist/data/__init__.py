"""Datasets read from local files; nothing downloads."""

from __future__ import annotations

from typing import Any

__all__ = ["FASHION_MNIST_ROOT", "IdxImageDataset", "read_idx"]


def __getattr__(name: str) -> Any:
    # data.idx imports torch; the config (data.datasets) and the command line do not need it
    if name in __all__:
        from sigmanens_dist.data import idx

        return getattr(idx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
