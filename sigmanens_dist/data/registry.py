"""Datasets by name, in the formats users have on disk; train sets get per-sample seeded augmentation."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from sigmanens_dist.data.idx import IdxImageDataset
from sigmanens_dist.datasets import DATASETS

__all__ = ["DataBundle", "SeededAugment", "SyntheticImages", "build_datasets"]



@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    num_classes: int
    in_chans: int  # 0 for text
    vocab_size: int | None = None  # text only: the tokenizer's, which a from-scratch backbone's embeddings must fit


class SeededAugment(Dataset):
    """Applies ``transform`` under a per-sample seed carried in the index: ``ds[(i, seed)]``. Augmentation then
    depends only on the sample's place in the global order, never on worker, rank or resume point."""

    def __init__(self, dataset: Dataset, transform: Any) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        torch_state, py_state = torch.get_rng_state(), random.getstate()
        torch.default_generator.manual_seed(seed)  # CPU generator only: torch.manual_seed would also seed CUDA
        random.seed(seed)  # timm's RandAugment draws from python's random
        try:
            x, y = self.dataset[index]
            return (self.transform(x) if self.transform is not None else x), y
        finally:
            torch.set_rng_state(torch_state)
            random.setstate(py_state)


class SyntheticImages(Dataset):
    """Generated, learnable images: a fixed random template per class plus noise (tests and smoke runs)."""

    def __init__(self, num_samples: int, num_classes: int = 10, in_chans: int = 3, size: int = 16,
                 seed: int = 0, noise: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        templates = torch.randn(num_classes, in_chans, size, size, generator=torch.Generator().manual_seed(1234))
        self.labels = torch.randint(0, num_classes, (num_samples,), generator=g)
        self.images = templates[self.labels] + noise * torch.randn(num_samples, in_chans, size, size, generator=g)
        self.num_classes, self.in_chans = num_classes, in_chans

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


def _subset(ds: Dataset, n: int | None) -> Dataset:
    if n is None or n >= len(ds):
        return ds
    return torch.utils.data.Subset(ds, range(n))


def build_datasets(data_cfg: Any, root: Path | None, randaugment: str | None = None) -> DataBundle:
    """Train (augmenting, keyed by ``(index, seed)``) and val datasets for ``data.dataset``; nothing downloads."""
    name = data_cfg.dataset
    if name == "synthetic":
        size = data_cfg.img_size or 16
        train = SyntheticImages(data_cfg.train_subset or 2048, size=size, seed=0)
        val = SyntheticImages(data_cfg.val_subset or 512, size=size, seed=1)
        flip = v2.RandomHorizontalFlip()
        return DataBundle(SeededAugment(train, flip), val, train.num_classes, train.in_chans)
    if name == "fashion_mnist":
        train = IdxImageDataset(root, "train", subset=data_cfg.train_subset)
        val = IdxImageDataset(root, "test", subset=data_cfg.val_subset)
        size = data_cfg.img_size or 28
        black = -train.mean / train.std  # images are already normalised: pad with the value of a black pixel
        aug = [v2.RandomCrop(28, padding=2, fill=black), v2.RandomHorizontalFlip()]
        if size != 28:
            aug.append(v2.Resize(size, antialias=True))
            val = _Resized(val, size)
        return DataBundle(SeededAugment(train, v2.Compose(aug)), val, train.num_classes, train.in_chans)
    if name in ("cifar10", "cifar100"):
        return _cifar(name, root, data_cfg)
    if name in ("imagenet", "imagefolder"):
        return _image_folder(root, data_cfg, randaugment)
    if name == "sst2":
        from sigmanens_dist.data.sst2 import build_sst2

        train, val, vocab_size = build_sst2(data_cfg, root)
        # No text augmentation; SeededAugment still gives the (index, seed) keys the train stream fetches by.
        return DataBundle(SeededAugment(train, None), val, 2, 0, vocab_size)
    raise ValueError(f"data.dataset={name!r} is not one of {', '.join(DATASETS)}")


class _Resized(Dataset):
    def __init__(self, dataset: Dataset, size: int) -> None:
        self.dataset, self.resize = dataset, v2.Resize(size, antialias=True)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        x, y = self.dataset[index]
        return self.resize(x), y


def _cifar(name: str, root: Path, data_cfg: Any) -> DataBundle:
    from torchvision import datasets

    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    mean, std = DATASETS[name].mean, DATASETS[name].std  # each CIFAR its own statistics
    to_tensor = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    try:
        train = cls(str(root), train=True, download=False)
        val = cls(str(root), train=False, download=False, transform=v2.Compose(to_tensor))
    except RuntimeError as err:
        raise FileNotFoundError(f"data.root={root}: no {name} python-pickle batches there ({err}); expected "
                                f"{cls.base_folder}/ as extracted from the official {name}-python.tar.gz") from err
    aug = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), *to_tensor])
    return DataBundle(SeededAugment(_subset(train, data_cfg.train_subset), aug), _subset(val, data_cfg.val_subset),
                      len(train.classes), 3)


def _image_folder(root: Path, data_cfg: Any, randaugment: str | None) -> DataBundle:
    from timm.data import create_transform
    from torchvision import datasets

    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise FileNotFoundError(f"data.root={root}: expected ImageFolder sub-folders train/ and val/ "
                                    f"(one folder per class); {root / split} is missing")
    size = data_cfg.img_size or 224
    train = datasets.ImageFolder(str(root / "train"))
    val = datasets.ImageFolder(str(root / "val"), transform=create_transform(size, is_training=False))
    if train.classes != val.classes:
        raise ValueError(f"{root}: train/ and val/ have different class folders")
    aug = create_transform(size, is_training=True, auto_augment=randaugment)
    return DataBundle(SeededAugment(_subset(train, data_cfg.train_subset), aug), _subset(val, data_cfg.val_subset),
                      len(train.classes), 3)
