"""Issue 10's recipe knobs: each test fails if its knob stops doing its job (or is ignored by the trainer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
import torch.nn.functional as F

from sigmanens_dist import convert_to_sigma_ensemble, diversity_loss
from sigmanens_dist.config import load_config
from sigmanens_dist.data.member_streams import member_major
from sigmanens_dist.models import build_model
from sigmanens_dist.trainer import fit
from sigmanens_dist.training.objective import loss_reduction, member_loss
from sigmanens_dist.training.optim import build_optimizer, param_groups, sigma_lr
from tests.helpers import SYNTHETIC, TINY_VIT, final_state, losses


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


def test_loss_reduction_and_regulariser_normalisation_reach_the_trainers_loss() -> None:
    cfg = load_config(None, ["model.name=resnet10t", "model.num_members=2", "reg.normalize=members", "reg.lambda=0.1",
                             "reg.tau=0.5"], check_data=False)
    ens = build_model(cfg, 3, 1)
    assert loss_reduction(cfg.train, ens) == "mean"  # unset: the method's own
    assert loss_reduction(load_config(None, ["train.member_loss=sum"], check_data=False).train, ens) == "sum"
    torch.testing.assert_close(ens.aux_loss(cfg.reg), 0.1 * ens.diversity_loss(0.5) / 2)
    assert member_major(cfg, ens)  # σN-Ens members read their own batches by default
    assert not member_major(load_config(None, ["model.member_batches=shared"], check_data=False), ens)


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
    ens = build_model(load_config(None, ["model.name=resnet10t"], check_data=False), 3, 1)  # the default: 2, 0.1
    assert ens.sharing()["all"] == ens.num_members  # every member "on" for every feature, below saturation
    assert torch.sigmoid(ens.gamma()).min() > 0.8 and torch.sigmoid(ens.gamma()).max() < 0.92
    cfg = load_config(None, ["model.name=resnet10t", "model.gamma_init_mean=0", "model.gamma_init_std=1"],
                      check_data=False)
    before = build_model(cfg, 3, 1)
    assert before.sharing()["all"] < before.num_members  # N(0, 1) switches some members off


# -- optim.sigma_lr_scale -----------------------------------------------------------------------------------------
def test_affine_init_auto_is_plain_from_scratch_and_divide_for_pretrained() -> None:
    assert load_config(None, check_data=False).model.affine_init == "plain"
    assert load_config(None, ["model.pretrained=true"], check_data=False).model.affine_init == "divide"


def test_sigma_lr_scale_gives_the_sigma_store_its_own_rate_through_the_schedule() -> None:
    cfg = load_config(None, ["model.name=resnet10t", "optim.lr=0.05", "optim.sigma_lr_scale=4"], check_data=False)
    model = build_model(cfg, 3, 1)
    by_m = load_config(None, ["model.name=resnet10t", "optim.lr=0.05", "optim.sigma_lr_scale=num_members",
                              "model.num_members=4"], check_data=False)
    assert sigma_lr(by_m.optim, model) == pytest.approx(0.2)  # M × lr
    opt = build_optimizer(cfg.optim, param_groups(model, cfg.optim.weight_decay, sigma_lr(cfg.optim, model)))
    store = [g for g in opt.param_groups if any(p is model.sigma.flat for p in g["params"])]
    assert len(store) == 1 and store[0]["lr"] == pytest.approx(0.2) and store[0]["weight_decay"] == 0
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    opt.step()  # no gradients yet: changes nothing, keeps the scheduler's call order
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.025, 0.025, 0.1])
    # scale 1 keeps the original two groups, so checkpoints of earlier runs still resume
    assert sigma_lr(load_config(None, check_data=False).optim, model) == pytest.approx(4 * 0.1)  # default: M × lr
    assert sigma_lr(load_config(None, ["optim.sigma_lr_scale=1"], check_data=False).optim, model) is None
    assert len(param_groups(model, 5e-4)) == 2


# -- model.member_batches -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_independent_batches_train_and_resume_bit_identically(tmp_path: Path) -> None:
    """Every knob on, through the trainer (in this process: three interpreter start-ups cost more than the runs)."""
    common = [*TINY_VIT, *SYNTHETIC, "train.batch_size=8", "optim.name=sgd", "optim.lr=0.05", "train.max_steps=4",
              "checkpoint.every_steps=2", "checkpoint.keep_last=2", "model.num_members=2", "tracking.enabled=false",
              "model.member_batches=independent", "train.member_loss=sum", "optim.sigma_lr_scale=num_members",
              "model.affine_init=plain", "reg.normalize=members", "train.log_every_steps=1"]
    assert fit(load_config(None, [*common, f"run_dir={tmp_path / 'straight'}"])) == 0
    # The step-2 checkpoint of the straight run, resumed: the same 2 remaining batches and the same final weights.
    ckpt = tmp_path / "straight" / "checkpoints"
    (tmp_path / "again" / "checkpoints").mkdir(parents=True)
    (tmp_path / "again" / "checkpoints" / "step_00000002.pt").write_bytes((ckpt / "step_00000002.pt").read_bytes())
    assert fit(load_config(None, [*common, f"run_dir={tmp_path / 'again'}", "checkpoint.resume=auto"])) == 0
    assert losses(tmp_path / "again") == {k: v for k, v in losses(tmp_path / "straight").items() if k > 2}
    groups = final_state(tmp_path / "again", "optimizer")["param_groups"]
    assert len(groups) == 3 and groups[2]["initial_lr"] == pytest.approx(2 * 0.05)  # the σ store at M × lr
    straight, again = final_state(tmp_path / "straight"), final_state(tmp_path / "again")
    for k in straight:
        assert torch.equal(straight[k], again[k]), k
