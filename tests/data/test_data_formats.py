"""Data formats end to end: a generated JPEG tree → webdataset shards and an FFCV .beton → per-rank loaders.
Order and coverage per epoch, equal steps on every rank, exact resume, pixels and labels preserved, clear errors on
damaged files; and the CIFAR-C corruptions."""

from __future__ import annotations

import colorsys
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from sigmanens_dist.data.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from sigmanens_dist.data.sampler import ShardedBatchSampler
from sigmanens_dist.data.synthetic_tree import make_image_folder
from sigmanens_dist.data.webdataset_io import (
    MANIFEST,
    ShardError,
    WebDatasetLoader,
    image_transform,
    read_manifest,
)
from sigmanens_dist.data.webdataset_write import write_shards
from sigmanens_dist.errors import UsageError
from tests.helpers import REPO, env, torchrun

NUM_CLASSES, PER_CLASS, SIZE = 4, 24, 32  # 96 train images
TO_FLOAT = v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True)])  # no geometry: compare to the source


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("tree"), NUM_CLASSES, PER_CLASS, SIZE, seed=0)


@pytest.fixture(scope="module")
def train_set(tree: Path) -> datasets.ImageFolder:
    return datasets.ImageFolder(str(tree / "train"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, train_set: datasets.ImageFolder) -> Path:
    """8 shards of 12: divides evenly over 2 ranks × 2 workers, so every sample is used each epoch."""
    return write_shards(train_set, tmp_path_factory.mktemp("wds"), max_count=12)


@pytest.fixture(scope="module")
def beton(tmp_path_factory: pytest.TempPathFactory, train_set: datasets.ImageFolder) -> Path:
    pytest.importorskip("ffcv")
    from sigmanens_dist.data.ffcv_io import write_beton

    # Half raw, half JPEG: both of FFCV's decode paths are exercised.
    return write_beton(train_set, tmp_path_factory.mktemp("ffcv") / "train.beton", max_resolution=64,
                       jpeg_quality=90, write_mode="proportion", compress_probability=0.5, num_workers=2)


def _source_pixels(train_set: datasets.ImageFolder, index: int) -> torch.Tensor:
    return TO_FLOAT(train_set[index][0])


class _Arrays(Dataset):
    """In-memory uint8 images (no source files): forces the converter to encode."""

    def __init__(self, images: np.ndarray, labels: list[int], fail_at: int | None = None) -> None:
        self.images, self.labels, self.fail_at = images, labels, fail_at

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        if index == self.fail_at:
            raise OSError(f"disk error reading image {index}")
        return self.images[index], self.labels[index]


def _arrays(n: int, channels: int, fail_at: int | None = None) -> _Arrays:
    rng = np.random.default_rng(0)
    blocks = rng.uniform(0, 255, (n, 4, 4, channels)).repeat(8, axis=1).repeat(8, axis=2)
    images = (blocks + rng.normal(0, 4, (n, 32, 32, 1))).clip(0, 255).astype(np.uint8)  # luminance noise
    return _Arrays(images[..., 0] if channels == 1 else images, [i % 3 for i in range(n)], fail_at)


def _epoch(loader: WebDatasetLoader, epoch: int, start: int = 0) -> list[tuple]:
    return list(loader.iter_epoch(epoch, start))


# ---------------------------------------------------------------------------------------------------------------------
# webdataset


def test_shards_store_source_jpegs_unchanged_with_a_checked_manifest(tree: Path, train_set: datasets.ImageFolder,
                                                                     shards: Path) -> None:
    manifest = json.loads(shards.read_text())
    assert manifest["num_samples"] == len(train_set) == 96
    assert manifest["classes"] == train_set.classes and manifest["num_classes"] == NUM_CLASSES
    assert [s["name"] for s in manifest["shards"]] == [f"train-{i:06d}.tar" for i in range(8)]
    assert [s["count"] for s in manifest["shards"]] == [12] * 8
    for entry in manifest["shards"]:
        path = shards.parent / entry["name"]
        assert entry["bytes"] == path.stat().st_size
    first = shards.parent / "train-000000.tar"
    with tarfile.open(first) as tar:
        names = tar.getnames()
        assert sorted(names[:2]) == ["000000000.cls", "000000000.jpg"]
        assert tar.extractfile("000000005.jpg").read() == Path(train_set.samples[5][0]).read_bytes()
        assert int(tar.extractfile("000000005.cls").read()) == train_set.targets[5]
    assert not (shards.parent / "manifest.partial.json").exists()
    read_manifest(shards, verify=True)  # sha256 of every shard as recorded


def test_interrupted_conversion_resumes_after_last_complete_shard(tmp_path: Path) -> None:
    source = _arrays(50, 3)
    fresh = json.loads(write_shards(source, tmp_path / "fresh", max_count=8).read_text())

    out = tmp_path / "resumed"
    with pytest.raises(OSError, match="image 27"):
        write_shards(_arrays(50, 3, fail_at=27), out, max_count=8)
    partial = json.loads((out / "manifest.partial.json").read_text())
    assert [s["count"] for s in partial["shards"]] == [8, 8, 8]  # shard 3 was open when sample 27 failed
    assert not (out / MANIFEST).exists()
    # A kept shard that no longer matches its record is redone, and so is everything after it.
    damaged = out / "train-000002.tar"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    kept = {p.name: p.stat().st_mtime_ns for p in sorted(out.glob("*.tar"))[:2]}

    manifest = json.loads(write_shards(source, out, max_count=8).read_text())
    assert {p: (out / p).stat().st_mtime_ns for p in kept} == kept  # shards 0 and 1 not rewritten
    assert manifest["shards"] == fresh["shards"]  # same boundaries, same bytes as an uninterrupted run
    assert not (out / "manifest.partial.json").exists()
    assert write_shards(source, out, max_count=8) == out / MANIFEST  # finished: returns at once


def test_encoded_sources_keep_pixels_and_labels(tmp_path: Path) -> None:
    for channels, tolerance in ((1, 1e-6), (3, 3 / 255)):  # grayscale: lossless PNG; RGB: JPEG at quality 95
        source = _arrays(24, channels)
        manifest = write_shards(source, tmp_path / str(channels), max_count=6)
        loader = WebDatasetLoader(manifest, 4, 0, 1, 0, seed=0, transform=TO_FLOAT, shuffle_buffer=8,
                                  return_keys=True)
        seen = 0
        for images, labels, keys in loader.iter_epoch(0):
            assert images.shape == (4, channels, 32, 32)
            for image, label, key in zip(images, labels, keys, strict=True):
                expected = torch.from_numpy(source.images[int(key)]).float().div(255)
                expected = expected.unsqueeze(0) if channels == 1 else expected.permute(2, 0, 1)
                assert (image - expected).abs().mean() <= tolerance, key
                assert int(label) == source.labels[int(key)]
                seen += 1
        assert seen == 24


def test_two_ranks_split_an_epoch_into_disjoint_equal_parts(train_set: datasets.ImageFolder, shards: Path) -> None:
    loaders = [WebDatasetLoader(shards, 4, r, 2, 0, seed=3, transform=TO_FLOAT, shuffle_buffer=10, return_keys=True)
               for r in (0, 1)]
    assert len(loaders[0]) == len(loaders[1]) == 12  # 4 shards of 12 per rank, batch 4
    epochs = [[_epoch(ld, e) for ld in loaders] for e in (0, 1)]
    for per_rank in epochs:
        assert [len(b) for b in per_rank] == [12, 12]
        keys = [k for batches in per_rank for b in batches for k in b[2]]
        assert sorted(keys) == [f"{i:09d}" for i in range(96)]  # every sample exactly once
        for batches in per_rank:
            for images, labels, batch_keys in batches:
                for image, label, key in zip(images, labels, batch_keys, strict=True):
                    assert int(label) == train_set.targets[int(key)]
                    assert torch.equal(image, _source_pixels(train_set, int(key)))  # JPEG bytes copied, not re-coded
    order = [[k for b in batches for k in b[2]] for batches in (epochs[0][0], epochs[1][0])]
    assert order[0] != order[1]  # reshuffled each epoch


def test_uneven_shards_drop_the_same_tail_on_every_rank(tmp_path: Path) -> None:
    manifest = write_shards(_arrays(50, 3), tmp_path, max_count=8)  # 6 shards of 8 and one of 2
    loaders = [WebDatasetLoader(manifest, 4, r, 2, 0, seed=0, transform=TO_FLOAT, shuffle_buffer=1,
                                return_keys=True) for r in (0, 1)]
    # 7 shards over 2 streams: the poorest possible deal is the 3 smallest shards, 2 + 8 + 8 = 18 samples.
    assert [len(ld) for ld in loaders] == [4, 4]
    for epoch in range(3):
        keys = [k for ld in loaders for b in _epoch(ld, epoch) for k in b[2]]
        assert len(keys) == len(set(keys)) == 32


def test_resume_reproduces_the_same_batches_with_workers(shards: Path) -> None:
    loader = WebDatasetLoader(shards, 4, 1, 2, 2, seed=5, transform=image_transform(True, 24, (0.5,) * 3, (0.25,) * 3),
                              shuffle_buffer=16, return_keys=True)
    full = _epoch(loader, 2)
    assert len(full) == len(loader) == 12
    for start in (1, 6):
        resumed = _epoch(loader, 2, start)
        assert [b[2] for b in resumed] == [b[2] for b in full[start:]]
        for a, b in zip(resumed, full[start:], strict=True):
            assert torch.equal(a[0], b[0])  # augmentation replays too
    assert _epoch(loader, 2, len(loader)) == []
    with pytest.raises(ValueError, match="outside an epoch of 12"):
        _epoch(loader, 2, 13)


def test_fewer_shards_than_streams_is_refused(shards: Path) -> None:
    with pytest.raises(ValueError, match=r"8 shards cannot feed 2 ranks × 5 workers = 10 streams"):
        WebDatasetLoader(shards, 4, 0, 2, 5, seed=0, transform=TO_FLOAT)


def test_damaged_shards_name_shard_and_sample(tmp_path: Path, shards: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(shards.parent, root)
    victim = root / "train-000003.tar"
    data = victim.read_bytes()

    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=r"train-000003\.tar is \d+ bytes but .* records \d+ \(truncated\)"):
        WebDatasetLoader(root / MANIFEST, 4, 0, 1, 0, seed=0, transform=TO_FLOAT)

    # Truncated before its manifest was written (so sizes agree): found while streaming, with the sample key.
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["shards"][3]["bytes"] = victim.stat().st_size
    (root / MANIFEST).write_text(json.dumps(manifest))
    loader = WebDatasetLoader(root / MANIFEST, 4, 0, 1, 0, seed=0, transform=TO_FLOAT, shuffle_buffer=1)
    with pytest.raises(ShardError, match=r"train-000003\.tar.*(sample key '0000000\d\d'|ended after \d+ samples)"):
        _epoch(loader, 0)

    # An undecodable image: same size, garbage bytes.
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".jpg"))
    broken = bytearray(data)
    broken[member.offset_data: member.offset_data + member.size] = b"\0" * member.size
    victim.write_bytes(bytes(broken))
    manifest["shards"][3]["bytes"] = len(broken)
    (root / MANIFEST).write_text(json.dumps(manifest))
    key = member.name.split(".")[0]
    with pytest.raises(ShardError, match=rf"train-000003\.tar, sample key '{key}': cannot decode jpg"):
        _epoch(WebDatasetLoader(root / MANIFEST, 4, 0, 1, 0, seed=0, transform=TO_FLOAT), 0)
    with pytest.raises(ShardError, match=r"train-000003\.tar: sha256 differs"):
        read_manifest(root, verify=True)


def test_manifest_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no webdataset manifest"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest.json: not a sigmanens-webdataset/1 manifest"):
        read_manifest(tmp_path)
    with pytest.raises(ValueError, match=r"sample 0: unsupported image ndarray float64"):
        write_shards(_Arrays(np.zeros((5, 8, 8, 3)), [0] * 5), tmp_path / "bad")


# ---------------------------------------------------------------------------------------------------------------------
# FFCV


@pytest.mark.slow
def test_ffcv_corrupt_or_truncated_beton_is_named(tmp_path: Path, beton: Path) -> None:
    from sigmanens_dist.data.ffcv_io import FFCVLoader, check_beton

    assert check_beton(beton) == 96
    data = beton.read_bytes()
    for name, content, why in (("truncated.beton", data[: len(data) * 2 // 3], "allocation table"),
                               ("tail.beton", data[:-8], "allocation table"),
                               ("header.beton", data[:20], "header"),
                               ("version.beton", b"\x07" + data[1:], "format version")):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(UsageError, match=rf"{name}: corrupt or truncated \.beton \(.*{why}"):
            FFCVLoader(path, 4, 0, 1, 1, seed=0, train=True, img_size=24, mean=(0.5,) * 3, std=(0.25,) * 3)
    with pytest.raises(FileNotFoundError, match=r"missing\.beton: no such \.beton file"):
        check_beton(tmp_path / "missing.beton")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ffcv_writer_fails_instead_of_hanging_on_a_bad_sample(tmp_path: Path) -> None:
    pytest.importorskip("ffcv")
    from sigmanens_dist.data.ffcv_io import write_beton

    target = tmp_path / "bad.beton"
    with pytest.raises(RuntimeError, match=r"bad\.beton: a writer worker exited .*sample 17: OSError: disk error"):
        write_beton(_arrays(40, 3, fail_at=17), target, num_workers=2, chunksize=10)
    assert not list(tmp_path.glob("*bad.beton*"))  # neither the target nor a temporary file


@pytest.mark.slow
def test_ffcv_grayscale_is_stored_as_three_equal_channels(tmp_path: Path) -> None:
    pytest.importorskip("ffcv")
    from sigmanens_dist.data.ffcv_io import FFCVLoader, write_beton

    source = _arrays(12, 1)
    path = write_beton(source, tmp_path / "gray.beton", write_mode="raw", num_workers=1)
    loader = FFCVLoader(path, 4, 0, 1, 1, seed=0, train=False, img_size=32, mean=(0.0,) * 3, std=(1.0,) * 3,
                        crop_ratio=1.0)
    images = torch.cat([x.clone() for x, _ in loader.iter_epoch(0)])
    expected = torch.from_numpy(source.images).float().div(255)
    assert images.shape == (12, 3, 32, 32)
    for c in range(3):
        torch.testing.assert_close(images[:, c], expected, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# Both, under torchrun


@pytest.mark.slow
def test_two_rank_torchrun_loaders(tmp_path: Path, train_set: datasets.ImageFolder, shards: Path,
                                   beton: Path) -> None:
    script = REPO / "tests" / "dist_scripts" / "data_formats_check.py"
    proc = subprocess.run([*torchrun(2), str(script), str(tmp_path), str(shards), str(beton)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    targets = torch.tensor(train_set.targets)
    assert ranks[0]["gathered_steps"] == ranks[1]["gathered_steps"] == [(12, 12), (12, 12)]

    # webdataset: 2 ranks × 2 workers over 8 shards of 12 → 12 batches of 4 per rank, every sample once.
    wds = [r["wds"] for r in ranks]
    assert [w["len"] for w in wds] == [w["batches"] for w in wds] == [12, 12]
    assert wds[0]["shape"] == (4, 3, 24, 24) and wds[0]["dtypes"] == (torch.float32, torch.int64)
    for epoch_keys in ("keys", "next_epoch_keys"):
        keys = [k for w in wds for batch in w[epoch_keys] for k in batch]
        assert sorted(keys) == [f"{i:09d}" for i in range(96)]
    assert wds[0]["keys"] != wds[0]["next_epoch_keys"]
    for w in wds:
        for keys, labels in zip(w["keys"], w["labels"], strict=True):
            assert labels.tolist() == [train_set.targets[int(k)] for k in keys]
        assert w["resumed_keys"] == w["keys"][3:] and w["resumed_images_equal"]

    # FFCV train: exactly ShardedBatchSampler's order, labels preserved, resume at batch 3 with the same pixels.
    ffcv = [r["ffcv"] for r in ranks]
    assert [f["len"] for f in ffcv] == [f["batches"] for f in ffcv] == [12, 12]
    assert ffcv[0]["shape"] == (4, 3, 24, 24) and ffcv[0]["dtypes"] == (torch.float32, torch.int64)
    assert all(f["finite"] for f in ffcv)
    for rank, f in enumerate(ffcv):
        sampler = ShardedBatchSampler(96, 4, rank, 2, seed=7)
        sampler.set_position(1)
        assert f["order"].tolist() == [i for batch in sampler for i, _ in batch]
        assert torch.equal(f["labels"], targets[f["order"]])
        assert f["resumed_order"].tolist() == f["order"][12:].tolist()
        assert torch.equal(f["resumed_labels"], targets[f["resumed_order"]])
        assert f["resumed_images_equal"]  # crop and flip replayed exactly, not only the order
    assert sorted(np.concatenate([f["order"] for f in ffcv]).tolist()) == list(range(96))

    # FFCV eval: contiguous halves, every sample once, pixels within JPEG tolerance of the source.
    ev = [r["ffcv_eval"] for r in ranks]
    assert [e["len"] for e in ev] == [e["batches"] for e in ev] == [12, 12]
    assert np.concatenate([e["order"] for e in ev]).tolist() == list(range(96))
    for e in ev:
        assert torch.equal(e["labels"], targets[e["order"]])
        for image, index in zip(e["images"], e["order"].tolist(), strict=True):
            source = _source_pixels(train_set, index)
            other = _source_pixels(train_set, (index + 1) % 96)
            err = (image - source).abs().mean()
            assert err < 0.03, (index, float(err))  # JPEG q90 of a 32 px texture
            assert err < (image - other).abs().mean() / 3  # and the right image, not just a similar one


# ---------------------------------------------------------------------------------------------------------------------
# Corruptions


def _texture(tree: Path) -> torch.Tensor:
    return TO_FLOAT(Image.open(next((tree / "train" / "n00000001").glob("*.JPEG"))))


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corruptions_keep_shape_range_and_are_seeded(name: str, tree: Path) -> None:
    x = _texture(tree)
    batch = torch.stack([x, x.flip(-1)])
    for inp in (x, batch):
        out = corrupt(inp, name, 3, seed=1)
        assert out.shape == inp.shape and out.dtype == inp.dtype
        assert out.min() >= 0 and out.max() <= 1
        assert not torch.equal(out, inp)
        assert torch.equal(out, corrupt(inp, name, 3, seed=1))
    if name.endswith("_noise"):
        assert not torch.equal(corrupt(x, name, 3, seed=1), corrupt(x, name, 3, seed=2))


# The reference's severity tables are not monotonic in pixel distance for these: glass blur swaps pixels at every
# severity and blurs the swaps more as it rises; elastic's affine jitter shrinks while its displacement grows; snow's
# severity 5 has fewer, longer streaks than 4; spatter is water at 1-3 and sparser mud at 4-5; saturate desaturates
# at 1-2 (×0.3, ×0.1) and oversaturates at 3-5.
NOT_MONOTONIC = {"glass_blur", "elastic_transform", "snow", "spatter", "saturate"}


@pytest.mark.parametrize("name", [n for n in CORRUPTIONS if n not in NOT_MONOTONIC])
def test_corruptions_grow_with_severity(name: str, tree: Path) -> None:
    x = _texture(tree)
    distance = [float((corrupt(x, name, s, seed=0) - x).abs().mean()) for s in SEVERITIES]
    assert distance == sorted(distance) and distance[0] < distance[-1], distance


def test_corruption_parameters_match_the_reference_formulas(tree: Path) -> None:
    x = _texture(tree)
    noise = corrupt(x.new_full((3, 64, 64), 0.5), "gaussian_noise", 5, seed=0) - 0.5
    assert noise.std().item() == pytest.approx(0.10, rel=0.05)
    c = corrupt(x, "contrast", 5)
    torch.testing.assert_close(c - c.mean((1, 2), keepdim=True), 0.15 * (x - x.mean((1, 2), keepdim=True)))
    flat = x.new_full((3, 16, 16), 0.3)
    torch.testing.assert_close(corrupt(flat, "gaussian_blur", 5), flat)
    b = corrupt(x, "brightness", 3)
    for i, j in ((0, 0), (7, 11), (20, 3)):
        h, s, v = colorsys.rgb_to_hsv(*x[:, i, j].tolist())
        torch.testing.assert_close(b[:, i, j], torch.tensor(colorsys.hsv_to_rgb(h, s, min(v + 0.15, 1.0))))
    hits = (corrupt(x.new_full((3, 64, 64), 0.5), "impulse_noise", 5, seed=0) != 0.5).float().mean()
    assert hits.item() == pytest.approx(0.07, abs=0.01)
    # normalised kernels and resampling keep a flat image flat; glass blur quantises it to 8 bits first
    for name in ("defocus_blur", "motion_blur", "zoom_blur", "elastic_transform"):
        torch.testing.assert_close(corrupt(flat, name, 5), flat, msg=name)
    torch.testing.assert_close(corrupt(flat, "glass_blur", 5), flat.new_full(flat.shape, 76 / 255))
    assert torch.equal(corrupt(torch.zeros(3, 16, 16), "speckle_noise", 5), torch.zeros(3, 16, 16))
    dark = x.new_full((1, 28, 28), 0.2)  # Fashion-MNIST's size: the fractal is drawn at 32 and cropped
    fogged = corrupt(dark, "fog", 5, seed=0)  # (x + 1.5 f) · peak / (peak + 1.5), f a fractal in [0, 1]
    assert fogged.min() >= 0.2 * 0.2 / 1.7 - 1e-6 and fogged.max() <= 0.2 + 1e-6 and fogged.std() > 0.01
    assert (corrupt(dark, "snow", 5, seed=0) > dark).float().mean() > 0.5  # grey lifted towards white, flakes added


def test_bad_corruption_name_or_severity_lists_the_allowed(tree: Path) -> None:
    x = _texture(tree)
    with pytest.raises(ValueError, match=r"unknown corruption\(s\) 'smoke'; allowed: all, gaussian_noise, shot_noise, "
                                         r".*elastic_transform"):
        corrupt(x, "smoke", 1)
    with pytest.raises(ValueError, match=r"'frost' \(frost: it blends in the frost photographs .*\); allowed: all, "
                                         r"gaussian_noise"):
        corrupt(x, "frost", 1)
    for bad in (0, 6, True, 2.5):
        with pytest.raises(ValueError, match="is not one of 1, 2, 3, 4, 5"):
            corrupt(x, "contrast", bad)
    with pytest.raises(ValueError, match=r"expected a float image tensor .* got torch.uint8"):
        corrupt((x * 255).byte(), "contrast", 1)


def test_synthetic_tree_is_reproducible(tmp_path: Path) -> None:
    a, b = make_image_folder(tmp_path / "a", 2, 3, 16, seed=4), make_image_folder(tmp_path / "b", 2, 3, 16, seed=4)
    files = sorted(p.relative_to(a) for p in a.rglob("*.JPEG"))
    assert len(files) == 2 * 3 + 2 * 1
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert datasets.ImageFolder(str(a / "val")).classes == ["n00000000", "n00000001"]


def test_ffcv_pass_left_mid_epoch_stops_its_prefetch_thread(beton: Path) -> None:
    """A pass the trainer leaves mid-epoch (max_steps, a preemption) must not leave FFCV's prefetch thread decoding:
    a process exiting meanwhile aborted (exit -6) after a finished run. Left at every point of the epoch, the last
    batches included (there the thread blocks on its final put), the thread has ended when the pass is closed."""
    import threading

    from ffcv.loader.epoch_iterator import EpochIterator

    from sigmanens_dist.data.ffcv_io import FFCVLoader

    def prefetching() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if isinstance(t, EpochIterator)]

    loader = FFCVLoader(beton, 4, 0, 1, 1, seed=0, train=True, img_size=24, mean=(0.5,) * 3, std=(0.25,) * 3,
                        batches_ahead=2)
    for taken in (1, len(loader) - 2, len(loader) - 1):
        batches = loader.iter_epoch(0)
        for _ in range(taken):
            next(batches)
        assert prefetching(), "FFCV prefetches in a thread of its own"
        batches.close()
        assert not prefetching(), taken
