"""Datasets read from local files; nothing downloads."""

from sigmanens_dist.data.idx import FASHION_MNIST_ROOT, IdxImageDataset, read_idx

__all__ = ["FASHION_MNIST_ROOT", "IdxImageDataset", "read_idx"]
