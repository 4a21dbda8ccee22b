"""``train.augmix``: torchvision's AugMix on the operations disjoint from the test corruptions, applied by the raw
Fashion-MNIST and CIFAR readers to each training sample under its seed (so a resumed run replays it), refused in
one line wherever it would be dropped; and a short training run with it."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torchvision.transforms import v2

from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.config.schema import AugMixConfig
from sigmanens_dist.data.raw import PixelAugMix, build_datasets
from sigmanens_dist.data.sampler import sample_seed
from tests.helpers import FMNIST, losses, needs_fashion_mnist, run_train, write_cifar_batches

# AugMix's operations that overlap the test corruptions (brightness, contrast, fog, ...): never drawn
CORRUPTION_LIKE = {"Brightness", "Color", "Contrast", "Sharpness"}


def _disturb(k: int) -> None:
    """Global generators anywhere else than where the first read had them (another worker, a resumed run)."""
    np.random.seed(100 + k)
    random.seed(200 + k)
    torch.manual_seed(300 + k)


def _keys(n: int) -> list[tuple[int, int]]:
    return [(i, sample_seed(5, 1, i)) for i in range(n)]


def test_the_option_builds_torchvision_augmix_on_the_corruption_disjoint_ops() -> None:
    cfg = load_config(None, ["train.augmix.severity=5", "train.augmix.mixture_width=2", "train.augmix.chain_depth=2",
                             "train.augmix.alpha=0.5"], check_data=False).train.augmix
    augmix = PixelAugMix(cfg, (0.5,), (0.25,)).augmix
    assert isinstance(augmix, v2.AugMix) and augmix.all_ops is False
    assert (augmix.severity, augmix.mixture_width, augmix.chain_depth, augmix.alpha) == (5, 2, 2, 0.5)


def test_augmix_draws_only_operations_disjoint_from_the_test_corruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[str] = []
    apply = v2.AugMix._apply_image_or_video_transform

    def recording(self: v2.AugMix, image: torch.Tensor, transform_id: str, *args: object, **kwargs: object
                  ) -> torch.Tensor:
        drawn.append(transform_id)
        return apply(self, image, transform_id, *args, **kwargs)

    monkeypatch.setattr(v2.AugMix, "_apply_image_or_video_transform", recording)
    step = PixelAugMix(AugMixConfig(), (0.5,), (0.25,))
    image = torch.randn(1, 12, 12, generator=torch.Generator().manual_seed(0))
    for _ in range(40):
        step(image)
    assert set(drawn) == set(v2.AugMix._PARTIAL_AUGMENTATION_SPACE)  # all seven, over 40 images
    assert not set(drawn) & CORRUPTION_LIKE


@needs_fashion_mnist
def test_fashion_mnist_samples_are_augmixed_in_range_and_replay_from_their_seed() -> None:
    cfg = load_config(None, [*FMNIST, "train.augmix={}"])
    assert cfg.train.augmix == AugMixConfig()
    plain = build_datasets(cfg.data, cfg.data_root()).train
    mixed = build_datasets(cfg.data, cfg.data_root(), augmix=cfg.train.augmix).train
    keys = _keys(24)
    _disturb(0)
    first = [mixed[key][0] for key in keys]
    mean, std = DATASETS["fashion_mnist"].mean[0], DATASETS["fashion_mnist"].std[0]
    low, high = (0 - mean) / std, (1 - mean) / std  # what pixels 0 and 255 normalise to
    changed = 0
    for key, x in zip(keys, first, strict=True):
        p, y = plain[key]
        assert y == mixed[key][1] and x.shape == p.shape == (1, 28, 28) and x.dtype == p.dtype == torch.float32
        assert torch.isfinite(x).all() and x.min() >= low - 1e-5 and x.max() <= high + 1e-5
        changed += not torch.allclose(x, p, atol=1e-5)
    assert changed >= 20  # a mixed sample equals its crop only when every chain's operations left it unchanged
    _disturb(1)
    again = [mixed[key][0] for key in reversed(keys)][::-1]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(mixed[(0, 1)][0], mixed[(0, 2)][0])  # another seed: other draws


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_samples_are_augmixed_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    write_cifar_batches(tmp_path, name, monkeypatch)
    cfg = load_config(None, [f"data.dataset={name}", f"data.root={tmp_path}", "data.val_split=2",
                             "train.augmix.severity=6"])
    plain = build_datasets(cfg.data, cfg.data_root()).train
    mixed = build_datasets(cfg.data, cfg.data_root(), augmix=cfg.train.augmix).train
    mean, std = torch.tensor(DATASETS[name].mean).view(3, 1, 1), torch.tensor(DATASETS[name].std).view(3, 1, 1)
    keys = _keys(len(plain))
    for key in keys:
        x = mixed[key][0]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and torch.equal(x, mixed[key][0])
        assert ((x >= (0 - mean) / std - 1e-5) & (x <= (1 - mean) / std + 1e-5)).all()
    assert sum(not torch.allclose(mixed[k][0], plain[k][0], atol=1e-5) for k in keys) >= len(keys) - 1


@pytest.mark.parametrize(("overrides", "problem"), [
    (["data.dataset=synthetic"], "train.augmix: data.dataset='synthetic' does not apply it (its readers keep their "
                                 "own augmentation); it applies to data.dataset fashion_mnist, cifar10, cifar100 "
                                 "only; set it to null"),
    (["data.dataset=imagenet"], "train.augmix: data.dataset='imagenet' does not apply it"),
    (["data.dataset=cifar10", "data.format=webdataset"], "train.augmix: data.format='webdataset' does not apply it "
                                                         "(its readers keep their own crop recipe); it applies to "
                                                         "data.format=raw only; set it to null"),
    (["data.format=ffcv"], "train.augmix: data.format='ffcv' does not apply it"),
    (["data.dataset=imagenet", "train.randaugment=rand-m9"], "train.augmix: two auto-augmentations: "
                                                             "train.randaugment='rand-m9' is set too; set one of them "
                                                             "to null"),
])
def test_augmix_is_refused_where_it_would_be_dropped_or_doubled(overrides: list[str], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*overrides, "train.augmix=true"], check_data=False)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"  - {problem}")
    assert info.value.problems[0].endswith("(got {'severity': 3, 'mixture_width': 3, 'chain_depth': -1, "
                                           "'alpha': 1.0})")


@pytest.mark.parametrize(("override", "problem"), [
    ("train.augmix.severity=11", "train.augmix.severity: must be <= 10 (got 11)"),
    ("train.augmix.severity=0", "train.augmix.severity: must be >= 1 (got 0)"),
    ("train.augmix.chain_depth=0", "train.augmix.chain_depth: must be -1 (a depth drawn from 1–3 per chain) or >= 1 "
                                   "(got 0)"),
    ("train.augmix.alpha=0", "train.augmix.alpha: must be > 0.0 (got 0)"),
    ("train.augmix.sevrity=3", "train.augmix.sevrity: unknown key (did you mean 'severity'?) (got 3)"),
    ("train.augmix=5", "train.augmix: must be a mapping of severity, mixture_width, chain_depth and alpha, true (the "
                       "defaults) or null (off) (got 5)"),
])
def test_a_bad_augmix_setting_is_one_line_naming_the_value(override: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override], check_data=False)
    assert info.value.problems == [f"  - {problem}"]


def test_augmix_is_off_by_default_and_switched_on_by_true_or_a_mapping() -> None:
    assert load_config(None, check_data=False).train.augmix is None
    assert load_config(None, ["train.augmix=false"], check_data=False).train.augmix is None
    for on in ("train.augmix=true", "train.augmix={}"):
        assert load_config(None, [on], check_data=False).train.augmix == AugMixConfig(severity=3, mixture_width=3,
                                                                                     chain_depth=-1, alpha=1.0)


@needs_fashion_mnist
def test_a_short_fashion_mnist_run_trains_with_augmix_and_records_it(tmp_path: Path) -> None:
    """The run trains on augmixed samples: its first loss (same weights, same batch) is not the one of the same run
    without AugMix, which it would be if the trainer dropped the option on its way to the data."""
    run, plain = tmp_path / "run", tmp_path / "plain"
    common = (*FMNIST, "model.name=test_resnet", "model.num_members=2", "train.max_steps=3", "train.batch_size=16",
              "train.log_every_steps=1", "data.test_subset=32", "eval.at_end=false")
    run_train(run, *common, "train.augmix.severity=4")
    run_train(plain, *common)
    assert sorted(losses(run)) == [1, 2, 3] and all(math.isfinite(v) for v in losses(run).values())
    assert losses(run)[1] != losses(plain)[1], "the first batch was not augmixed"
    saved = yaml.safe_load((run / "config.yaml").read_text())["train"]["augmix"]
    assert saved == {"severity": 4, "mixture_width": 3, "chain_depth": -1, "alpha": 1.0, "member_severity": None}
