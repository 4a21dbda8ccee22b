"""Training from converted data: FFCV ``.beton`` and webdataset shards written by ``sigmanens data convert`` from
the real Fashion-MNIST, trained under 2-process torchrun; resume is exact after SIGKILL on both formats."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from sigmanens_dist.data import FASHION_MNIST_ROOT
from tests.helpers import final_state, interrupted, losses, run_train

pytestmark = pytest.mark.skipif(not FASHION_MNIST_ROOT.is_dir(),
                                reason="needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")

COMMON = ["data.dataset=fashion_mnist", "data.num_workers=1", "model.name=resnet10t", "model.num_members=2",
          "train.batch_size=32", "train.log_every_steps=1", "optim.lr=0.02",
          "data.val_split=0", "data.val_from_test=true"]  # 25 steps an epoch; converted data validates on test


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sigmanens_dist.data.convert import convert

    out = tmp_path_factory.mktemp("converted")
    for fmt in ("ffcv", "webdataset"):
        pytest.importorskip(fmt)
        convert("fashion_mnist", None, fmt, out / fmt, max_count=100, train_subset=800, val_subset=200)
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

    manifest = converted / "webdataset" / "val" / "manifest.json"
    tf = v2.Compose([v2.PILToTensor()])
    per_rank = [sum(len(y) for _, y in iter_eval(manifest, r, 5, 16, tf)) for r in range(5)]
    assert per_rank == [40] * 5  # 200 samples in 2 shards, 5 ranks: nobody is left empty
