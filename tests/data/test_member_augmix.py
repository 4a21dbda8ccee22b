"""``train.augmix.member_severity``: member k of an ensemble whose members read their own batches trains under
AugMix at the k-th severity (member 0 included), on its own seed, replaying from any batch; refused in one line where
it cannot apply; and a short training run with it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from sigmanens_dist.config import Config, ConfigError, load_config
from sigmanens_dist.config.schema import AugMixConfig
from sigmanens_dist.data.loaders import build_data
from sigmanens_dist.data.member_streams import member_train_stream
from sigmanens_dist.data.raw import PixelAugMix
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.errors import UsageError
from sigmanens_dist.methods import DeepEnsemble
from sigmanens_dist.models import build_model
from tests.helpers import FMNIST, losses, needs_fashion_mnist, run_train, write_cifar_batches

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SEVERITIES = [1, 5, 9]


@pytest.fixture
def cifar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A tiny generated CIFAR-10 (28 training samples): 7 batches of 4."""
    write_cifar_batches(tmp_path, "cifar10", monkeypatch)
    return ["data.dataset=cifar10", f"data.root={tmp_path}", "data.val_split=2", "data.num_workers=0",
            "train.batch_size=4", "seed=3"]


def _single(cfg: Config, seed: int, severity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of epoch 1 a single run of ``seed`` reads with AugMix at ``severity``."""
    augmix = cfg.train.augmix.model_copy(update={"severity": severity, "member_severity": None})
    return list(build_data(cfg.data, 4, seed, ENV, None, augmix).train.iter_epoch(1))


def test_member_k_trains_at_the_kth_severity_on_its_own_seed_and_replays(cifar: list[str]) -> None:
    cfg = load_config(None, [*cifar, "model.method=deep", "model.num_members=3",
                             f"train.augmix.member_severity={SEVERITIES}", "train.augmix.mixture_width=2"])
    deep = DeepEnsemble([nn.Linear(1, 1) for _ in range(3)])
    built = build_data(cfg.data, 4, cfg.seed, ENV, None, cfg.train.augmix)
    data = member_train_stream(cfg, ENV, built, deep)
    streams = data.train.streams
    assert streams[0] is not built.train  # member 0 too reads at its own severity, not at train.augmix.severity
    for k, stream in enumerate(streams):
        augmix = stream.dataset.dataset.transform.transforms[-1]
        assert isinstance(augmix, PixelAugMix) and augmix.augmix.severity == SEVERITIES[k]
        assert (augmix.augmix.mixture_width, augmix.augmix.all_ops) == (2, False)  # the other settings kept
        assert stream.dataset.dataset.dataset is built.train.dataset.dataset.dataset  # the samples, not a copy
    batches = list(data.train.iter_epoch(1))
    assert len(batches) == 7
    for k, severity in enumerate(SEVERITIES):
        alone = _single(cfg, cfg.seed + k, severity)
        for (x, y), (xk, yk) in zip(batches, alone, strict=True):
            assert torch.equal(x[4 * k:4 * k + 4], xk) and torch.equal(y[4 * k:4 * k + 4], yk)
        if k:  # the same samples and seeds at member 0's severity give other pixels
            at_first = _single(cfg, cfg.seed + k, SEVERITIES[0])
            assert sum(not torch.equal(x[4 * k:4 * k + 4], x0) for (x, _), (x0, _) in zip(batches, at_first,
                                                                                          strict=True)) >= 6
    for start in (1, 4, 6):
        for (x, y), (x2, y2) in zip(batches[start:], data.train.iter_epoch(1, start), strict=True):
            assert torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize(("overrides", "problem"), [
    (["model.num_members=4", "train.augmix.member_severity=[1,3,5]"],
     "train.augmix.member_severity: gives 3 severities for model.num_members=4; it takes exactly one per member "
     "(got [1, 3, 5])"),
    (["model.num_members=1", "train.augmix.member_severity=[3]"],
     "train.augmix.member_severity: needs an ensemble: model.num_members=1 has one member; it applies to "
     "model.num_members >= 2 (set severity for one network) (got [3])"),
    (["model.method=single", "train.augmix.member_severity=[1,3,5,7]"],
     "train.augmix.member_severity: needs an ensemble: model.method=single has one member"),
    (["model.member_batches=shared", "train.augmix.member_severity=[1,3,5,7]"],
     "train.augmix.member_severity: needs members that read their own batches, but model.member_batches='shared' "
     "gives every member one batch; set model.member_batches=independent (or null for sigma, film, deep) "
     "(got [1, 3, 5, 7])"),
    (["train.augmix.member_severity=[0,3,11,7]"],
     "train.augmix.member_severity: every entry must be a severity 1–10, one per member; [0, 11] are not "
     "(got [0, 3, 11, 7])"),
    (["train.augmix.severity=5", "train.augmix.member_severity=[1,3,5,7]"],
     "train.augmix.severity: is not used with member_severity=[1, 3, 5, 7] (member k trains at its k-th entry); "
     "drop one of them (got 5)"),
])
def test_member_severity_is_refused_in_one_line_where_it_cannot_apply(overrides: list[str], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.dataset=fashion_mnist", *overrides], check_data=False)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"  - {problem}")


def test_member_severity_defaults_to_none_and_is_read_as_a_list() -> None:
    assert load_config(None, ["train.augmix=true"], check_data=False).train.augmix.member_severity is None
    cfg = load_config(None, ["data.dataset=fashion_mnist", "train.augmix.member_severity=[1,3,5,7]"],
                      check_data=False)
    assert cfg.train.augmix == AugMixConfig(member_severity=[1, 3, 5, 7])


@pytest.mark.parametrize("method", ["batch", "packed"])
def test_a_method_whose_members_share_one_batch_is_refused_at_trainer_set_up(cifar: list[str], method: str) -> None:
    """batch and packed share one batch by default, which only the built model tells (the config sits below
    methods/): member_train_stream, called by the trainer before any step, refuses it."""
    cfg = load_config(None, [*cifar, f"model.method={method}", "model.name=resnet10t", "model.num_members=2",
                             "train.augmix.member_severity=[2,8]"])
    data = build_data(cfg.data, 4, cfg.seed, ENV, None, cfg.train.augmix)
    model = build_model(cfg, data.num_classes, data.in_chans)
    with pytest.raises(UsageError, match=rf"^train.augmix.member_severity=\[2, 8\] needs members that read their "
                                         rf"own batches, but model.method={method} gives every member one batch "
                                         r"\(model.member_batches unset: the method's default, shared\); set "
                                         r"model.member_batches=independent, or drop member_severity$"):
        member_train_stream(cfg, ENV, data, model)
    independent = cfg.model_copy(update={"model": cfg.model.model_copy(update={"member_batches": "independent"})})
    assert len(member_train_stream(independent, ENV, data, model).train.streams) == 2


@needs_fashion_mnist
def test_a_short_fashion_mnist_run_trains_each_member_at_its_severity_and_records_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_train(run, *FMNIST, "model.name=test_resnet", "model.num_members=2", "train.max_steps=3",
              "train.batch_size=16", "train.log_every_steps=1", "data.test_subset=32", "eval.at_end=false",
              "train.augmix.member_severity=[2,7]")
    assert sorted(losses(run)) == [1, 2, 3] and all(math.isfinite(v) for v in losses(run).values())
    saved = yaml.safe_load((run / "config.yaml").read_text())["train"]["augmix"]
    assert saved == {"severity": 3, "mixture_width": 3, "chain_depth": -1, "alpha": 1.0, "member_severity": [2, 7]}
