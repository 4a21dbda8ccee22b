"""IDX reading and the in-memory Fashion-MNIST dataset."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from sigmanens_dist.data import FASHION_MNIST_ROOT, IdxImageDataset, read_idx

_CODES = {np.uint8: 0x08, np.int8: 0x09, np.int16: 0x0B, np.int32: 0x0C, np.float32: 0x0D, np.float64: 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file's content: magic, big-endian dims, big-endian data."""
    header = struct.pack(">BBBB", 0, 0, _CODES[array.dtype.type], array.ndim)
    return header + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("array", [
    np.arange(24, dtype=np.uint8).reshape(2, 3, 4) * 10,
    np.arange(-12, 12, dtype=np.int32).reshape(2, 3, 4) * 100_000,  # multi-byte: checks the byte order
    np.linspace(-1.5, 2.5, 24).reshape(2, 3, 4),
], ids=["uint8", "int32", "float64"])
def test_read_idx_round_trip(tmp_path: Path, gz: bool, array: np.ndarray) -> None:
    out = read_idx(write_idx(tmp_path / "a.idx", array, gz=gz))
    assert out.shape == (2, 3, 4)
    assert out.dtype == array.dtype and out.dtype.isnative
    assert out.flags.writeable
    np.testing.assert_array_equal(out, array)


def test_gzip_is_detected_from_content_not_name(tmp_path: Path) -> None:
    array = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    out = read_idx(write_idx(tmp_path / "labels-no-gz-suffix", array, gz=True))
    np.testing.assert_array_equal(out, [3, 1, 4, 1, 5])


def test_truncated_data_names_file_and_sizes(tmp_path: Path) -> None:
    path = tmp_path / "short.idx"
    path.write_bytes(idx_bytes(np.zeros((2, 3), dtype=np.uint8))[:-1])
    with pytest.raises(ValueError, match=r"short\.idx: truncated.*\(2, 3\).*6 data bytes, found 5"):
        read_idx(path)


def test_truncated_header_names_file(tmp_path: Path) -> None:
    path = tmp_path / "header.idx"
    path.write_bytes(bytes([0, 0, 0x08, 3]) + struct.pack(">I", 60000))
    with pytest.raises(ValueError, match=r"header\.idx: truncated IDX header; 3 dims need 16 bytes, found 8"):
        read_idx(path)


def test_trailing_bytes_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "long.idx"
    path.write_bytes(idx_bytes(np.zeros(4, dtype=np.uint8)) + b"\x00")
    with pytest.raises(ValueError, match=r"long\.idx: trailing bytes.*4 data bytes, found 5"):
        read_idx(path)


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n", bytes([0, 0, 0x42, 1, 0, 0, 0, 0]), b""],
                         ids=["png", "bad-type-code", "empty"])
def test_not_idx_names_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "notidx.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"notidx\.bin: not an IDX file; expected magic 00 00"):
        read_idx(path)


def test_corrupt_gzip_names_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.gz"
    path.write_bytes(gzip.compress(idx_bytes(np.arange(100, dtype=np.uint8)))[:20])
    with pytest.raises(ValueError, match=r"cut\.gz: corrupt or truncated gzip"):
        read_idx(path)


def _fake_split(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool) -> None:
    suffix = ".gz" if gz else ""
    write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images, gz=gz)
    write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", labels, gz=gz)


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
def test_dataset_from_small_files(tmp_path: Path, gz: bool) -> None:
    images = np.zeros((5, 28, 28), dtype=np.uint8)
    images[1, 3, 4] = 255
    _fake_split(tmp_path, "t10k", images, np.array([0, 9, 2, 2, 7], dtype=np.uint8), gz)
    ds = IdxImageDataset(tmp_path, "test")
    assert len(ds) == 5
    assert ds.images.dtype == torch.uint8 and ds.images.shape == (5, 1, 28, 28)
    assert ds.labels.dtype == torch.int64
    assert ds.labels.tolist() == [0, 9, 2, 2, 7]
    x, y = ds[1]
    assert y == 9
    assert x.dtype == torch.float32 and x.shape == (1, 28, 28)
    assert x[0, 3, 4].item() == pytest.approx((1.0 - 0.2860) / 0.3530)
    assert x[0, 0, 0].item() == pytest.approx(-0.2860 / 0.3530)
    xs, ys = ds.tensors()
    assert xs.shape == (5, 1, 28, 28)
    torch.testing.assert_close(xs[1], x)
    assert ys.tolist() == [0, 9, 2, 2, 7]
    assert ds.num_classes == 10 and ds.in_chans == 1
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot" and len(ds.classes) == 10


def test_subset_takes_the_first_samples(tmp_path: Path) -> None:
    images = np.arange(4, dtype=np.uint8)[:, None, None].repeat(28, 1).repeat(28, 2)
    _fake_split(tmp_path, "train", images, np.array([5, 6, 7, 8], dtype=np.uint8), gz=False)
    assert IdxImageDataset(tmp_path, "train", subset=2).labels.tolist() == [5, 6]
    assert len(IdxImageDataset(tmp_path, "train", subset=100)) == 4
    with pytest.raises(ValueError, match="subset=0 must be a positive number"):
        IdxImageDataset(tmp_path, "train", subset=0)


def test_missing_files_say_where_and_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        IdxImageDataset(tmp_path, "train")
    message = str(info.value)
    assert str(tmp_path / "train-images-idx3-ubyte") in message
    assert str(tmp_path / "train-images-idx3-ubyte.gz") in message
    assert "apt-get install dataset-fashion-mnist" in message


def test_bad_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"split='val' is not one of 'train', 'test'"):
        IdxImageDataset(tmp_path, "val")  # type: ignore[arg-type]


def test_count_mismatch(tmp_path: Path) -> None:
    _fake_split(tmp_path, "train", np.zeros((3, 28, 28), np.uint8), np.zeros(2, np.uint8), gz=False)
    with pytest.raises(ValueError, match=r"holds 3 images but .* holds 2 labels"):
        IdxImageDataset(tmp_path, "train")


def test_label_out_of_range(tmp_path: Path) -> None:
    _fake_split(tmp_path, "train", np.zeros((2, 28, 28), np.uint8), np.array([3, 10], np.uint8), gz=False)
    with pytest.raises(ValueError, match=r"label 10 is out of range; expected 0\.\.9"):
        IdxImageDataset(tmp_path, "train")


def test_swapped_files_are_rejected(tmp_path: Path) -> None:
    _fake_split(tmp_path, "train", np.zeros(2, np.uint8), np.zeros((2, 28, 28), np.uint8), gz=False)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: expected uint8 images of shape \(N, H, W\)"):
        IdxImageDataset(tmp_path, "train")


@pytest.fixture(scope="module")
def fashion_root() -> Path:
    if not FASHION_MNIST_ROOT.is_dir():
        pytest.skip(f"{FASHION_MNIST_ROOT} is absent; install it with `apt-get install dataset-fashion-mnist`")
    return FASHION_MNIST_ROOT


def test_real_fashion_mnist(fashion_root: Path) -> None:
    train = IdxImageDataset(fashion_root, "train")
    test = IdxImageDataset(fashion_root, "test")
    assert train.images.shape == (60000, 1, 28, 28)
    assert test.images.shape == (10000, 1, 28, 28)
    assert train.labels.bincount().tolist() == [6000] * 10
    assert test.labels.bincount().tolist() == [1000] * 10
    assert int(train.labels.min()) == 0 and int(train.labels.max()) == 9
    x, _ = train.tensors()
    # The normalisation constants are Fashion-MNIST's train statistics.
    assert x.mean().item() == pytest.approx(0.0, abs=1e-3)
    assert x.std().item() == pytest.approx(1.0, abs=1e-3)
