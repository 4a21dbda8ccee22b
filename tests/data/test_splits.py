"""Honest splits: validation (and a calibration split, when asked for) is carved from the training pool by the seed,
disjoint from train; test is untouched."""

from __future__ import annotations

import pytest
import torch

from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.data.idx import FASHION_MNIST_ROOT, IdxImageDataset
from sigmanens_dist.data.raw import SyntheticImages, build_datasets, split_indices

needs_fmnist = pytest.mark.skipif(not FASHION_MNIST_ROOT.is_dir(),
                                  reason="needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")


def test_split_indices_disjoint_complete_and_seeded() -> None:
    train, val, calib = split_indices(1000, 0.1, seed=3)
    assert len(val) == 100 and len(train) == 900 and calib == []
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(3 + 0x5EED))  # the split every run has had
    assert val == sorted(perm[:100].tolist())
    assert not set(train) & set(val) and sorted(train + val) == list(range(1000))
    assert (train, val, calib) == split_indices(1000, 0.1, seed=3)
    assert val != split_indices(1000, 0.1, seed=4)[1]
    assert len(split_indices(1000, 250, seed=0)[1]) == 250  # a count
    assert len(split_indices(5, 0.01, seed=0)[1]) == 1  # a fraction never rounds to an empty split
    assert split_indices(10, 0, seed=0) == (list(range(10)), [], [])
    with pytest.raises(ValueError, match=r"data.val_split=10 takes 10 of the 10 training samples"):
        split_indices(10, 10, seed=0)


def test_calibration_split_is_a_third_disjoint_split_that_leaves_val_where_it_was() -> None:
    train, val, calib = split_indices(1000, 0.1, seed=3, calib_split=150)
    assert (len(train), len(val), len(calib)) == (750, 100, 150)
    assert not set(train) & set(val) and not set(train) & set(calib) and not set(val) & set(calib)
    assert sorted(train + val + calib) == list(range(1000)) and calib == sorted(calib)
    assert (train, val, calib) == split_indices(1000, 0.1, seed=3, calib_split=150)  # deterministic
    assert calib != split_indices(1000, 0.1, seed=4, calib_split=150)[2]  # drawn from the split seed
    # the validation split is the one a run without calibration split has (best.pt is chosen on the same samples),
    # and the calibration samples are what such a run trains on beyond this one's
    no_calib = split_indices(1000, 0.1, seed=3)
    assert val == no_calib[1] and sorted(train + calib) == no_calib[0]
    # beside a validation split that is the test set (val_split 0), calib is still carved from the pool
    train0, val0, calib0 = split_indices(100, 0, seed=0, calib_split=10)
    assert val0 == [] and len(calib0) == 10 and sorted(train0 + calib0) == list(range(100))
    with pytest.raises(ValueError, match=r"^data.calib_split=90 with data.val_split=10 takes 100 of the 100 training "
                                         r"samples, leaving none to train on; lower data.calib_split"):
        split_indices(100, 10, seed=0, calib_split=90)


def test_calibration_dataset_holds_its_pool_samples_unaugmented() -> None:
    cfg = load_config(None, ["data.dataset=synthetic", "data.train_subset=200", "data.val_split=20",
                             "data.calib_split=30"])
    bundle = build_datasets(cfg.data, cfg.data_root())
    assert (len(bundle.train), len(bundle.val), len(bundle.calib)) == (150, 20, 30)
    train_idx = bundle.train.dataset.indices
    assert len({*train_idx, *bundle.val_indices, *bundle.calib_indices}) == 200  # disjoint, the whole pool
    pool = SyntheticImages(200, size=16, seed=0)
    for i in (0, 17, 29):  # as stored: the training augmentation (a random flip) is not applied
        x, y = bundle.calib[i]
        assert torch.equal(x, pool[bundle.calib_indices[i]][0]) and y == pool[bundle.calib_indices[i]][1]
    plain = build_datasets(cfg.data.model_copy(update={"calib_split": 0}), cfg.data_root())
    assert plain.calib is None and plain.calib_indices == [] and plain.val_indices == bundle.val_indices


@needs_fmnist
def test_fashion_mnist_val_is_carved_from_train_and_test_is_untouched() -> None:
    common = ["data.train_subset=1000", "data.val_split=0.2", "data.test_subset=300"]
    cfg = load_config(None, [*common, "data.split_seed=7"])
    bundle = build_datasets(cfg.data, cfg.data_root())
    assert (len(bundle.train), len(bundle.val), len(bundle.test)) == (800, 200, 300)
    train_idx = bundle.train.dataset.indices  # SeededAugment(Subset(pool, train positions))
    assert not set(train_idx) & set(bundle.val_indices)
    assert sorted([*train_idx, *bundle.val_indices]) == list(range(1000))
    # val reads the training images without augmentation; test is the t10k file
    pool = IdxImageDataset(FASHION_MNIST_ROOT, "train", subset=1000)
    for i in (0, 57, 199):
        x, y = bundle.val[i]
        torch.testing.assert_close(x, pool[bundle.val_indices[i]][0])
        assert y == pool[bundle.val_indices[i]][1]
    test = IdxImageDataset(FASHION_MNIST_ROOT, "test", subset=300)
    assert torch.equal(torch.stack([bundle.test[i][0] for i in range(300)]), test.tensors()[0])
    # fixed by data.split_seed, whatever the run's seed
    again = load_config(None, [*common, "data.split_seed=7", "seed=3"])
    assert build_datasets(again.data, again.data_root()).val_indices == bundle.val_indices
    other = load_config(None, [*common, "data.split_seed=8"])
    assert build_datasets(other.data, other.data_root()).val_indices != bundle.val_indices


@needs_fmnist
def test_test_as_validation_only_on_request() -> None:
    with pytest.raises(ConfigError, match=r"data.val_split: 0 means validating on the test set; say so with "
                                          r"data.val_from_test=true"):
        load_config(None, ["data.val_split=0"])
    cfg = load_config(None, ["data.val_split=0", "data.val_from_test=true", "data.train_subset=100",
                             "data.val_subset=50"])
    bundle = build_datasets(cfg.data, cfg.data_root())
    assert (len(bundle.train), len(bundle.val), bundle.val_indices) == (100, 50, [])
    torch.testing.assert_close(bundle.val[3][0], bundle.test[3][0])


@pytest.mark.parametrize(("overrides", "match"), [
    (["data.val_split=1.0"], r"a fraction must be < 1"),
    (["data.val_split=-3"], r"must be a fraction in \(0, 1\), a count ≥ 1, or 0"),
    (["data.val_split=0.2", "data.val_from_test=true"], r"data.val_from_test: true needs data.val_split=0"),
    (["data.calib_split=-5"], r"data.calib_split: must be >= 0 \(got -5\)"),
    (["data.calib_split=5", "data.format=webdataset", "data.root=/nowhere"],
     r"data.calib_split: applies to data.format=raw only: data.format=webdataset reads the train/val/test splits"),
])
def test_split_config_errors(overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides, check_data=False)
