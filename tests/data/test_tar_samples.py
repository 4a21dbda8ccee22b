"""One tar-shard sample grouping (data/tar_samples.py): training's shard reader and ``sigmanens predict`` see the
same samples of a shard, also when its members sit in nested folders."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from sigmanens_dist.data.tar_samples import sample_key
from sigmanens_dist.data.webdataset_io import Shard, _records
from sigmanens_dist.predict.inputs import Unit, read_unit

# Two samples share the stem 0001 in different folders; one sits two folders down with an upper-case extension.
MEMBERS = [("train/a/0001.jpg", b"A"), ("train/a/0001.cls", b"1"), ("train/b/0001.jpg", b"B"),
           ("train/b/0001.cls", b"2"), ("train/c/d/0002.JPG", b"C"), ("train/c/d/0002.cls", b"3"),
           ("0003.seg.png", b"D"), ("0003.jpg", b"E")]
KEYS = ["train/a/0001", "train/b/0001", "train/c/d/0002", "0003"]


def _shard(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in MEMBERS:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_training_and_predict_group_a_nested_shard_alike(tmp_path: Path) -> None:
    path = _shard(tmp_path / "shard-000000.tar")
    trained = list(_records(Shard(path, len(KEYS), path.stat().st_size, "")))
    assert [key for key, _ in trained] == KEYS
    assert trained[2][1] == {"jpg": b"C", "cls": b"3"} and trained[3][1] == {"seg.png": b"D", "jpg": b"E"}
    predicted = list(read_unit(Unit(id="shard", kind="shard", source=path)))
    assert [s.error for s in predicted] == [None] * len(KEYS)
    assert [s.id for s in predicted] == [f"{path.as_posix()}:{key}" for key in KEYS]
    assert [s.payload for s in predicted] == [parts["jpg"] for _, parts in trained]


def test_a_key_keeps_its_folders_and_the_extension_is_lower_case() -> None:
    assert sample_key("a/b/0001.seg.PNG") == ("a/b/0001", "seg.png")
    assert sample_key("0001.jpg") == ("0001", "jpg")
