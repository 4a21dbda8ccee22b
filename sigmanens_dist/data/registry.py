"""Deprecated since 0.3: the raw-format datasets are :mod:`sigmanens_dist.data.raw`; this module re-exports them for
one release."""

import warnings

from sigmanens_dist.data.raw import (
    DataBundle,
    Resized,
    SeededAugment,
    SyntheticImages,
    build_datasets,
    split_indices,
)

__all__ = ["DataBundle", "Resized", "SeededAugment", "SyntheticImages", "build_datasets", "split_indices"]

warnings.warn("sigmanens_dist.data.registry moved to sigmanens_dist.data.raw", DeprecationWarning, stacklevel=2)
