"""OOD evaluation: the digits OOD set looks like Fashion-MNIST input, SVHN reads torchvision's .mat layout and looks
like CIFAR input, and entropy AUROC has the known answers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.data.idx import FASHION_MNIST_MEAN, FASHION_MNIST_STD
from sigmanens_dist.data.ood import SVHNOOD, DigitsOOD
from sigmanens_dist.evaluation.ood import ood_scores
from sigmanens_dist.inference.scores import predictive_entropy


class _ConfidenceFromInput(nn.Module):
    """Two members whose logits are ``x.mean() * [1, 0, 0]``: a large input mean gives a confident prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conf = self.scale * x.flatten(1).mean(1)
        logits = torch.stack([conf, torch.zeros_like(conf), torch.zeros_like(conf)], dim=-1)
        return logits.unsqueeze(0).expand(2, -1, -1)


def _loader(values: list[float], batch_size: int = 4) -> DataLoader:
    x = torch.tensor(values).view(-1, 1, 1, 1).expand(-1, 1, 4, 4).contiguous()
    return DataLoader(TensorDataset(x, torch.zeros(len(values), dtype=torch.long)), batch_size=batch_size)


def test_digits_look_like_normalised_fashion_mnist() -> None:
    ds = DigitsOOD()
    assert len(ds) == 1797
    x, y = ds[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y == 0
    black, white = -FASHION_MNIST_MEAN / FASHION_MNIST_STD, (1 - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    assert ds.images.min() == pytest.approx(black)  # the background is black, like Fashion-MNIST's
    assert black < float(ds.images.max()) <= white + 1e-6
    assert sorted({int(t) for t in ds.labels}) == list(range(10))


def test_predictive_entropy_bounds() -> None:
    uniform = torch.zeros(3, 5, 4)
    assert torch.allclose(predictive_entropy(uniform), torch.full((5,), math.log(4)))
    certain = torch.tensor([[[100.0, 0.0]]]).expand(2, 1, 2)
    assert predictive_entropy(certain).item() == pytest.approx(0.0, abs=1e-6)
    # members certain of different classes: the ensemble is maximally unsure
    split = torch.tensor([[[100.0, 0.0]], [[0.0, 100.0]]])
    assert predictive_entropy(split).item() == pytest.approx(math.log(2), abs=1e-6)


def test_auroc_has_the_known_answers() -> None:
    model = _ConfidenceFromInput().train()
    confident, unsure = _loader([5.0, 6.0, 7.0, 8.0, 9.0]), _loader([0.0, 0.1, 0.2])
    scores = ood_scores(model, confident, unsure)
    assert scores["auroc_entropy"] == pytest.approx(1.0)
    assert scores["entropy_in"] < scores["entropy_out"]
    assert (scores["num_in"], scores["num_out"]) == (5, 3)
    assert ood_scores(model, unsure, confident)["auroc_entropy"] == pytest.approx(0.0)
    assert ood_scores(model, confident, confident)["auroc_entropy"] == pytest.approx(0.5)
    assert model.training  # left as it was


def test_empty_loaders_are_errors() -> None:
    model = _ConfidenceFromInput()
    empty = DataLoader(TensorDataset(torch.zeros(0, 1, 4, 4), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match="in_loader yielded no samples"):
        ood_scores(model, empty, _loader([1.0]))
    with pytest.raises(ValueError, match="out_loader yielded no samples"):
        ood_scores(model, _loader([1.0]), [])


def test_sigma_ensemble_on_digits_ood() -> None:
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(4, 10))
    model = convert_to_sigma_ensemble(backbone, 3, seed=0)
    in_set = TensorDataset(torch.randn(40, 1, 28, 28), torch.zeros(40, dtype=torch.long))
    out_set = torch.utils.data.Subset(DigitsOOD(), range(60))
    scores = ood_scores(model, DataLoader(in_set, batch_size=16), DataLoader(out_set, batch_size=16))
    assert 0.0 <= scores["auroc_entropy"] <= 1.0
    assert (scores["num_in"], scores["num_out"]) == (40, 60)
    assert 0.0 < scores["entropy_in"] <= math.log(10) and 0.0 < scores["entropy_out"] <= math.log(10)


def test_svhn_reads_the_mat_layout_and_uses_the_cifar_statistics(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A small ``test_32x32.mat`` in SVHN's layout (X: 32×32×3×N, y: N×1 with 10 for the digit 0); torchvision's md5
    is pointed at it, since a generated file cannot match the official one."""
    import hashlib

    from scipy.io import savemat
    from torchvision import datasets

    with pytest.raises(FileNotFoundError, match=r"test_32x32\.mat is missing or corrupt"):
        SVHNOOD(tmp_path, "cifar10")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    digits = np.array([10, 1, 2, 9, 10])
    savemat(tmp_path / "test_32x32.mat", {"X": images.transpose(1, 2, 3, 0), "y": digits[:, None]})
    md5 = hashlib.md5((tmp_path / "test_32x32.mat").read_bytes()).hexdigest()
    monkeypatch.setitem(datasets.SVHN.split_list, "test", ["unused-url", "test_32x32.mat", md5])
    for name in ("cifar10", "cifar100"):
        ood = SVHNOOD(tmp_path, name)
        mean, std = DATASETS[name].mean, DATASETS[name].std
        assert len(ood) == 5
        for i in range(5):
            x, y = ood[i]
            assert y == digits[i] % 10
            expected = (torch.from_numpy(images[i]).permute(2, 0, 1).float() / 255 - torch.tensor(mean)[:, None, None])
            torch.testing.assert_close(x, expected / torch.tensor(std)[:, None, None])
    with pytest.raises(ValueError, match=r"in_dataset='fashion_mnist' is not one of cifar10, cifar100"):
        SVHNOOD(tmp_path, "fashion_mnist")
    with pytest.raises(ValueError, match=r"split='val' is not one of train, test, extra"):
        SVHNOOD(tmp_path, "cifar10", split="val")
