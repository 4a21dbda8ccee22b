"""Every dataset the project knows, named once: what it is, how it is normalised, where it lives by default, how
to get it, whether ``sigmanens data convert`` can write it as FFCV / webdataset, and whether its readers apply
``train.randaugment`` and ``train.augmix``.

The config validates ``data.dataset`` against :data:`DATASETS`, the readers and decoders normalise with its
statistics, the converter offers what it marks convertible, the config refuses ``train.randaugment`` and
``train.augmix`` for a dataset that does not take them. No torch import here: the config reads it before any heavy
module loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sigmanens_dist.errors import MissingPathError
from sigmanens_dist.storage.remote import RemotePath

__all__ = ["CLASSES_FILE", "DATASETS", "FASHION_MNIST_ROOT", "DatasetName", "DatasetSpec", "converted_classes_file",
           "convertible", "resolve_root", "take_augmix", "take_randaugment"]

CLASSES_FILE = "classes.json"  # what `sigmanens data convert` writes last: a converted folder is one that has it

FASHION_MNIST_ROOT = Path("/usr/share/datasets/fashion-mnist")
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm's IMAGENET_DEFAULT_*
# Class names by label index, as the datasets' own files give them (CIFAR: batches.meta / meta, in label order).
_FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                          "Ankle boot")
_CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_CIFAR100_CLASSES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
    "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
    "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish", "forest",
    "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard",
    "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange", "orchid",
    "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine", "possum",
    "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper",
    "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank", "telephone",
    "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf",
    "woman", "worm")


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    kind: Literal["image", "text", "synthetic"]
    hint: str  # how to get it, shown when data.root is unset or missing
    mean: tuple[float, ...] = ()  # images: per-channel statistics used by every reader and decoder
    std: tuple[float, ...] = ()
    size: int = 0  # images: native side length
    default_root: Path | None = None
    classes: tuple[str, ...] = ()  # class names by label index where fixed by the dataset; folders: read from disk
    # whether every reader of it (raw, webdataset, FFCV) applies train.randaugment; the config refuses it elsewhere
    randaugment: bool = False
    # whether its raw reader's training samples (normalised float images with mean and std above) go through
    # train.augmix; webdataset and FFCV keep their own crop recipe, so the config refuses it with them
    augmix: bool = False

    @property
    def convertible(self) -> bool:
        """Whether ``sigmanens data convert`` writes it (real image and text datasets; not generated ones)."""
        return self.kind != "synthetic"


DATASETS: dict[str, DatasetSpec] = {s.name: s for s in (
    DatasetSpec("fashion_mnist", "image", "install it with `apt-get install dataset-fashion-mnist`, or set data.root "
                "to a folder with the four Fashion-MNIST idx files", (0.2860,), (0.3530,), 28, FASHION_MNIST_ROOT,
                _FASHION_MNIST_CLASSES, augmix=True),
    DatasetSpec("cifar10", "image", "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html "
                "and extract it into data.root (giving data.root/cifar-10-batches-py/)",
                (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 32, classes=_CIFAR10_CLASSES, augmix=True),
    DatasetSpec("cifar100", "image", "download cifar-100-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html"
                " and extract it into data.root (giving data.root/cifar-100-python/)",
                (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), 32, classes=_CIFAR100_CLASSES, augmix=True),
    DatasetSpec("imagenet", "image", "point data.root at the ILSVRC-2012 folder with train/ and val/ class folders "
                "(format: raw) or at the FFCV .beton files (format: ffcv)", _IMAGENET_MEAN, _IMAGENET_STD, 224,
                randaugment=True),
    DatasetSpec("imagefolder", "image", "point data.root at a folder with train/ and val/ sub-folders, one folder per "
                "class", _IMAGENET_MEAN, _IMAGENET_STD, 224, randaugment=True),
    DatasetSpec("synthetic", "synthetic", "generated in memory; needs no data.root"),
    DatasetSpec("sst2", "text", "point data.root at the GLUE SST-2 folder (train.tsv, dev.tsv; format: raw) or at "
                "what `sigmanens data convert --dataset sst2` wrote (format: ffcv or webdataset)"),
)}

DatasetName = Literal[tuple(DATASETS)]  # the config's type for data.dataset


def convertible() -> list[str]:
    return [name for name, spec in DATASETS.items() if spec.convertible]


def take_randaugment() -> list[str]:
    """The datasets whose readers apply ``train.randaugment``: what the config's refusal names as allowed."""
    return [name for name, spec in DATASETS.items() if spec.randaugment]


def take_augmix() -> list[str]:
    """The datasets whose raw reader applies ``train.augmix``: what the config's refusal names as allowed."""
    return [name for name, spec in DATASETS.items() if spec.augmix]


def resolve_root(dataset: str, root: Path | None) -> Path | None:
    """``root``, or the dataset's default folder; None for generated data."""
    spec = DATASETS[dataset]
    if spec.kind == "synthetic":
        return None
    return root if root is not None else spec.default_root


def converted_classes_file(fmt: str, root: Path | RemotePath) -> Path | RemotePath:
    """The ``classes.json`` of data converted to ``fmt`` at ``root`` (a folder, or a URL: asked with one HEAD), or a
    :class:`MissingPathError` naming the command that writes it: what the trainer reads first, and what ``sigmanens
    train --check`` asks too."""
    classes_file = root / CLASSES_FILE
    if not classes_file.is_file():
        raise MissingPathError(f"{classes_file} is missing: write {fmt} data with `sigmanens data convert --format "
                               f"{fmt} --out {root} …`")
    return classes_file
