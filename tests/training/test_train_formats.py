"""Training from converted data: FFCV ``.beton`` and webdataset shards written by ``sigmanens data convert`` from
the real Fashion-MNIST, trained under 2-process torchrun; resume is exact after SIGKILL on both formats."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.data import FASHION_MNIST_ROOT
from sigmanens_dist.data.loaders import build_data
from sigmanens_dist.distributed.env import DistEnv
from tests.helpers import final_state, interrupted, losses, run_train

pytestmark = pytest.mark.skipif(not FASHION_MNIST_ROOT.is_dir(),
                                reason="needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")

COMMON = ["data.dataset=fashion_mnist", "data.num_workers=1", "model.name=resnet10t", "model.num_members=2",
          "train.batch_size=32", "train.log_every_steps=1", "optim.lr=0.02",
          "data.val_split=100"]  # the split carved at conversion: 700 training samples, 21 steps an epoch


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sigmanens_dist.cli import main

    out = tmp_path_factory.mktemp("converted")
    for fmt in ("ffcv", "webdataset"):
        pytest.importorskip(fmt)
        assert main(["data", "convert", "--dataset", "fashion_mnist", "--format", fmt, "--out", str(out / fmt),
                     "--max-count", "100", "--train-subset", "800", "--test-subset", "200", "--val-split", "100"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ffcv", "webdataset"])
def test_two_rank_training_on_converted_format(converted: Path, tmp_path: Path, fmt: str) -> None:
    assert json.loads((converted / fmt / "classes.json").read_text())["classes"][0] == "T-shirt/top"
    run = tmp_path / fmt
    run_train(run, *COMMON, f"data.format={fmt}", f"data.root={converted / fmt}", "train.max_steps=8", nproc=2)
    assert sorted(losses(run)) == list(range(1, 9))
    metrics = json.loads((run / "final_metrics.json").read_text())
    assert 0.0 <= metrics["acc"] <= 1.0 and metrics["nll"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["ffcv", "webdataset"])
def test_resume_after_sigkill_is_exact(converted: Path, tmp_path: Path, fmt: str) -> None:
    """Same losses and weights as a run never killed: sample order *and* augmentation draws are replayed, into
    the next epoch too (30 steps)."""
    overrides = [*COMMON, f"data.format={fmt}", f"data.root={converted / fmt}", "train.max_steps=30",
                 "checkpoint.every_steps=5", "checkpoint.keep_last=10"]
    run_train(tmp_path / "straight", *overrides)
    run = tmp_path / "killed"
    assert interrupted(run, overrides, signal.SIGKILL, "step_00000005.pt") == -signal.SIGKILL
    run_train(run, *overrides, "checkpoint.resume=auto")
    assert losses(run) == losses(tmp_path / "straight")
    a, b = final_state(tmp_path / "straight"), final_state(run)
    assert all((a[k] == b[k]).all() for k in a)


def test_webdataset_eval_covers_every_sample_once_with_fewer_shards_than_ranks(converted: Path) -> None:
    from torchvision.transforms import v2

    from sigmanens_dist.data.webdataset_io import iter_eval

    manifest = converted / "webdataset" / "test" / "manifest.json"
    tf = v2.Compose([v2.PILToTensor()])
    per_rank = [sum(len(y) for _, y in iter_eval(manifest, r, 5, 16, tf)) for r in range(5)]
    assert per_rank == [40] * 5  # 200 samples in 2 shards, 5 ranks: nobody is left empty


@pytest.mark.parametrize("fmt", ["ffcv", "webdataset"])
def test_converted_splits_are_the_raw_carved_splits(converted: Path, fmt: str) -> None:
    """Conversion carves validation exactly as a raw run does (same samples, same order), keeps the test set apart,
    and a run asking for another split, or for none without saying it validates on test, is refused."""
    env = DistEnv(0, 1, 0, torch.device("cpu"))

    def labels(overrides: list[str], split: str) -> list[int]:
        raw = [] if any(o.startswith("data.format=") for o in overrides) else ["data.train_subset=800",
                                                                                 "data.test_subset=200"]
        cfg = load_config(None, ["data.dataset=fashion_mnist", "data.num_workers=1", *raw, *overrides])
        data = build_data(cfg.data, 50, 0, env)
        return [int(y) for _, ys in getattr(data, split)() for y in ys]

    converted_format = [f"data.format={fmt}", f"data.root={converted / fmt}"]
    raw_val = labels(["data.val_split=100"], "val")
    assert len(raw_val) == 100
    assert labels([*converted_format, "data.val_split=100"], "val") == raw_val
    assert labels([*converted_format, "data.val_split=100"], "test") == labels(["data.val_split=100"], "test")
    assert labels([*converted_format, "data.val_split=0", "data.val_from_test=true"], "val") == \
        labels(["data.val_split=100"], "test")
    with pytest.raises(ValueError, match=r"data.val_split=0.1 data.split_seed=0, but .* was converted with "
                                         r"--val-split 100 --split-seed 0: set data.val_split=100"):
        labels([*converted_format], "val")
    with pytest.raises(ValueError, match=r"data.val_split=100 data.split_seed=3, but"):
        labels([*converted_format, "data.val_split=100", "data.split_seed=3"], "val")
    with pytest.raises(ConfigError, match=r"data.test_subset: applies to data.format=raw only: .*--test-subset"):
        labels([*converted_format, "data.val_split=100", "data.test_subset=50"], "test")


def test_a_folder_of_the_old_layout_is_refused(converted: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(converted / "webdataset", old)
    meta = json.loads((old / "classes.json").read_text())
    (old / "classes.json").write_text(json.dumps({k: meta[k] for k in ("dataset", "classes")}))
    cfg = load_config(None, ["data.dataset=fashion_mnist", "data.format=webdataset", f"data.root={old}"])
    with pytest.raises(ValueError, match=r"converted by an older sigmanens .* convert it again"):
        build_data(cfg.data, 8, 0, DistEnv(0, 1, 0, torch.device("cpu")))
