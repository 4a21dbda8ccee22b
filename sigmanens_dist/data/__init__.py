"""The data a run trains and is scored on: raw datasets from local files (nothing is downloaded: a missing dataset is
one line naming where to put it), FFCV ``.beton`` files and webdataset shards, local or streamed over HTTP/S3 with a
node-local shard cache; the loaders, the resumable sampler, augmentations (AugMix, per-member streams), corruptions,
OOD sets, and ``sigmanens data convert``."""

from __future__ import annotations

from typing import Any

__all__ = ["FASHION_MNIST_ROOT", "IdxImageDataset", "read_idx"]


def __getattr__(name: str) -> Any:
    # data.idx imports torch: importing a torch-free module of data/ (tar_samples, for predict) must not load it
    if name in __all__:
        from sigmanens_dist.data import idx

        return getattr(idx, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
