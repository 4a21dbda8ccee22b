"""Out-of-distribution sets: scikit-learn's digits for Fashion-MNIST models, SVHN for CIFAR models (scored by
:mod:`sigmanens_dist.evaluation.ood`)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.data.idx import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from sigmanens_dist.errors import MissingPathError, UsageError

__all__ = ["SVHNOOD", "DigitsOOD"]


class DigitsOOD(Dataset):
    """scikit-learn's 1,797 8×8 handwritten digits (they ship with scikit-learn: nothing downloads), made to look
    like Fashion-MNIST input: upsampled to 28×28, scaled to [0, 1] and normalised with Fashion-MNIST's mean and std,
    one channel. Items are ``(image (1, 28, 28), digit)``; the digit is not a Fashion-MNIST class."""

    def __init__(self, size: int = 28) -> None:
        from sklearn.datasets import load_digits  # heavy: scikit-learn (about 1 s), only for this set

        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)
        self.images = (images - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
        self.labels = torch.as_tensor(digits.target, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])


class SVHNOOD(Dataset):
    """SVHN's street-view digits (32×32 RGB), the usual OOD set for CIFAR models, from torchvision's local
    ``{split}_32x32.mat`` files (md5-checked; nothing downloads). Normalised with ``in_dataset``'s statistics
    (``cifar10`` or ``cifar100``), so inputs look like that model's. Items are ``(image (3, 32, 32), digit)``."""

    def __init__(self, root: Path | str, in_dataset: str, split: str = "test") -> None:
        if in_dataset not in ("cifar10", "cifar100"):
            raise UsageError(f"SVHNOOD: in_dataset={in_dataset!r} is not one of cifar10, cifar100")
        if split not in datasets.SVHN.split_list:  # an invariant: eval passes a literal split (a bug if hit)
            raise ValueError(f"SVHNOOD: split={split!r} is not one of {', '.join(datasets.SVHN.split_list)}")
        mean, std = DATASETS[in_dataset].mean, DATASETS[in_dataset].std
        transform = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])
        try:
            self.svhn = datasets.SVHN(str(root), split=split, transform=transform, download=False)
        except RuntimeError as err:
            file = datasets.SVHN.split_list[split][1]
            raise MissingPathError(f"SVHNOOD: {Path(root) / file} is missing or corrupt ({err}); expected the "
                                   f"official {file} from ufldl.stanford.edu/housenumbers") from err

    def __len__(self) -> int:
        return len(self.svhn)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.svhn[index]
