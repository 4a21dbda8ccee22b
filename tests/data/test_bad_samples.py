"""Bad data: an unreadable image or an out-of-range label stops the run naming the sample, or, with
``data.on_bad_sample=skip``, is skipped and counted (also across DataLoader worker processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.data.bad_samples import BadSampleError, BadSamples, Checked, collate_present
from sigmanens_dist.data.synthetic_tree import make_image_folder
from sigmanens_dist.data.webdataset_io import Shard, ShardError, _checked_decode
from tests.helpers import run_train


class _Flaky(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == 3:
            raise OSError("truncated image")
        return torch.full((2,), float(i)), 7 if i == 5 else 1


def test_error_policy_names_the_sample() -> None:
    ds = Checked(_Flaky(), num_classes=4, bad=BadSamples("error"), split="train")
    with pytest.raises(BadSampleError, match=r"train sample 3: OSError: truncated image .*on_bad_sample=skip"):
        ds[3]
    with pytest.raises(BadSampleError, match=r"train sample 5: ValueError: label 7 outside 0\.\.3"):
        ds[5]


def test_skip_policy_drops_and_counts() -> None:
    bad = BadSamples("skip")
    ds = Checked(_Flaky(), num_classes=4, bad=bad, split="train")
    x, y = collate_present([ds[i] for i in range(8)])
    assert x.shape == (6, 2) and y.tolist() == [1] * 6
    assert bad.count == 2
    with pytest.raises(ValueError, match="all 2 samples of a batch were unreadable"):
        collate_present([None, None])
    with pytest.raises(ValueError, match=r"data\.on_bad_sample='maybe'"):
        BadSamples("maybe")


def test_webdataset_decode_goes_through_the_policy(tmp_path: Path) -> None:
    shard = Shard(tmp_path / "train-000000.tar", 1, 0, "")
    parts = {"jpg": b"not a jpeg", "cls": b"1"}
    with pytest.raises(ShardError, match=r"train-000000.tar, sample key 'k7': cannot decode"):
        _checked_decode(shard, "k7", parts, 10, BadSamples("error"))
    bad = BadSamples("skip")
    assert _checked_decode(shard, "k7", parts, 10, bad) is None
    assert bad.count == 1


def test_ffcv_cannot_skip() -> None:
    with pytest.raises(ConfigError, match=r"data\.on_bad_sample: FFCV decodes whole batches"):
        load_config(None, ["data.format=ffcv", "data.on_bad_sample=skip", "data.val_split=0",
                           "data.val_from_test=true"], check_data=False)


@pytest.mark.slow
def test_corrupt_jpeg_in_a_training_run(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "tree", num_classes=3, per_class=24, size=40, seed=0, val_per_class=4)
    victim = sorted((root / "train").rglob("*.JPEG"))[5]
    victim.write_bytes(b"\xff\xd8\xff garbage")
    common = ["data.dataset=imagefolder", f"data.root={root}", "data.img_size=32", "data.num_workers=1",
              "model.name=resnet10t", "model.num_members=2", "train.batch_size=8", "train.max_steps=12",
              "train.log_every_steps=4"]
    proc = run_train(tmp_path / "strict", *common, expect=1)
    assert str(victim) in proc.stderr and "on_bad_sample=skip" in proc.stderr
    run = tmp_path / "lenient"
    run_train(run, *common, "data.on_bad_sample=skip")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counts = [r["data/bad_samples"] for r in rows if "data/bad_samples" in r]
    assert counts[-1] >= 1  # 12 steps × 8 of 72 images: the corrupt one is drawn at least once
