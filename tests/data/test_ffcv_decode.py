"""``SeededCropDecoder``: each sample's crop and flip a function of ``(seed, epoch, sample index)``. Pixels against a
crop-resize-flip reference and against FFCV's own decoder, the crop distribution against torchvision's, independence
from threads, batch position and rank, and corrupt JPEG payloads."""

from __future__ import annotations

import math
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

pytest.importorskip("ffcv")

from sigmanens_dist.data.ffcv_decode import center_crop, random_resized_crop
from sigmanens_dist.data.ffcv_io import FFCVLoader, write_beton

N, OUT, SEED = 24, 24, 5
LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))


class _Shapes(Dataset):
    """Textured RGB images of varied shapes (48..150 px a side): the decoder must handle any size and aspect."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        yy, xx = np.mgrid[0:160, 0:160].astype(np.float32) / 160
        self.images = []
        for _ in range(N):
            h, w = int(rng.integers(48, 151)), int(rng.integers(48, 151))
            phase, freq = rng.uniform(0, 6.3), rng.uniform(2, 6)
            grey = 0.5 + 0.35 * np.sin(2 * np.pi * freq * (xx + 0.5 * yy) + phase)
            colour = rng.uniform(0.3, 1.0, 3)
            pixels = grey[..., None] * colour + rng.normal(0, 0.02, (160, 160, 3))
            self.images.append((np.clip(pixels[:h, :w], 0, 1) * 255).astype(np.uint8))
        self.labels = [i % 3 for i in range(N)]

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return self.images[index], self.labels[index]


@pytest.fixture(scope="module")
def source() -> _Shapes:
    return _Shapes()


@pytest.fixture(scope="module")
def betons(tmp_path_factory: pytest.TempPathFactory, source: _Shapes) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode")
    return {mode: write_beton(source, root / f"{mode}.beton", max_resolution=None, write_mode=mode, num_workers=1)
            for mode in ("raw", "jpg")}


def _epoch(path: Path, train: bool, epoch: int = 0, workers: int = 1, batch: int = 4, stock: bool = False,
           start: int = 0, world: int = 1, rank: int = 0, randaugment: str | None = None
           ) -> tuple[torch.Tensor, np.ndarray]:
    """(images as 0..255 floats, sample indices in the order read)."""
    loader = FFCVLoader(path, batch, rank, world, workers, seed=SEED, train=train, img_size=OUT, mean=(0.0,) * 3,
                        std=(1 / 255,) * 3, stock_decoder=stock, crop_ratio=0.875, randaugment=randaugment)
    images = torch.cat([x.clone() for x, _ in loader.iter_epoch(epoch, start)])
    return images, loader.rank_order(epoch, start).astype(np.int64)


def _reference(image: np.ndarray, index: int, epoch: int) -> torch.Tensor:
    """Crop and flip drawn for ``(SEED, epoch, index)``, cut from the whole image and resized with OpenCV's area
    filter (what FFCV's own decoders do after decoding everything)."""
    top, left, h, w, flip = random_resized_crop(*image.shape[:2], 0.08, 1.0, *LOG_RATIO, SEED, epoch, index)
    out = cv2.resize(image[top:top + h, left:left + w], (OUT, OUT), interpolation=cv2.INTER_AREA)
    out = out[:, ::-1] if flip else out
    return torch.from_numpy(out.copy()).permute(2, 0, 1).float()


def test_crop_positions_reach_both_edges() -> None:
    """A fixed crop size (one area, square): every top and left offset from 0 to the far edge occurs."""
    height, width = 40, 50
    crops = np.array([random_resized_crop(height, width, 0.25, 0.25, 0.0, 0.0, 1, 0, i) for i in range(600)])
    side = round(math.sqrt(0.25 * height * width))
    assert (crops[:, 2] == side).all() and (crops[:, 3] == side).all()
    assert set(crops[:, 0].tolist()) == set(range(height - side + 1))
    assert set(crops[:, 1].tolist()) == set(range(width - side + 1))
    assert center_crop(100, 60, 0.875) == (24, 4, 52, 52, False)


def test_random_resized_crop_follows_torchvision() -> None:
    """Same distribution as ``RandomResizedCrop.get_params`` (area fraction, aspect, position) and a fair flip;
    a pure function of ``(seed, epoch, index)``."""
    height, width, n = 120, 180, 4000
    ours = np.array([random_resized_crop(height, width, 0.08, 1.0, *LOG_RATIO, 3, 1, i) for i in range(n)])
    torch.manual_seed(0)
    img = torch.zeros(3, height, width)
    theirs = np.array([v2.RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)])

    def stats(p: np.ndarray) -> np.ndarray:
        top, left, h, w = p[:, 0], p[:, 1], p[:, 2], p[:, 3]
        return np.array([(h * w).mean() / (height * width), np.log(w / h).mean(), (top + h / 2).mean() / height,
                         (left + w / 2).mean() / width, (h * w == height * width).mean()])

    np.testing.assert_allclose(stats(ours[:, :4]), stats(theirs), atol=0.02)
    assert abs(ours[:, 4].mean() - 0.5) < 0.03
    assert ((ours[:, 0] + ours[:, 2] <= height) & (ours[:, 1] + ours[:, 3] <= width) & (ours[:, 2] > 0)).all()
    again = [random_resized_crop(height, width, 0.08, 1.0, *LOG_RATIO, 3, 1, i) for i in range(50)]
    assert np.array_equal(np.array(again), ours[:50])
    other_epoch = [random_resized_crop(height, width, 0.08, 1.0, *LOG_RATIO, 3, 2, i) for i in range(50)]
    other_seed = [random_resized_crop(height, width, 0.08, 1.0, *LOG_RATIO, 4, 1, i) for i in range(50)]
    assert not np.array_equal(np.array(other_epoch), ours[:50]) and not np.array_equal(np.array(other_seed),
                                                                                       ours[:50])


@pytest.mark.slow
def test_raw_images_equal_the_crop_resize_flip_reference(betons: dict[str, Path], source: _Shapes) -> None:
    for epoch in (0, 3):
        images, order = _epoch(betons["raw"], train=True, epoch=epoch)
        for image, index in zip(images, order.tolist(), strict=True):
            torch.testing.assert_close(image, _reference(source.images[index], index, epoch), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_jpeg_samples_get_the_same_crops_and_ffcvs_pixels(betons: dict[str, Path]) -> None:
    """JPEG samples get the same crops as raw ones (same draws), differing only by JPEG loss; evaluation gives
    exactly the pixels of FFCV's own centre-crop decoder."""
    jpg, _ = _epoch(betons["jpg"], train=True)
    raw, _ = _epoch(betons["raw"], train=True)
    shuffled = raw[torch.roll(torch.arange(N), 1)]
    err = (jpg - raw).abs().mean(dim=(1, 2, 3))
    assert err.max() < 3, err  # of 255: JPEG at quality 90
    assert ((jpg - shuffled).abs().mean(dim=(1, 2, 3)) > 3 * err).all()  # the right crop of the right image
    ours, _ = _epoch(betons["jpg"], train=False)
    stock, _ = _epoch(betons["jpg"], train=False, stock=True)
    assert torch.equal(ours, stock)


@pytest.mark.slow
def test_draws_do_not_depend_on_threads_batch_position_or_rank(betons: dict[str, Path]) -> None:
    one, order = _epoch(betons["jpg"], train=True, epoch=2)
    by_index = dict(zip(order.tolist(), one, strict=True))
    two_threads, _ = _epoch(betons["jpg"], train=True, epoch=2, workers=2)
    assert torch.equal(one, two_threads)
    for rank in (0, 1):  # other batch size, other rank: each sample still gets its own crop
        images, mine = _epoch(betons["jpg"], train=True, epoch=2, batch=3, world=2, rank=rank)
        for image, index in zip(images, mine.tolist(), strict=True):
            assert torch.equal(image, by_index[index])
    resumed, _ = _epoch(betons["jpg"], train=True, epoch=2, start=2)
    assert torch.equal(resumed, one[8:])
    assert not torch.equal(_epoch(betons["jpg"], train=True, epoch=3)[0], one)


@pytest.mark.slow
def test_one_loader_moves_between_epochs_like_fresh_ones(betons: dict[str, Path]) -> None:
    """The training loop keeps one loader for the whole run: the epoch must reach the compiled code every time,
    not only when it is compiled."""
    loader = FFCVLoader(betons["jpg"], 4, 0, 1, 2, seed=SEED, train=True, img_size=OUT, mean=(0.0,) * 3,
                        std=(1 / 255,) * 3)
    for epoch, start in ((2, 0), (3, 0), (2, 2), (0, 1)):
        images = torch.cat([x.clone() for x, _ in loader.iter_epoch(epoch, start)])
        assert torch.equal(images, _epoch(betons["jpg"], train=True, epoch=epoch, workers=2, start=start)[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corrupt_jpeg_payload_names_the_sample(tmp_path: Path, betons: dict[str, Path]) -> None:
    from ffcv.reader import Reader

    path = tmp_path / "bad.beton"
    data = bytearray(betons["jpg"].read_bytes())
    pointer = int(Reader(str(betons["jpg"])).metadata["f0"]["data_ptr"][13])
    data[pointer:pointer + 64] = bytes(64)  # wipes the JPEG's start-of-image marker and headers
    path.write_bytes(bytes(data))
    for train in (True, False):
        with pytest.raises(ValueError, match=r"bad\.beton: sample 13 holds a JPEG that libjpeg-turbo cannot decode"):
            _epoch(path, train=train)


@pytest.mark.slow
def test_randaugment_augments_each_crop_under_its_sample_seed(betons: dict[str, Path]) -> None:
    """``train.randaugment`` on FFCV: each decoded crop goes through timm's auto-augmentation (the raw reader's
    step) under the seed of its place in the epoch, as the map-style reader seeds it; so the batches are the plain
    crops augmented here, whichever of the worker processes augments them, and a resumed epoch replays them."""
    from PIL import Image

    from sigmanens_dist.data.ffcv_augment import auto_augmentation
    from sigmanens_dist.data.sampler import sample_seed, seeded

    rand, epoch = "rand-m9-mstd0.5-inc1", 1
    plain, _ = _epoch(betons["raw"], train=True, epoch=epoch)
    augmented, _ = _epoch(betons["raw"], train=True, epoch=epoch, workers=2, randaugment=rand)
    step = auto_augmentation(rand, OUT, (0.0,) * 3)
    for position, (crop, image) in enumerate(zip(plain, augmented, strict=True)):
        with seeded(sample_seed(SEED, epoch, position)):
            expected = np.asarray(step(Image.fromarray(crop.permute(1, 2, 0).to(torch.uint8).numpy())))
        assert torch.equal(image, torch.from_numpy(expected).permute(2, 0, 1).float()), position
    assert (plain != augmented).flatten(1).any(1).sum() > N // 2
    resumed, _ = _epoch(betons["raw"], train=True, epoch=epoch, start=2, randaugment=rand)
    assert torch.equal(resumed, augmented[8:])
