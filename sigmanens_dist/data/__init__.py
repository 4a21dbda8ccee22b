"""Datasets read from local files; nothing downloads."""

from __future__ import annotations

from typing import Any

__all__ = ["FASHION_MNIST_ROOT", "IdxImageDataset", "read_idx"]


def __getattr__(name: str) -> Any:
    # data.idx imports torch: importing a torch-free module of data/ (tar_samples, for predict) must not load it
    if name in __all__:
        from sigmanens_dist.data import idx

        return getattr(idx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
