"""The raw CIFAR-10/100 reader on small batches in the official python-pickle layout.

torchvision checks each official file against its md5, which generated files cannot match; the tests set the
expected md5s to those of the files they write, so everything else (paths, pickle keys, pixel layout, labels,
class names, normalisation, augmentation) runs as on the real batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.config import load_config
from sigmanens_dist.data.raw import build_datasets
from tests.helpers import CIFAR_LAYOUT, CIFAR_PER_FILE, CIFAR_TEST, write_cifar_batches


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_reads_the_official_pickle_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    truth = write_cifar_batches(tmp_path, name, monkeypatch)
    cfg = load_config(None, [f"data.dataset={name}", f"data.root={tmp_path}", "data.val_split=0",
                             "data.val_from_test=true"])
    bundle = build_datasets(cfg.data, cfg.data_root())
    classes = CIFAR_LAYOUT[name][-1]
    assert (bundle.num_classes, bundle.in_chans) == (classes, 3)
    assert (len(bundle.train), len(bundle.val)) == (len(truth["train"][1]), CIFAR_TEST)

    mean, std = DATASETS[name].mean, DATASETS[name].std
    mean, std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
    images, labels = truth["test"]
    for i in range(CIFAR_TEST):
        x, y = bundle.val[i]
        assert y == labels[i]
        expected = (torch.from_numpy(images[i]).permute(2, 0, 1).float() / 255 - mean) / std
        torch.testing.assert_close(x, expected)

    images, labels = truth["train"]
    for i in sorted({0, CIFAR_PER_FILE, len(labels) - 1} & set(range(len(labels)))):  # across file boundaries
        x, y = bundle.train[(i, 123)]
        assert y == labels[i] and x.shape == (3, 32, 32) and x.dtype == torch.float32
        assert torch.equal(x, bundle.train[(i, 123)][0])  # seeded augmentation
        # A padded crop and flip of the right image: values come from the source (or black padding).
        source = (torch.from_numpy(images[i]).permute(2, 0, 1).float() / 255 - mean) / std
        padded_black = (0 - mean) / std
        for c in range(3):
            allowed = torch.cat([source[c].flatten(), padded_black[c].flatten()])
            assert ((x[c].flatten()[:, None] - allowed[None]).abs().min(dim=1).values < 1e-5).all()


def test_missing_or_corrupt_batches_say_what_was_expected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, ["data.dataset=cifar10", f"data.root={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=r"no cifar10 python-pickle batches there .*cifar-10-batches-py/"):
        build_datasets(cfg.data, cfg.data_root())
    write_cifar_batches(tmp_path, "cifar10", monkeypatch)
    with (tmp_path / "cifar-10-batches-py" / "data_batch_3").open("ab") as f:
        f.write(b"extra")  # md5 no longer matches
    with pytest.raises(FileNotFoundError, match=r"no cifar10 python-pickle batches there"):
        build_datasets(cfg.data, cfg.data_root())
