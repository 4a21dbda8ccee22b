"""Issue 10's recipe knobs: each test fails if its knob stops doing its job (or is ignored by the trainer)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import timm
import torch
import torch.nn.functional as F

from sigmanens_dist import convert_to_sigma_ensemble, diversity_loss
from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.data.loaders import MapStyleStream, MemberStream, build_data, member_seed
from sigmanens_dist.distributed import DistEnv
from sigmanens_dist.models import build_model, param_groups
from sigmanens_dist.objective import member_logits, member_loss, member_streams, sigma_lr, training_loss
from sigmanens_dist.train import _optimizer, run
from tests.helpers import SYNTHETIC, TINY_VIT, final_state, losses

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _tiny_cnn() -> torch.nn.Module:
    return timm.create_model("resnet10t", num_classes=3, in_chans=1)


# -- train.member_loss -------------------------------------------------------------------------------------------
def test_member_loss_mean_is_the_old_loss_and_sum_gives_each_member_a_single_models_gradient() -> None:
    torch.manual_seed(0)
    m, b, k = 4, 5, 3
    logits = torch.randn(m, b, k, requires_grad=True)
    y = torch.randint(0, k, (b,))
    mean = member_loss(logits, y, 0.1, "mean")
    torch.testing.assert_close(mean, F.cross_entropy(logits.flatten(0, 1), y.repeat(m), label_smoothing=0.1))
    total = member_loss(logits, y, 0.1, "sum")
    torch.testing.assert_close(total, m * mean)
    (grad,) = torch.autograd.grad(total, logits)
    for i in range(m):  # member i's logits get exactly the gradient of a single model's loss
        (single,) = torch.autograd.grad(F.cross_entropy(logits[i], y, label_smoothing=0.1), logits)
        torch.testing.assert_close(grad[i], single[i])


def test_member_loss_takes_member_major_and_soft_labels() -> None:
    torch.manual_seed(1)
    m, b, k = 3, 4, 5
    logits = torch.randn(m, b, k)
    y = torch.randint(0, k, (m * b,))  # each member its own samples
    want = sum(F.cross_entropy(logits[i], y[i * b:(i + 1) * b]) for i in range(m))
    torch.testing.assert_close(member_loss(logits, y, reduction="sum"), want)
    soft = F.one_hot(y[:b], k).float()
    torch.testing.assert_close(member_loss(logits, soft), member_loss(logits, y[:b]))
    with pytest.raises(ValueError, match="mean, sum, got 'avg'"):
        member_loss(logits, y, reduction="avg")
    with pytest.raises(ValueError, match="labels for 7 samples do not fit logits of 3 members × 4 samples"):
        member_loss(logits, y[:7])


def test_training_loss_reads_every_objective_knob() -> None:
    ens = convert_to_sigma_ensemble(_tiny_cnn(), 2)
    logits = ens(torch.randn(4, 1, 16, 16))
    y = torch.tensor([0, 1, 2, 0])

    def cfg(reduction: str, normalize: str) -> SimpleNamespace:
        return SimpleNamespace(train=SimpleNamespace(label_smoothing=0.0, member_loss=reduction),
                               reg=SimpleNamespace(tau=0.5, lam=0.1, normalize=normalize))

    loss, task, div = training_loss(ens, logits, y, cfg("sum", "members"))
    torch.testing.assert_close(task, member_loss(logits, y, reduction="sum"))
    torch.testing.assert_close(div, ens.diversity_loss(0.5) / 2)
    torch.testing.assert_close(loss, task + 0.1 * div)


# -- reg.normalize ------------------------------------------------------------------------------------------------
def test_diversity_loss_normalisations() -> None:
    gamma = torch.randn(4, 30)
    total = diversity_loss(gamma, 0.5)
    torch.testing.assert_close(diversity_loss(gamma, 0.5, "members"), total / 4)
    torch.testing.assert_close(diversity_loss(gamma, 0.5, "mean"), total / 120)
    # "mean" keeps the value per (member, feature) whatever the size: twice the features, the same value
    torch.testing.assert_close(diversity_loss(gamma.repeat(1, 2), 0.5, "mean"), total / 120)
    with pytest.raises(ValueError, match="none, members, mean, got 'sum'"):
        diversity_loss(gamma, 0.5, "sum")


# -- model.gamma_init_* and model.affine_init ---------------------------------------------------------------------
def test_affine_init_divide_preserves_the_function_and_plain_keeps_the_source_affine() -> None:
    src = _tiny_cnn().eval()
    with torch.no_grad():  # non-trivial source affines
        for mod in src.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.2, 0.2)
    x = torch.randn(2, 1, 16, 16)
    divide = convert_to_sigma_ensemble(src, 3).eval()
    torch.testing.assert_close(divide(x), src(x).expand(3, -1, -1), atol=1e-5, rtol=1e-4)
    plain = convert_to_sigma_ensemble(src, 3, affine_init="plain").eval()
    name, layer = plain.sigma_layers()[0]
    torch.testing.assert_close(layer.weight, src.get_submodule(name).weight.detach().expand(3, -1))
    assert not torch.allclose(plain(x), divide(x), atol=1e-3)  # σ(γ) now scales each member
    with pytest.raises(ValueError, match="affine_init must be one of divide, plain, got 'scaled'"):
        convert_to_sigma_ensemble(src, 3, affine_init="scaled")


def test_gamma_init_all_on_through_the_config() -> None:
    ens = build_model(load_config(None, ["model.name=resnet10t"], check_data=False), 3, 1)  # the default: 3, 0.1
    assert ens.sharing()["all"] == ens.num_members  # every member "on" for every feature
    assert torch.sigmoid(ens.gamma()).min() > 0.9
    cfg = load_config(None, ["model.name=resnet10t", "model.gamma_init_mean=0", "model.gamma_init_std=1"],
                      check_data=False)
    before = build_model(cfg, 3, 1)
    assert before.sharing()["all"] < before.num_members  # N(0, 1) switches some members off


# -- optim.sigma_lr_scale -----------------------------------------------------------------------------------------
def test_sigma_lr_scale_gives_the_sigma_store_its_own_rate_through_the_schedule() -> None:
    cfg = load_config(None, ["model.name=resnet10t", "optim.lr=0.05", "optim.sigma_lr_scale=4"], check_data=False)
    model = build_model(cfg, 3, 1)
    by_m = load_config(None, ["model.name=resnet10t", "optim.lr=0.05", "optim.sigma_lr_scale=num_members",
                              "model.num_members=4"], check_data=False)
    assert sigma_lr(by_m, model) == pytest.approx(0.2)  # M × lr
    opt = _optimizer(cfg, param_groups(model, cfg.optim.weight_decay, sigma_lr(cfg, model)))
    store = [g for g in opt.param_groups if any(p is model.sigma.flat for p in g["params"])]
    assert len(store) == 1 and store[0]["lr"] == pytest.approx(0.2) and store[0]["weight_decay"] == 0
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    opt.step()  # no gradients yet: changes nothing, keeps the scheduler's call order
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.025, 0.025, 0.1])
    # scale 1 keeps the original two groups, so checkpoints of earlier runs still resume
    assert sigma_lr(load_config(None, check_data=False), model) == pytest.approx(4 * 0.1)  # default: M × lr
    assert sigma_lr(load_config(None, ["optim.sigma_lr_scale=1"], check_data=False), model) is None
    assert len(param_groups(model, 5e-4)) == 2


# -- model.member_batches -----------------------------------------------------------------------------------------
def _data(*extra: str):
    """The train data of a tiny synthetic run, built as the trainer builds it."""
    cfg = load_config(None, [*SYNTHETIC, "data.train_subset=64", "train.batch_size=8", *extra], check_data=False)
    return build_data(cfg.data, cfg.train.batch_size, cfg.seed, ENV, None, member_streams(cfg))


def test_independent_member_batches_are_member_major_and_resume_exactly() -> None:
    data = _data("model.num_members=3", "model.member_batches=independent")
    assert isinstance(data.train, MemberStream) and data.member_major
    shared = _data("model.num_members=3", "model.member_batches=shared")
    assert isinstance(shared.train, MapStyleStream) and not shared.member_major
    batches = list(data.train.iter_epoch(1))
    x, y = batches[0]
    assert x.shape[0] == y.shape[0] == 3 * 8
    x0, y0 = next(iter(shared.train.iter_epoch(1)))
    assert torch.equal(x[:8], x0) and torch.equal(y[:8], y0)  # member 0 reads what a shared run reads
    assert not torch.equal(x[:8], x[8:16]) and not torch.equal(x[8:16], x[16:])  # the others their own shuffle
    for start in (0, 3, len(batches) - 1):  # a run resumed mid-epoch sees the batches it would have seen
        for (xa, ya), (xb, yb) in zip(data.train.iter_epoch(1, start), batches[start:], strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(next(iter(data.train.iter_epoch(2)))[0], x)  # a new order every epoch
    assert len({member_seed(5, m) for m in range(4)}) == 4 and member_seed(5, 0) == 5


def test_member_logits_routes_member_major_batches() -> None:
    ens = convert_to_sigma_ensemble(_tiny_cnn(), 2).eval()
    x = torch.randn(3, 1, 16, 16)
    torch.testing.assert_close(member_logits(ens, torch.cat([x, x]), True), ens(x))
    other = torch.randn(3, 1, 16, 16)
    out = member_logits(ens, torch.cat([x, other]), True)
    torch.testing.assert_close(out[1], ens(other)[1])


def test_auto_knobs_resolve_to_what_runs() -> None:
    scratch = load_config(None, check_data=False).model
    assert (scratch.affine_init, scratch.member_batches) == ("plain", "independent")
    other = load_config(None, ["model.pretrained=true", "data.format=ffcv"], check_data=False).model
    assert (other.affine_init, other.member_batches) == ("divide", "shared")  # function preserving; FFCV: shared


def test_independent_batches_need_the_raw_format() -> None:
    with pytest.raises(ConfigError, match=r"model\.member_batches: independent member batches are read with "
                                          r"data\.format=raw only \(got data\.format='ffcv'\)"):
        load_config(None, ["model.member_batches=independent", "data.format=ffcv"], check_data=False)


def test_bad_knob_values_are_named_in_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.member_loss=avg", "reg.normalize=sum", "model.affine_init=scaled",
                           "model.member_batches=per_member", "optim.sigma_lr_scale=0"], check_data=False)
    text = str(err.value)
    for line in ("train.member_loss: must be 'mean' or 'sum' (got 'avg')",
                 "reg.normalize: must be 'none', 'members' or 'mean' (got 'sum')",
                 "model.affine_init: must be 'auto', 'divide' or 'plain' (got 'scaled')",
                 "model.member_batches: must be 'auto', 'shared' or 'independent' (got 'per_member')",
                 "optim.sigma_lr_scale: must be a finite number > 0 or 'num_members' (got 0)"):
        assert line in text, text


@pytest.mark.slow
def test_independent_batches_train_and_resume_bit_identically(tmp_path: Path) -> None:
    """Every knob on, through the trainer (in this process: three interpreter start-ups cost more than the runs)."""
    common = [*TINY_VIT, *SYNTHETIC, "train.batch_size=8", "optim.name=sgd", "optim.lr=0.05", "train.max_steps=4",
              "checkpoint.every_steps=2", "checkpoint.keep_last=2", "model.num_members=2", "tracking.enabled=false",
              "model.member_batches=independent", "train.member_loss=sum", "optim.sigma_lr_scale=num_members",
              "model.affine_init=plain", "reg.normalize=members", "train.log_every_steps=1"]
    assert run(load_config(None, [*common, f"run_dir={tmp_path / 'straight'}"])) == 0
    # The step-2 checkpoint of the straight run, resumed: the same 2 remaining batches and the same final weights.
    ckpt = tmp_path / "straight" / "checkpoints"
    (tmp_path / "again" / "checkpoints").mkdir(parents=True)
    (tmp_path / "again" / "checkpoints" / "step_00000002.pt").write_bytes((ckpt / "step_00000002.pt").read_bytes())
    assert run(load_config(None, [*common, f"run_dir={tmp_path / 'again'}", "checkpoint.resume=auto"])) == 0
    assert losses(tmp_path / "again") == {k: v for k, v in losses(tmp_path / "straight").items() if k > 2}
    groups = final_state(tmp_path / "again", "optimizer")["param_groups"]
    assert len(groups) == 3 and groups[2]["initial_lr"] == pytest.approx(2 * 0.05)  # the σ store at M × lr
    straight, again = final_state(tmp_path / "straight"), final_state(tmp_path / "again")
    for k in straight:
        assert torch.equal(straight[k], again[k]), k
