"""The raw CIFAR-10/100 reader on small batches in the official python-pickle layout.

torchvision checks each official file against its md5, which generated files cannot match; the tests set the
expected md5s to those of the files they write, so everything else (paths, pickle keys, pixel layout, labels,
class names, normalisation, augmentation) runs as on the real batches."""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import datasets

from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.config import load_config
from sigmanens_dist.data.raw import build_datasets

# name → (torchvision class, folder, train files, test file, meta file, label key, label-names key, classes)
LAYOUT = {
    "cifar10": (datasets.CIFAR10, "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch",
                "batches.meta", "labels", "label_names", 10),
    "cifar100": (datasets.CIFAR100, "cifar-100-python", ["train"], "test", "meta", "fine_labels",
                 "fine_label_names", 100),
}
PER_FILE, TEST = 6, 8


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _write(root: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Writes the batches, points torchvision's md5 table at them; returns {split: (HWC uint8 images, labels)}."""
    cls, folder, train_files, test_file, meta_file, label_key, names_key, classes = LAYOUT[name]
    base = root / folder
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written: dict[str, list] = {"train": [[], []], "test": [[], []]}
    table: dict[str, list[list[str]]] = {"train": [], "test": []}
    for split, files, n in (("train", train_files, PER_FILE), ("test", [test_file], TEST)):
        for file in files:
            images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            labels = rng.integers(0, classes, n).tolist()
            # The official layout: each row is 1024 red, then 1024 green, then 1024 blue values, row-major.
            batch = {"data": images.transpose(0, 3, 1, 2).reshape(n, 3072), label_key: labels,
                     "batch_label": file}
            (base / file).write_bytes(pickle.dumps(batch))
            table[split].append([file, _md5(base / file)])
            written[split][0].append(images)
            written[split][1].extend(labels)
    (base / meta_file).write_bytes(pickle.dumps({names_key: [f"class_{c}" for c in range(classes)]}))
    monkeypatch.setattr(cls, "train_list", table["train"])
    monkeypatch.setattr(cls, "test_list", table["test"])
    monkeypatch.setattr(cls, "meta", {"filename": meta_file, "key": names_key, "md5": _md5(base / meta_file)})
    return {split: (np.concatenate(images), labels) for split, (images, labels) in written.items()}


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_reads_the_official_pickle_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    truth = _write(tmp_path, name, monkeypatch)
    cfg = load_config(None, [f"data.dataset={name}", f"data.root={tmp_path}", "data.val_split=0",
                             "data.val_from_test=true"])
    bundle = build_datasets(cfg.data, cfg.data_root())
    classes = LAYOUT[name][-1]
    assert (bundle.num_classes, bundle.in_chans) == (classes, 3)
    assert (len(bundle.train), len(bundle.val)) == (len(truth["train"][1]), TEST)

    mean, std = DATASETS[name].mean, DATASETS[name].std
    mean, std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
    images, labels = truth["test"]
    for i in range(TEST):
        x, y = bundle.val[i]
        assert y == labels[i]
        expected = (torch.from_numpy(images[i]).permute(2, 0, 1).float() / 255 - mean) / std
        torch.testing.assert_close(x, expected)

    images, labels = truth["train"]
    for i in sorted({0, PER_FILE, len(labels) - 1} & set(range(len(labels)))):  # across file boundaries
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
    _write(tmp_path, "cifar10", monkeypatch)
    with (tmp_path / "cifar-10-batches-py" / "data_batch_3").open("ab") as f:
        f.write(b"extra")  # md5 no longer matches
    with pytest.raises(FileNotFoundError, match=r"no cifar10 python-pickle batches there"):
        build_datasets(cfg.data, cfg.data_root())
