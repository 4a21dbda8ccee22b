"""The raw format (``data.format=raw``): datasets by name as users have them on disk (IDX, CIFAR batches, image
folders, SST-2 TSV) or synthetic; train sets get per-sample seeded augmentation. The other formats: ffcv_io.py,
webdataset_io.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from sigmanens_dist.catalog.datasets import DATASETS, take_randaugment
from sigmanens_dist.config import DataConfig
from sigmanens_dist.config.schema import AugMixConfig
from sigmanens_dist.data.idx import IdxImageDataset
from sigmanens_dist.data.sampler import seeded
from sigmanens_dist.data.sst2 import build_sst2
from sigmanens_dist.errors import MissingPathError, UsageError

__all__ = ["IMAGE_FOLDERS", "READERS", "DataBundle", "Evaluated", "PixelAugMix", "SeededAugment", "SyntheticImages",
           "augmix_at_severity", "build_datasets", "image_folder_transforms", "split_indices", "timm_train_transform"]



@dataclass
class DataBundle:
    """Train (augmenting, keyed by ``(index, seed)``), validation (carved from the training samples, or the test set
    with ``data.val_from_test``), test and, with ``data.calib_split``, calibration datasets; all but train read
    without augmentation."""

    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    in_chans: int  # 0 for text
    vocab_size: int | None = None  # text only: the tokenizer's, which a from-scratch backbone's embeddings must fit
    val_indices: list[int] = field(default_factory=list)  # positions in the training pool the val split took
    calib: Dataset | None = None  # the calibration split (data.calib_split): what post-hoc fits read; None when 0
    calib_indices: list[int] = field(default_factory=list)  # positions in the training pool the calib split took


class SeededAugment(Dataset):
    """Applies ``transform`` under a per-sample seed carried in the index: ``ds[(i, seed)]``. Augmentation then
    depends only on the sample's place in the global order, never on worker, rank or resume point."""

    def __init__(self, dataset: Dataset, transform: Any) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        with seeded(seed):
            x, y = self.dataset[index]
            return (self.transform(x) if self.transform is not None else x), y


class Evaluated(Dataset):
    """``dataset``'s samples as stored, through the deterministic evaluation ``transform``: the val and test sets.
    Converters unwrap it (``sources.unwrap_source``), as they unwrap :class:`SeededAugment`, and store the samples
    as they are on disk; the converted formats apply the evaluation transform when they read."""

    def __init__(self, dataset: Dataset, transform: Any) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        x, y = self.dataset[index]
        return self.transform(x), y


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


def split_indices(num_samples: int, val_split: float | int, seed: int, calib_split: int = 0
                  ) -> tuple[list[int], list[int], list[int]]:
    """``(train, val, calib)`` positions of a training pool of ``num_samples``: ``val_split`` (a fraction, rounded,
    at least one sample; or a count) and then ``calib_split`` (a count) drawn by one permutation from ``seed`` alone,
    each list in increasing order. The same seed gives the same split on every rank, format-independent and
    resumable; the validation samples do not depend on ``calib_split`` (it takes the next ones of the permutation),
    so runs with and without a calibration split validate on the same samples."""
    n_val = 0 if val_split == 0 else (max(1, round(val_split * num_samples)) if isinstance(val_split, float)
                                      else int(val_split))
    if n_val >= num_samples:
        raise UsageError(f"data.val_split={val_split} takes {n_val} of the {num_samples} training samples, leaving "
                         "none to train on; lower data.val_split (or raise data.train_subset)")
    if n_val + calib_split >= num_samples:
        raise UsageError(f"data.calib_split={calib_split} with data.val_split={val_split} takes {n_val + calib_split} "
                         f"of the {num_samples} training samples, leaving none to train on; lower data.calib_split "
                         "(or raise data.train_subset)")
    if n_val + calib_split == 0:
        return list(range(num_samples)), [], []
    # Its own stream, offset from the seed so the split does not follow the first epoch's shuffle.
    perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + 0x5EED))
    cut = n_val + calib_split
    return sorted(perm[cut:].tolist()), sorted(perm[:n_val].tolist()), sorted(perm[n_val:cut].tolist())


@dataclass
class _Parts:
    """A dataset's training pool and test set as stored (what ``sigmanens data convert`` writes), the transforms
    that make a stored sample a training or an evaluation input, and its shape."""

    train: Dataset
    test: Dataset
    augment: Any
    evaluate: Any  # None: a stored sample is already the model's input (IDX pixels are normalised as they are read)
    num_classes: int
    in_chans: int
    vocab_size: int | None = None


def build_datasets(data_cfg: DataConfig, root: Path | None, randaugment: str | None = None,
                   augmix: AugMixConfig | None = None) -> DataBundle:
    """Train, validation and test datasets for ``data.dataset``; nothing downloads.

    The training pool is the first ``data.train_subset`` training samples; ``data.val_split`` of them become the
    validation set and ``data.calib_split`` more the calibration set (both drawn from ``data.split_seed``), the rest
    the training set. The test set (``data.test_subset``) is never trained on nor validated on, unless
    ``data.val_from_test`` makes it the validation set.

    With ``augmix`` (``train.augmix``; the config allows it for the datasets the table marks ``augmix``) each training
    sample goes through :class:`PixelAugMix` after the reader's own augmentation, as in the AugMix paper's recipe
    (crop and flip, then AugMix, then the network)."""
    parts = _parts(data_cfg, root, randaugment)
    train_idx, val_idx, calib_idx = split_indices(len(parts.train), data_cfg.val_split, data_cfg.split_seed,
                                                  data_cfg.calib_split)
    augment = parts.augment
    if augmix is not None:
        spec = DATASETS[data_cfg.dataset]
        augment = v2.Compose([augment, PixelAugMix(augmix, spec.mean, spec.std)])
    train = SeededAugment(_take(parts.train, train_idx), augment)
    test = _evaluated(_subset(parts.test, data_cfg.test_subset), parts.evaluate)
    val = _evaluated(_subset(_take(parts.train, val_idx), data_cfg.val_subset) if val_idx
                     else _subset(parts.test, data_cfg.val_subset), parts.evaluate)
    calib = _evaluated(_take(parts.train, calib_idx), parts.evaluate) if calib_idx else None
    return DataBundle(train, val, test, parts.num_classes, parts.in_chans, parts.vocab_size, val_idx, calib,
                      calib_idx)


class PixelAugMix:
    """torchvision's AugMix (``v2.AugMix``, ``all_ops=False``) of a normalised float image: AugMix works on uint8
    pixels, so the image is taken back to them (mean and std undone, rounded, clamped to 0–255), augmixed and
    normalised again. ``all_ops=False`` keeps to the operations disjoint from the test corruptions (no brightness,
    contrast, colour, sharpness). Every draw is from torch's CPU generator, which :class:`SeededAugment` seeds per
    sample: a resumed run replays the same pixels."""

    def __init__(self, cfg: AugMixConfig, mean: Sequence[float], std: Sequence[float]) -> None:
        self.cfg, self.stats = cfg, (tuple(mean), tuple(std))
        self.augmix = v2.AugMix(severity=cfg.severity, mixture_width=cfg.mixture_width, chain_depth=cfg.chain_depth,
                                alpha=cfg.alpha, all_ops=False)
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        pixels = ((image * self.std + self.mean) * 255).round().clamp(0, 255).to(torch.uint8)
        return (self.augmix(pixels).float() / 255 - self.mean) / self.std

    def at_severity(self, severity: int) -> PixelAugMix:
        """This AugMix with another severity (``train.augmix.member_severity``'s entry of one member)."""
        return PixelAugMix(self.cfg.model_copy(update={"severity": severity}), *self.stats)


def augmix_at_severity(train: SeededAugment, severity: int) -> SeededAugment:
    """``build_datasets``' augmixed training set with AugMix at ``severity``: the same samples (shared, not copied)
    and the same reader augmentation before it, so member k of ``train.augmix.member_severity`` reads its own
    strength under the same per-sample seeds (a resumed run replays it)."""
    compose = train.transform
    assert isinstance(compose, v2.Compose) and isinstance(compose.transforms[-1], PixelAugMix), \
        "the training set was built without train.augmix"
    *before, augmix = compose.transforms
    return SeededAugment(train.dataset, v2.Compose([*before, augmix.at_severity(severity)]))


def _take(ds: Dataset, indices: list[int]) -> Dataset:
    return ds if indices == list(range(len(ds))) else torch.utils.data.Subset(ds, indices)


def _evaluated(ds: Dataset, transform: Any) -> Dataset:
    return ds if transform is None else Evaluated(ds, transform)


def _parts(data_cfg: DataConfig, root: Path | None, randaugment: str | None) -> _Parts:
    return READERS[data_cfg.dataset](data_cfg, root, randaugment)


def _synthetic(data_cfg: DataConfig, root: Path | None, randaugment: str | None) -> _Parts:
    size = data_cfg.img_size or 16
    train = SyntheticImages(data_cfg.train_subset or 2048, size=size, seed=0)
    test = SyntheticImages(data_cfg.test_subset or 512, size=size, seed=1)
    return _Parts(train, test, v2.RandomHorizontalFlip(), None, train.num_classes, train.in_chans)


def _fashion_mnist(data_cfg: DataConfig, root: Path | None, randaugment: str | None) -> _Parts:
    train = IdxImageDataset(root, "train", subset=data_cfg.train_subset)
    # subset here, not by a Subset wrapper: converters read IdxImageDataset's stored uint8 pixels
    test = IdxImageDataset(root, "test", subset=data_cfg.test_subset)
    size = data_cfg.img_size or 28
    black = -train.mean / train.std  # images are already normalised: pad with the value of a black pixel
    aug = [v2.RandomCrop(28, padding=2, fill=black), v2.RandomHorizontalFlip()]
    evaluate = None
    if size != 28:
        aug.append(v2.Resize(size, antialias=True))
        evaluate = v2.Resize(size, antialias=True)
    return _Parts(train, test, v2.Compose(aug), evaluate, train.num_classes, train.in_chans)


def _sst2(data_cfg: DataConfig, root: Path | None, randaugment: str | None) -> _Parts:
    train, test, vocab_size = build_sst2(data_cfg, root)
    # No text augmentation; SeededAugment still gives the (index, seed) keys the train stream fetches by.
    return _Parts(train, test, None, None, 2, 0, vocab_size)


def _cifar(data_cfg: DataConfig, root: Path, randaugment: str | None) -> _Parts:
    name = data_cfg.dataset
    cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
    mean, std = DATASETS[name].mean, DATASETS[name].std  # each CIFAR its own statistics
    to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
    try:  # PIL images as stored; to_tensor is applied by build_datasets (and by nothing that converts them)
        train = cls(str(root), train=True, download=False)
        test = cls(str(root), train=False, download=False)
    except RuntimeError as err:
        raise MissingPathError(f"data.root={root}: no {name} python-pickle batches there ({err}); expected "
                               f"{cls.base_folder}/ as extracted from the official {name}-python.tar.gz") from err
    aug = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), to_tensor])
    return _Parts(_subset(train, data_cfg.train_subset), test, aug, to_tensor, len(train.classes), 3)


#: the datasets read as ImageFolder trees, through timm's ImageNet recipe (train.randaugment included): those the
#: dataset table marks ``randaugment``; webdataset reads their conversions with the same transforms
IMAGE_FOLDERS = tuple(take_randaugment())


def image_folder_transforms(dataset: str, size: int, randaugment: str | None) -> tuple[v2.Compose, v2.Compose]:
    """``(train, eval)`` transforms of an ImageFolder image (PIL, any mode) to a normalised ``(3, size, size)`` float
    tensor: timm's ImageNet recipe (random-resized crop, flip, colour jitter or ``randaugment``; resize to
    ``size / 0.875`` and centre crop). The raw reader and webdataset (on the converted folder) both use them, so the
    two formats train and evaluate on the same pixels."""
    from timm.data import create_transform  # lazy: timm, only for the image-folder and auto-augment recipes

    mean, std = DATASETS[dataset].mean, DATASETS[dataset].std
    train = timm_train_transform(size, randaugment, mean, std)
    return v2.Compose([_rgb, train]), v2.Compose([_rgb, create_transform(size, is_training=False, mean=mean, std=std)])


def timm_train_transform(size: int, randaugment: str | None, mean: Sequence[float],
                         std: Sequence[float]) -> Callable[[Image.Image], torch.Tensor]:
    """timm's ImageNet training transform (``create_transform``), its posterize steps keeping Pillow's old meaning
    of 0 bits: the black image. timm asks for 0 bits at its strongest magnitude (``rand-m9-mstd0.5-inc1`` draws it
    in 1 of 44 of its posterize steps, about one image in 660; ``Posterize`` below magnitude 2.5), which Pillow 13
    refuses with a ValueError, so a batch or two into an epoch."""
    from timm.data import create_transform  # lazy: timm, only for the image-folder and auto-augment recipes
    from timm.data.auto_augment import AugmentOp, posterize

    train = create_transform(size, is_training=True, auto_augment=randaugment, mean=tuple(mean), std=tuple(std))
    for step in train.transforms:  # RandAugment and AugMix hold ``ops``, AutoAugment a ``policy`` of op lists
        ops = [*getattr(step, "ops", []), *(op for sub in getattr(step, "policy", []) for op in sub)]
        for op in ops:
            if isinstance(op, AugmentOp) and op.aug_fn is posterize:
                op.aug_fn = _posterize
    return train


def _posterize(image: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's posterize, 0 bits kept giving the black image, as Pillow before 13 did."""
    from timm.data.auto_augment import posterize  # lazy: timm, only for the image-folder and auto-augment recipes

    if bits_to_keep <= 0:
        return image.point([0] * 256 * len(image.getbands()))
    return posterize(image, bits_to_keep)


def _rgb(image: Image.Image) -> Image.Image:
    """RGB as ImageFolder's loader makes it: shards keep a grayscale JPEG's one channel."""
    return image if image.mode == "RGB" else image.convert("RGB")


def _image_folder(data_cfg: DataConfig, root: Path, randaugment: str | None) -> _Parts:
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise MissingPathError(f"data.root={root}: expected ImageFolder sub-folders train/ and val/ "
                                   f"(one folder per class); {root / split} is missing")
    train = datasets.ImageFolder(str(root / "train"))  # PIL images as stored: converters read these
    test = datasets.ImageFolder(str(root / "val"))
    if train.classes != test.classes:
        raise UsageError(f"{root}: train/ and val/ have different class folders")
    aug, evaluate = image_folder_transforms(data_cfg.dataset, data_cfg.img_size or 224, randaugment)
    return _Parts(_subset(train, data_cfg.train_subset), test, aug, evaluate, len(train.classes), 3)


#: data.dataset → its reader of the native files; the keys are catalog/datasets.py's DATASETS (a test holds them equal)
READERS: dict[str, Callable[[DataConfig, Path | None, str | None], _Parts]] = {
    "fashion_mnist": _fashion_mnist, "cifar10": _cifar, "cifar100": _cifar, "imagenet": _image_folder,
    "imagefolder": _image_folder, "synthetic": _synthetic, "sst2": _sst2}
