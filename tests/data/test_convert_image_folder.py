"""``sigmanens data convert --dataset imagefolder`` (ImageNet's conversion too): every split is stored as the files
hold it, and the converted folder gives the raw ImageFolder reader's evaluation samples and training transforms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sigmanens_dist.cli import main
from sigmanens_dist.config import load_config
from sigmanens_dist.data.loaders import Data, build_data
from sigmanens_dist.data.raw import build_datasets
from sigmanens_dist.data.sampler import seeded
from sigmanens_dist.data.webdataset_io import MANIFEST, iter_eval
from sigmanens_dist.distributed.env import DistEnv
from tests.helpers import write_cifar_batches

CPU = DistEnv(0, 1, 0, torch.device("cpu"))
SPLIT = ["data.val_split=4", "data.split_seed=1"]  # carved from the 24 training images, as at conversion
RAND = "rand-m9-mstd0.5"


def _image(rng: np.random.Generator, c: int, i: int) -> Image.Image:
    """A smooth class-coloured image of its own size (not square, so resize and centre crop both matter), a light
    texture on top; every fourth a different kind of file: grayscale JPEG, RGB PNG, palette PNG."""
    h, w = 18 + (i * 5) % 17, 30 - (i * 3) % 13
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(3 * xx + c), np.cos(2 * yy - c), np.sin(xx + yy + i)], axis=-1)
    pixels = np.clip(127 + 90 * base + rng.normal(0, 6, (h, w, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    return [image, image.convert("L"), image, image.convert("P")][i % 4]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train/ (8 per class) and val/ (4 per class) of 3 classes: JPEG and PNG files, RGB, grayscale and palette."""
    root = tmp_path_factory.mktemp("imagefolder")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("val", 4)):
        for c, name in enumerate(("ant", "bee", "cat")):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                image = _image(rng, c, i)
                image.save(root / split / name / f"{i}.{'png' if i % 4 >= 2 else 'jpg'}")
    return root


def _convert(root: Path, out: Path, fmt: str) -> Path:
    assert main(["data", "convert", "--dataset", "imagefolder", "--root", str(root), "--format", fmt, "--out",
                 str(out), "--val-split", "4", "--split-seed", "1", "--max-count", "5", "--compress-probability",
                 "0", "--num-workers", "1"]) == 0
    return out


def _data(*overrides: str, randaugment: str | None = None) -> Data:
    cfg = load_config(None, ["data.dataset=imagefolder", "data.img_size=16", "data.num_workers=0", *SPLIT, *overrides])
    return build_data(cfg.data, 5, 0, CPU, randaugment)


def _all(passes: Data, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(getattr(passes, split)())
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


def test_webdataset_reads_the_raw_readers_samples(tree: Path, tmp_path: Path) -> None:
    """Test and carved val samples of the shards are the raw reader's, bit for bit (PNG and grayscale files
    included); a training sample goes through the raw reader's augmentation, randaugment included."""
    pytest.importorskip("webdataset")
    out = _convert(tree, tmp_path / "wds", "webdataset")
    raw = _data(f"data.root={tree}")
    converted = _data("data.format=webdataset", f"data.root={out}", randaugment=RAND)
    for split in ("test", "val"):
        (x, y), (cx, cy) = _all(raw, split), _all(converted, split)
        assert x.shape == (12 if split == "test" else 4, 3, 16, 16) and y.tolist() == cy.tolist()
        assert torch.equal(x, cx), split

    cfg = load_config(None, ["data.dataset=imagefolder", "data.img_size=16", f"data.root={tree}", *SPLIT])
    raw_train = build_datasets(cfg.data, tree, RAND).train
    stored = [image for images, _ in iter_eval(out / "train" / MANIFEST, 0, 1, 5, None, collate=list)
              for image in images]  # decoded, in the converted split's order: position i is raw train[i]
    assert len(stored) == len(raw_train) == 20
    for i in (0, 1, 2, 3, 19):  # RGB JPEG, grayscale JPEG, RGB PNG, palette PNG
        expected = raw_train[(i, 1000 + i)][0]
        with seeded(1000 + i):
            assert torch.equal(converted.train.transform(stored[i]), expected), i


@pytest.mark.slow  # about 40 s: compiling FFCV's loaders
def test_ffcv_evaluates_the_raw_readers_crop_of_each_image(tree: Path, tmp_path: Path) -> None:
    """FFCV stores every split's pixels (a raw, uncompressed store here) and evaluates the raw reader's centre crop
    of the same image, in the same order: its own resize (OpenCV's area filter) only changes the interpolation."""
    pytest.importorskip("ffcv")
    out = _convert(tree, tmp_path / "ffcv", "ffcv")
    raw = _data(f"data.root={tree}")
    converted = _data("data.format=ffcv", f"data.root={out}")
    for split in ("test", "val"):
        (x, y), (cx, cy) = _all(raw, split), _all(converted, split)
        assert y.tolist() == cy.tolist() and x.shape == cx.shape
        distance = torch.cdist(x.flatten(1), cx.flatten(1))  # every raw sample against every converted one
        assert torch.equal(distance.argmin(1), torch.arange(len(x))), split
        assert (x - cx).abs().mean() < 0.15, split


def test_cifar_test_split_is_stored_as_its_pixels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same defect's other case: CIFAR's test set is converted from its stored pixels, not its float tensors."""
    pytest.importorskip("webdataset")
    truth = write_cifar_batches(tmp_path / "cifar", "cifar10", monkeypatch)
    out = tmp_path / "wds"
    assert main(["data", "convert", "--dataset", "cifar10", "--root", str(tmp_path / "cifar"), "--format",
                 "webdataset", "--out", str(out), "--val-split", "0", "--jpeg-quality", "100"]) == 0
    batches = list(iter_eval(out / "test" / MANIFEST, 0, 1, 3, None, collate=list))
    images, labels = truth["test"]
    assert [int(y) for _, ys in batches for y in ys] == labels
    stored = np.stack([np.asarray(image) for xs, _ in batches for image in xs])
    assert np.abs(stored.astype(float) - images).mean() < 2  # JPEG at quality 100 (4:4:4): all but lossless
