"""The ensemble methods behind one interface: shapes and layouts, each baseline against its paper (parameter
counts, BatchEnsemble's identity case, Deep Ensemble = independent single runs, FiLM's symmetry breaking), the
GRN conversion summary, and config errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.methods.batch import BatchEnsembleLayer, convert_to_batch_ensemble
from sigmanens_dist.methods.deep import DeepEnsemble
from sigmanens_dist.methods.film import convert_to_film_ensemble
from sigmanens_dist.methods.packed import MIN_CHANNELS_PER_GROUP, convert_to_packed_ensemble
from sigmanens_dist.models import build_model
from sigmanens_dist.trainer import fit
from sigmanens_dist.training.objective import member_loss
from sigmanens_dist.training.optim import param_groups
from tests.helpers import SYNTHETIC, final_state

VIT = ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=16", "model.kwargs.patch_size=4",
       "model.kwargs.depth=2", "model.kwargs.embed_dim=48", "model.kwargs.num_heads=2"]
RESNET = ["model.name=resnet10t"]


def task_loss(model: nn.Module, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The trainer's task loss with the method's own member reduction (``train.member_loss`` unset)."""
    return member_loss(logits, y, 0.0, type(model).loss_reduction)


def tiny_vit(**kw) -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, embed_dim=48, num_heads=2,
                             num_classes=10, **kw)


def _build(method: str, arch: list[str], m: int = 2, *extra: str) -> nn.Module:
    cfg = load_config(None, [f"model.method={method}", f"model.num_members={m}", *arch, *extra])
    torch.manual_seed(0)
    return build_model(cfg, 10, 3)


CASES = [("sigma", VIT), ("single", VIT), ("deep", VIT), ("batch", VIT), ("batch", RESNET), ("packed", RESNET),
         ("film", VIT), ("film", RESNET)]


@pytest.mark.parametrize(("method", "arch"), CASES, ids=[f"{m}-{a[0][11:]}" for m, a in CASES])
def test_every_method_answers_the_protocol(method: str, arch: list[str]) -> None:
    model = _build(method, arch).eval()
    m = model.num_members
    assert m == (1 if method == "single" else 2)
    x, y = torch.randn(3, 3, 16, 16), torch.randint(0, 10, (3,))
    out = model(x)
    assert out.shape == (m, 3, 10)
    # Member-major layout: member k's rows are its own samples. Give member k the batch shifted by k and compare
    # with the shared forward on that batch (eval mode: no batch statistics).
    shifted = [x.roll(k, 0) for k in range(m)]
    mm = model(torch.cat(shifted), member_major=True)
    for k in range(m):
        torch.testing.assert_close(mm[k], model(shifted[k])[k], atol=1e-5, rtol=1e-5)
    if method not in ("single", "sigma"):  # σN-Ens conversion is function preserving: its members start equal
        assert not torch.allclose(out[0], out[1])
    aux = model.aux_loss(load_config(None, ["reg.lambda=0.01"]).reg)
    assert (aux.item() != 0) == (method == "sigma")
    loss = task_loss(model, model.train()(x), y) + aux
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize(("method", "arch"), [c for c in CASES if c[0] != "packed"],
                         ids=[f"{m}-{a[0][11:]}" for m, a in CASES if m != "packed"])
def test_member_is_a_plain_model_reproducing_its_logits(method: str, arch: list[str]) -> None:
    model = _build(method, arch)
    x = torch.randn(4, 3, 16, 16)
    model.train()(x)  # move BN running statistics away from their init
    model.eval()
    k = model.num_members - 1
    plain = model.member(k)
    assert not any(isinstance(mod, BatchEnsembleLayer) for mod in plain.modules())
    assert type(plain).__name__ == type(timm.create_model(arch[0][11:], num_classes=10)).__name__
    torch.testing.assert_close(plain(x), model(x)[k], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("method", "arch"), [c for c in CASES if c[0] in ("deep", "batch")],
                         ids=[f"{m}-{a[0][11:]}" for m, a in CASES if m in ("deep", "batch")])
def test_sub_ensemble_runs_only_its_members(method: str, arch: list[str]) -> None:
    """`sigmanens eval`'s k-member sub-ensembles of the baselines: the selected members' logits, nothing else."""
    model = _build(method, arch)
    x = torch.randn(4, 3, 16, 16)
    model.train()(x)
    model.eval()
    picked = [model.num_members - 1, 0]
    sub = model.select_members(picked)
    assert sub.num_members == 2
    torch.testing.assert_close(sub(x), model(x)[picked], atol=2e-5, rtol=1e-4)


def test_packed_has_no_member_model() -> None:
    with pytest.raises(TypeError, match="no per-member plain model"):
        _build("packed", RESNET).member(0)


def test_loss_reduction_sum_for_deep_mean_for_shared_methods() -> None:
    logits, y = torch.randn(3, 4, 5), torch.randint(0, 5, (4,))
    per_member = torch.stack([nn.functional.cross_entropy(logits[k], y) for k in range(3)])
    deep = DeepEnsemble([nn.Linear(1, 1) for _ in range(3)])
    torch.testing.assert_close(task_loss(deep, logits, y), per_member.sum())
    torch.testing.assert_close(task_loss(_build("sigma", VIT, 3), logits, y), per_member.mean())
    ys = torch.randint(0, 5, (12,))  # member-major labels
    expect = torch.stack([nn.functional.cross_entropy(logits[k], ys[4 * k:4 * k + 4]) for k in range(3)]).sum()
    torch.testing.assert_close(task_loss(deep, logits, ys), expect)
    with pytest.raises(ValueError, match="labels for 5 samples do not fit logits of 3 members"):
        task_loss(deep, logits, torch.zeros(5, dtype=torch.int64))


# -- Deep Ensemble ---------------------------------------------------------------------------------------------------
def test_deep_ensemble_equals_independent_single_runs() -> None:
    """Module + optimiser level, as the trainer does it (sum of member losses, one SGD with momentum and coupled
    weight decay over all parameters, independent batches): member k == a single run seeded k, to 1e-6."""
    cfg = load_config(None, ["model.method=deep", "model.num_members=2", "seed=0", *VIT])
    torch.manual_seed(0)
    deep = build_model(cfg, 10, 3)
    singles = []
    for k in range(2):
        torch.manual_seed(k)
        singles.append(tiny_vit(in_chans=3))

    def sgd(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(param_groups(model, 5e-4), lr=0.1, momentum=0.9)

    opt, opts = sgd(deep), [sgd(s) for s in singles]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs = [torch.randn(8, 3, 16, 16, generator=gen) for _ in range(2)]
        ys = [torch.randint(0, 10, (8,), generator=gen) for _ in range(2)]
        loss = task_loss(deep, deep(torch.cat(xs), member_major=True), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        for s, o, x, y in zip(singles, opts, xs, ys, strict=True):
            o.zero_grad()
            nn.functional.cross_entropy(s(x), y).backward()
            o.step()
    for k in range(2):
        theirs = singles[k].state_dict()
        for name, value in deep.members[k].state_dict().items():
            torch.testing.assert_close(value, theirs[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.allclose(deep.members[0].head.weight, deep.members[1].head.weight)


def test_deep_ensemble_has_m_times_the_parameters() -> None:
    single = sum(p.numel() for p in _build("single", RESNET).parameters())
    assert sum(p.numel() for p in _build("deep", RESNET, 3).parameters()) == 3 * single


# -- BatchEnsemble ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet10t", "vit"])
def test_batch_ensemble_of_one_with_unit_fast_weights_is_its_backbone(name: str) -> None:
    torch.manual_seed(0)
    src = (tiny_vit() if name == "vit" else timm.create_model("resnet10t", num_classes=10)).eval()
    be = convert_to_batch_ensemble(copy.deepcopy(src), 1, init_std=0.0).eval()
    x = torch.randn(5, 3, 16, 16)
    torch.testing.assert_close(be(x)[0], src(x), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(layer.r, torch.ones_like(layer.r)) for _, layer in be.be_layers())


def test_batch_ensemble_parameters_init_and_weight_decay() -> None:
    src = tiny_vit()
    layers = [m for m in src.modules() if type(m) in (nn.Linear, nn.Conv2d)]
    base = sum(p.numel() for p in src.parameters())
    m = 4
    fast = sum(m * (layer.weight.shape[1] * (layer.groups if isinstance(layer, nn.Conv2d) else 1)
                    + layer.weight.shape[0]) for layer in layers)
    biased = sum(layer.bias is not None for layer in layers)
    bias = sum((m - 1) * layer.bias.numel() for layer in layers if layer.bias is not None)
    be = convert_to_batch_ensemble(src, m, init_std=0.5, seed=0)
    assert sum(p.numel() for p in be.parameters()) == base + fast + bias  # W shared, r/s/bias per member
    r = torch.cat([layer.r.flatten() for _, layer in be.be_layers()])
    assert abs(r.mean().item() - 1) < 0.05 and abs(r.std().item() - 0.5) < 0.05 and (r < 0).any()
    no_decay = {id(p) for p in param_groups(be, 1e-4)[1]["params"]}
    names = dict(be.named_parameters())
    assert len(be.no_weight_decay()) == 2 * len(layers) + biased
    assert all(id(names[n]) in no_decay for n in be.no_weight_decay())
    assert id(be.be_layers()[0][1].base.weight) not in no_decay


def test_fast_weight_lr_scale_gives_r_and_s_their_own_undecayed_rate(tmp_path: Path) -> None:
    be = _build("batch", RESNET, 2)
    layers = [layer for _, layer in be.be_layers()]
    groups = param_groups(be, 5e-4, fast_lr=0.05)
    assert len(groups) == 3 and groups[2]["lr"] == 0.05 and groups[2]["weight_decay"] == 0
    assert {id(p) for p in groups[2]["params"]} == {id(p) for layer in layers for p in (layer.r, layer.s)}
    assert sum(len(g["params"]) for g in groups) == len(list(be.parameters()))  # biases keep the shared rate
    assert len(param_groups(be, 5e-4)) == 2  # scale 1 (the default): the groups earlier checkpoints hold
    # through the trainer: the scheduler scales the group from optim.lr × scale
    cfg = load_config(None, [*RESNET, "model.method=batch", "model.num_members=2", "optim.lr=0.1",
                             "optim.fast_weight_lr_scale=0.5", *SYNTHETIC, "train.batch_size=4", "train.max_steps=1",
                             "eval.at_end=false", "tracking.enabled=false", f"run_dir={tmp_path}"])
    assert fit(cfg) == 0
    saved = final_state(tmp_path, "optimizer")["param_groups"]
    assert len(saved) == 3 and saved[2]["initial_lr"] == pytest.approx(0.05) and saved[2]["weight_decay"] == 0
    assert len(saved[2]["params"]) == 2 * len(layers)
    with pytest.raises(ConfigError, match=r"optim.fast_weight_lr_scale.*model.method=batch only"):
        load_config(None, ["optim.fast_weight_lr_scale=0.5"], check_data=False)


# -- Packed-Ensembles ------------------------------------------------------------------------------------------------
def _packed_formula(src: nn.Module, m: int, alpha: float, gamma: int) -> int:
    """Laurent et al. 2023: a conv (C_in, C_out, k, g) packs to α²·C_in·C_out·k²/(M·γ'·g) weights (the network's
    first conv reads the image: C_in·α·C_out·k²; γ' = 1 in the stem and each block's first conv, and lowered while a
    group would get < 64 channels); BN(C) → 2·α·C; the classifier α·F·K + M·K."""
    total, first = 0, True
    for name, mod in src.named_modules():
        if isinstance(mod, nn.Conv2d):
            k2 = mod.kernel_size[0] * mod.kernel_size[1]
            if first:
                total += mod.in_channels * int(alpha * mod.out_channels) * k2
                first = False
                continue
            g = gamma if name.startswith("layer") and not name.endswith(".conv1") else 1
            cin = int(alpha * mod.in_channels)
            while g > 1 and (cin % (g * m) or cin // (g * m) < MIN_CHANNELS_PER_GROUP):
                g -= 1
            total += int(alpha * mod.in_channels) * int(alpha * mod.out_channels) * k2 // (m * g * mod.groups)
        elif isinstance(mod, nn.BatchNorm2d):
            total += 2 * int(alpha * mod.num_features)
        elif isinstance(mod, nn.Linear):
            total += int(alpha * mod.in_features) * mod.out_features + m * mod.out_features
    return total


@pytest.mark.parametrize(("name", "m", "alpha", "gamma"), [("resnet18", 4, 2, 1), ("resnet18", 4, 2, 2),
                                                            ("resnet10t", 2, 3, 1), ("resnet18", 4, 4, 1)])
def test_packed_parameter_count_matches_the_paper(name: str, m: int, alpha: float, gamma: int) -> None:
    src = timm.create_model(name, num_classes=10)
    expect = _packed_formula(src, m, alpha, gamma)
    packed = convert_to_packed_ensemble(copy.deepcopy(src), m, alpha, gamma)
    assert sum(p.numel() for p in packed.parameters()) == expect
    if alpha == m and gamma == 1:  # M members of the original width: exactly a Deep Ensemble's count
        assert expect == m * sum(p.numel() for p in src.parameters())


def test_packed_errors_name_the_problem() -> None:
    with pytest.raises(TypeError, match="timm ResNet family"):
        convert_to_packed_ensemble(tiny_vit(), 2)
    with pytest.raises(ValueError, match="is not an integer"):
        convert_to_packed_ensemble(timm.create_model("resnet10t"), 4, alpha=1.3)
    with pytest.raises(ValueError, match="do not split into"):
        convert_to_packed_ensemble(timm.create_model("resnet10t"), 5, alpha=2)


# -- FiLM ablation ---------------------------------------------------------------------------------------------------
def _disagreement_after_training(init_std: float) -> tuple[float, torch.Tensor]:
    """Members trained a few SGD steps on the same batches of a learnable task (class templates + noise)."""
    torch.manual_seed(0)
    film = convert_to_film_ensemble(tiny_vit(), 3, init_std=init_std, seed=0)
    opt = torch.optim.AdamW(film.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(0)
    templates = torch.randn(10, 3, 16, 16, generator=gen)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=gen)
        return templates[y] + 2 * torch.randn(n, 3, 16, 16, generator=gen), y

    for _ in range(5):
        x, y = batch(32)
        opt.zero_grad()
        task_loss(film, film(x), y).backward()
        gamma_grad = film.sigma.flat.grad[:, :film.sigma.num_gamma].clone()
        opt.step()
    preds = film.eval()(batch(512)[0]).argmax(-1)
    return (preds != preds[0]).any(0).float().mean().item(), gamma_grad


def test_film_members_diverge_only_with_the_symmetry_breaker() -> None:
    disagreement, gamma_grad = _disagreement_after_training(0.1)
    assert disagreement > 0
    assert torch.count_nonzero(gamma_grad) == 0  # no σ gate: γ is unused
    assert _disagreement_after_training(0.0)[0] == 0  # identical members fed the same batches stay identical


def test_film_starts_from_the_source_function_up_to_its_scales() -> None:
    src = tiny_vit().eval()
    film = convert_to_film_ensemble(copy.deepcopy(src), 2, init_std=0.0).eval()
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(film(x)[1], src(x), atol=1e-5, rtol=1e-5)
    assert film.aux_loss(load_config(None, []).reg).item() == 0 and film.extra_metrics() == {}


# -- conversion summary, GRN -----------------------------------------------------------------------------------------
def test_convnextv2_converts_with_grn_left_shared() -> None:
    src = timm.create_model("convnextv2_atto", num_classes=10).eval()
    ens = convert_to_sigma_ensemble(src, 4).eval()
    grn = [n for n, mod in src.named_modules() if type(mod).__name__ == "GlobalResponseNorm"]
    assert grn and ens.summary.shared == grn
    assert len(ens.summary.converted) == len(ens.sigma.slots) > 0
    params = sum(p.numel() for p in ens.parameters())
    assert ens.summary.param_ratio == pytest.approx(params / sum(p.numel() for p in src.parameters()))
    assert "left shared" in str(ens.summary) and "GlobalResponseNorm" in str(ens.summary)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ens(x)[2], src(x), atol=1e-4, rtol=1e-4)  # still function preserving


def test_norms_left_out_by_patterns_are_listed_as_shared() -> None:
    ens = convert_to_sigma_ensemble(tiny_vit(), 2, layers=["blocks.0.*"])
    assert ens.summary.converted == ["blocks.0.norm1", "blocks.0.norm2"]
    assert "norm" in ens.summary.shared and "blocks.1.norm1" in ens.summary.shared


# -- config ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    (["model.method=packed", *VIT], "packed supports the timm ResNet family"),
    (["model.method=batch", "model.packed_alpha=4"], "model.packed_alpha: applies to model.method=packed only"),
    (["model.method=packed", "model.packed_gamma=0"], "model.packed_gamma"),
    (["model.method=packed", "model.packed_alpha=-1"], "model.packed_alpha"),
    (["model.method=batch", "model.fast_weight_init_std=-0.5"], "model.fast_weight_init_std"),
    (["model.method=deep", "model.num_members=0"], "model.num_members"),
    (["model.method=boosting"], "model.method"),
    (["model.member_batches=some"], "model.member_batches"),
])
def test_config_errors_name_key_and_allowed_values(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# -- independent member batches ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def member_data(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The data overrides of 64 training images in ``request.param``'s format: raw generated data, or the first 72
    Fashion-MNIST training images (8 carved for validation) written by ``sigmanens data convert`` as webdataset
    shards (4 of 16 images) or FFCV .beton files."""
    fmt = request.param
    if fmt == "raw":
        return ["data.dataset=synthetic", "data.img_size=8", "data.train_subset=72", "data.val_split=8"]
    pytest.importorskip(fmt)
    from sigmanens_dist.cli import main
    from sigmanens_dist.data import FASHION_MNIST_ROOT

    if not FASHION_MNIST_ROOT.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")
    out = tmp_path_factory.mktemp("members") / fmt
    assert main(["data", "convert", "--dataset", "fashion_mnist", "--format", fmt, "--out", str(out), "--max-count",
                 "16", "--train-subset", "72", "--test-subset", "8", "--val-split", "8", "--num-workers", "1"]) == 0
    return ["data.dataset=fashion_mnist", f"data.format={fmt}", f"data.root={out}", "data.val_split=8"]


# FFCV: about 40 s on 2 cores, most of it compiling the pipelines of the four loaders and writing the .beton files
@pytest.mark.parametrize("member_data", ["raw", "webdataset", pytest.param("ffcv", marks=pytest.mark.slow)],
                         indirect=True)
def test_member_stream_gives_member_k_the_single_run_of_seed_k_and_replays_from_any_batch(
        member_data: list[str]) -> None:
    """Member k's chunk of every member-major batch is the batch a single run with seed + k reads (order and
    augmentation draws), on every format: raw members share one dataset, a converted format gets a loader per
    member; and the stream started at any batch replays the rest of the epoch."""
    from sigmanens_dist.data.loaders import build_data
    from sigmanens_dist.data.member_streams import member_major, member_train_stream
    from sigmanens_dist.distributed.env import DistEnv

    cfg = load_config(None, ["model.method=deep", "model.num_members=2", "seed=3", *member_data,
                             "data.num_workers=0", "train.batch_size=8"])
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    deep = DeepEnsemble([nn.Linear(1, 1) for _ in range(2)])
    assert member_major(cfg, deep)
    data = member_train_stream(cfg, env, build_data(cfg.data, 8, 3, env, cfg.train.randaugment), deep)
    singles = [build_data(cfg.data, 8, 3 + k, env, cfg.train.randaugment).train for k in range(2)]
    batches = list(data.train.iter_epoch(1))
    assert len(batches) == len(data.train) == 8
    for (x, y), *parts in zip(batches, *(s.iter_epoch(1) for s in singles), strict=True):
        assert x.shape[0] == 16
        for k, (xk, yk) in enumerate(parts):
            assert torch.equal(x[8 * k:8 * k + 8], xk) and torch.equal(y[8 * k:8 * k + 8], yk)
    assert not torch.equal(batches[0][1][:8], batches[0][1][8:])  # the members' orders differ
    for start in range(1, len(batches)):
        for (x, y), (x2, y2) in zip(batches[start:], data.train.iter_epoch(1, start), strict=True):
            assert torch.equal(x, x2) and torch.equal(y, y2)
    shared = cfg.model_copy(update={"model": cfg.model.model_copy(update={"member_batches": "shared"})})
    assert not member_major(shared, deep)


def test_member_stream_evens_out_batches_that_lost_skipped_samples() -> None:
    from sigmanens_dist.data.member_streams import MemberStream

    class Stream:
        def __init__(self, sizes: list[int], offset: int) -> None:
            self.sizes, self.offset = sizes, offset

        def __len__(self) -> int:
            return len(self.sizes)

        def iter_epoch(self, epoch: int, start_batch: int = 0):
            for n in self.sizes[start_batch:]:
                yield torch.arange(n).float().view(n, 1) + self.offset, torch.arange(n) + self.offset

    # member 1's first batch lost a sample (data.on_bad_sample=skip); member-major chunks must stay equal
    (x0, y0), (x1, y1) = MemberStream([Stream([4, 4], 0), Stream([3, 4], 100)]).iter_epoch(0)
    assert y0.tolist() == [0, 1, 2, 100, 101, 102] and x0.shape == (6, 1)
    assert y1.tolist() == [0, 1, 2, 3, 100, 101, 102, 103] and x1.shape == (8, 1)


def test_the_method_table_is_the_configs_list_of_methods() -> None:
    # config.py sits below methods/ and names the methods in its model.method Literal; the table must agree.
    from typing import get_args

    from sigmanens_dist.config import ModelConfig
    from sigmanens_dist.experiments.study import method_table
    from sigmanens_dist.methods import METHODS

    assert tuple(METHODS) == get_args(ModelConfig.model_fields["method"].annotation)
    assert all(cls.name == name for name, cls in METHODS.items())
    assert method_table() is METHODS
    assert [n for n, c in METHODS.items() if not c.member_axis] == ["single"]
    assert [n for n, c in METHODS.items() if c.regularized] == ["sigma"]
