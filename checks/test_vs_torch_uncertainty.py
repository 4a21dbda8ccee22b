"""Our BatchEnsemble and Packed-Ensembles against torch-uncertainty 0.13.0: same weights, same input, same outputs.

    bash checks/run.sh      # its own venv (torch-uncertainty imports lightning), then pytest over checks/

Without torch-uncertainty every test here is skipped (``importorskip``); ``checks/run.sh`` fails instead. Outputs
must agree to :data:`TOL` in float32 on CPU; a failure names the max abs difference.

* BatchEnsemble: :class:`~sigmanens_dist.methods.batch.BatchEnsembleLayer` (made by ``convert_to_batch_ensemble``)
  against ``BatchLinear``/``BatchConv2d`` for six shapes, kernels, strides and paddings, M ∈ {1, 2, 4, 8}, on
  member-major input; a whole timm ResNet-18 converted by us against ``batched_resnet(18)``, eval and train mode.
* Packed-Ensembles: a timm ResNet-18 converted by ``convert_to_packed_ensemble`` against ``packed_resnet(18)`` for
  M ∈ {2, 4, 8}, α ∈ {1, 2, 3, 4}, γ ∈ {1, 2}: every convolution layer by layer (plus a stand-alone biased, strided
  one), the classifier, the whole network (tiled and member-major input), and parameter counts.
* Initialisation: mean and std of ``r``, ``s``, biases and weights pooled over 200 freshly built layers of each
  library agree within 5 % of the std; the one deliberate difference (ours starts every member with the source's
  bias, theirs draws them independently) is asserted as such.

The layouts the weight copies rely on, and the deliberate differences, are listed in checks/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import timm
import torch
from torch import nn

from sigmanens_dist.config import ModelConfig
from sigmanens_dist.methods.batch import BatchEnsembleLayer, convert_to_batch_ensemble
from sigmanens_dist.methods.packed import (
    PackedFirstConv,
    PackedLinear,
    _conv_like,
    convert_to_packed_ensemble,
    packed_groups,
)

tu = pytest.importorskip("torch_uncertainty", minversion="0.13.0")
tl = pytest.importorskip("torch_uncertainty.layers")
tu_packed_linear = pytest.importorskip("torch_uncertainty.layers.functional.packed").packed_linear
tu_models = pytest.importorskip("torch_uncertainty.models.classification")

TOL = 1e-5  # max |ours − theirs| allowed on any output (float32)


def nparams(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Same shape, max |ours − theirs| ≤ TOL, and outputs that are not all ~0 (which would compare equal anyway)."""
    assert ours.shape == theirs.shape, f"{what}: output shapes {tuple(ours.shape)} / {tuple(theirs.shape)}"
    diff, scale = float((ours - theirs).abs().max()), float(theirs.abs().max())
    assert diff <= TOL, f"{what}: max abs difference {diff:.2e} > {TOL:g} (max |output| {scale:.2g})"
    assert scale >= 1e-3, f"{what}: degenerate outputs (max |output| {scale:.1e}; max abs difference {diff:.2e})"


def _tu_name(name: str) -> str:
    """A timm ResNet module name → torch-uncertainty's ResNet name (downsample → shortcut, fc → linear)."""
    return "linear" if name == "fc" else name.replace(".downsample.", ".shortcut.")


def _copy_conv(ours: nn.Conv2d, theirs: nn.Conv2d, name: str) -> None:
    """nn.Conv2d → nn.Conv2d, identity channel permutation; raise with the exact layout difference if any."""
    if ours.groups != theirs.groups or ours.weight.shape != theirs.weight.shape:
        raise ValueError(f"{name}: groups ours {ours.groups} / theirs {theirs.groups}, weight "
                         f"{tuple(ours.weight.shape)} / {tuple(theirs.weight.shape)}")
    if (ours.bias is None) != (theirs.bias is None):
        raise ValueError(f"{name}: bias ours {ours.bias is not None}, theirs {theirs.bias is not None}")
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        if ours.bias is not None:
            theirs.bias.copy_(ours.bias)


def _copy_be(ours: BatchEnsembleLayer, theirs: nn.Module) -> None:
    """Our BatchEnsembleLayer's W, r, s, bias into a BatchLinear/BatchConv2d (same (M, C) layouts)."""
    inner = theirs.linear if hasattr(theirs, "linear") else theirs.conv
    if (ours.bias is None) != (theirs.bias is None):
        raise ValueError(f"bias present: ours {ours.bias is not None}, theirs {theirs.bias is not None}")
    with torch.no_grad():
        inner.weight.copy_(ours.base.weight)
        theirs.r_group.copy_(ours.r)
        theirs.s_group.copy_(ours.s)
        if ours.bias is not None:
            theirs.bias.copy_(ours.bias)


# ------------------------------------------------------------------------------------------------------ BatchEnsemble
BE_SHAPES: dict[str, dict[str, Any]] = {
    "linear16-24-bias": {"in": 16, "out": 24, "bias": True},
    "linear7-5-nobias": {"in": 7, "out": 5, "bias": False},
    "conv3-8-k3s1p1-bias": {"in": 3, "out": 8, "k": 3, "stride": 1, "padding": 1, "bias": True},
    "conv8-16-k1s2p0-nobias": {"in": 8, "out": 16, "k": 1, "stride": 2, "padding": 0, "bias": False},
    "conv6-12-k5s2p2-bias": {"in": 6, "out": 12, "k": 5, "stride": 2, "padding": 2, "bias": True},
    "conv4-4-k31s12p10-bias": {"in": 4, "out": 4, "k": (3, 1), "stride": (1, 2), "padding": (1, 0), "bias": True},
}


@pytest.mark.parametrize("m", [1, 2, 4, 8], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", list(BE_SHAPES))
def test_batch_ensemble_layer(shape: str, m: int) -> None:
    """A stand-alone layer converted by us vs BatchLinear/BatchConv2d, on member-major input of 3 rows per member."""
    s = BE_SHAPES[shape]
    torch.manual_seed(1000 * m + list(BE_SHAPES).index(shape))
    if "k" in s:
        base: nn.Module = nn.Conv2d(s["in"], s["out"], s["k"], s["stride"], s["padding"], bias=s["bias"])
        theirs = tl.BatchConv2d.from_conv2d(base, m)
        x = torch.randn(m * 3, s["in"], 9, 10)
    else:
        base = nn.Linear(s["in"], s["out"], bias=s["bias"])
        theirs = tl.BatchLinear.from_linear(base, m)
        x = torch.randn(m * 3, s["in"])
    ours = convert_to_batch_ensemble(nn.Sequential(base), m, seed=m).backbone[0]
    if ours.bias is not None:  # members start with the source's bias: make them differ to test the layout
        with torch.no_grad():
            ours.bias.normal_()
    _copy_be(ours, theirs)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), f"BE {shape} M={m}")
    assert nparams(ours) == nparams(theirs)


@pytest.mark.parametrize("m", [1, 2, 4, 8], ids=lambda m: f"M{m}")
def test_batch_ensemble_resnet18(m: int) -> None:
    """timm ResNet-18 converted by us vs batched_resnet(18): tiled batch, eval and train mode.

    Theirs keeps each shortcut 1×1 conv a plain, shared nn.Conv2d (no r, s): ours' are set to r = s = 1 for the
    outputs, and the parameter counts differ by exactly those r, s (and biases)."""
    torch.manual_seed(m)
    ours = convert_to_batch_ensemble(timm.create_model("resnet18", pretrained=False, num_classes=10), m, seed=m)
    # legacy: theirs repeats the batch in train mode too, as ours does (their default, "paper", only in eval)
    theirs = tu_models.batched_resnet(in_channels=3, num_classes=10, arch=18, num_estimators=m, conv_bias=False,
                                      style="imagenet", repeat_strategy="legacy")
    mapped, plain = 0, 0
    with torch.no_grad():
        for name, mod in ours.backbone.named_modules():
            if isinstance(mod, BatchEnsembleLayer):
                t = theirs.get_submodule(_tu_name(name))
                if type(t) is nn.Conv2d:  # theirs keeps this conv shared, without fast weights
                    mod.r.fill_(1)
                    mod.s.fill_(1)
                    _copy_conv(mod.base, t, name)
                    plain += mod.r.numel() + mod.s.numel() + (0 if mod.bias is None else mod.bias.numel())
                else:
                    _copy_be(mod, t)
                mapped += 1
            elif isinstance(mod, nn.BatchNorm2d):
                theirs.get_submodule(_tu_name(name)).load_state_dict(mod.state_dict())
                mapped += 1
    be_types = (type(theirs.conv1), type(theirs.linear))  # BatchConv2d, BatchLinear
    inner = {id(getattr(t, "conv", None) or t.linear) for t in theirs.modules() if isinstance(t, be_types)}
    expected = sum(isinstance(t, (nn.BatchNorm2d, nn.Conv2d, *be_types)) and id(t) not in inner
                   for t in theirs.modules())
    assert mapped == expected, f"mapped {mapped} of torch-uncertainty's {expected} parametrised modules"
    assert plain == 1344 * m, f"{plain} fast-weight parameters on shortcut convs (ResNet-18: 1,344·M)"
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        for train in (False, True):  # train: BatchNorm on batch statistics
            ours.train(train)
            theirs.train(train)
            assert_close(ours(x), theirs(x).view(m, 3, -1), f"BE ResNet-18 M={m} train={train}")  # theirs: (m b)
    assert nparams(ours) - nparams(theirs) == plain


# --------------------------------------------------------------------------------------------------- Packed-Ensembles
PACKED = [(m, a, g) for m in (2, 4, 8) for a in (1, 2, 3, 4) for g in (1, 2)]


@dataclass
class PackedPair:
    """A ResNet-18 packed by us and torch-uncertainty's packed_resnet(18), every weight copied from ours to theirs."""

    m: int
    alpha: int
    gamma: int
    ours: nn.Module
    theirs: nn.Module
    convs: list[tuple[str, nn.Conv2d, nn.Conv2d]] = field(default_factory=list)  # (our name, ours, theirs)
    linear: tuple[PackedLinear, nn.Module] | None = None


@pytest.fixture(scope="module", params=PACKED, ids=lambda p: "M{}-a{}-g{}".format(*p))
def packed(request: pytest.FixtureRequest) -> PackedPair:
    """Built once per (M, α, γ) for the three tests that read it; raises (test error) if the layouts differ."""
    m, alpha, gamma = request.param
    torch.manual_seed(100 * m + 10 * alpha + gamma)
    ours = convert_to_packed_ensemble(timm.create_model("resnet18", pretrained=False, num_classes=10), m,
                                      float(alpha), gamma)
    theirs = tu_models.packed_resnet(in_channels=3, num_classes=10, arch=18, num_estimators=m, alpha=alpha,
                                     gamma=gamma, conv_bias=False, style="imagenet")
    pair = PackedPair(m, alpha, gamma, ours, theirs)
    net = ours.backbone
    first_inner = {f"{n}.conv" for n, mod in net.named_modules() if isinstance(mod, PackedFirstConv)}
    with torch.no_grad():
        for name, mod in net.named_modules():
            tname = _tu_name(name)
            if isinstance(mod, PackedFirstConv) or (type(mod) is nn.Conv2d and name not in first_inner):
                o = mod.conv if isinstance(mod, PackedFirstConv) else mod
                t = theirs.get_submodule(tname).conv
                _copy_conv(o, t, name)
                pair.convs.append((name, o, t))
            elif isinstance(mod, nn.BatchNorm2d):
                t = theirs.get_submodule(tname)
                if t.num_features != mod.num_features:
                    raise ValueError(f"{name}: BatchNorm2d({mod.num_features}) / ({t.num_features})")
                t.load_state_dict(mod.state_dict())
            elif isinstance(mod, PackedLinear):
                t = theirs.get_submodule(tname)
                w = mod.conv.weight  # (M·K, α·F/M, 1), groups M
                if t.groups != mod.conv.groups or t.weight.numel() != w.numel():
                    raise ValueError(f"{name}: groups ours {mod.conv.groups} / theirs {t.groups}, weight "
                                     f"{tuple(w.shape)} / {tuple(t.weight.shape)}")
                t.weight.copy_(w.view(t.weight.shape))  # theirs (M, K, α·F/M): same order
                t.bias.copy_(mod.conv.bias)
                pair.linear = (mod, t)
    return pair


def test_packed_convs(packed: PackedPair) -> None:
    """Every ResNet-18 convolution layer by layer, plus a stand-alone in-block conv with bias, stride and padding."""
    p, setting = packed, f"M={packed.m} α={packed.alpha} γ={packed.gamma}"
    assert len(p.convs) == 20, f"{len(p.convs)} convolutions mapped (ResNet-18 has 20)"
    with torch.no_grad():
        for name, o, t in p.convs:
            x = torch.randn(2, o.in_channels, 9, 9)
            assert_close(o(x), t(x), f"PE conv {name} {setting}")
        # built as convert_to_packed_ensemble builds it
        base = nn.Conv2d(128, 192, 3, stride=2, padding=1, bias=True)
        in_, out = 128 * p.alpha, 192 * p.alpha
        o = _conv_like(base, in_, out, packed_groups(in_, 1, p.m, p.gamma))
        t = tl.PackedConv2d(128, 192, 3, alpha=p.alpha, num_estimators=p.m, gamma=p.gamma, stride=2, padding=1,
                            bias=True).conv
        _copy_conv(o, t, "stand-alone 128→192 k3 s2 p1 +bias")
        x = torch.randn(2, in_, 9, 9)
        assert_close(o(x), t(x), f"PE stand-alone conv 128→192 k3 s2 p1 +bias {setting}")
    assert sum(nparams(o) for _, o, _ in p.convs) == sum(nparams(t) for _, _, t in p.convs)
    assert nparams(o) == nparams(t)


def test_packed_classifier(packed: PackedPair) -> None:
    """The packed classifier (γ unused by both): logit index i·K + k in both; theirs returns (m b) rows."""
    p, setting = packed, f"M={packed.m} α={packed.alpha} γ={packed.gamma}"
    assert p.linear is not None, "no PackedLinear in our network"
    mod, t = p.linear
    x = torch.randn(3, mod.conv.weight.shape[1] * p.m)
    with torch.no_grad():
        out_t = t(x)  # (M·3, K): rows (m b)
        assert_close(mod(x).view(3, p.m, -1).transpose(0, 1).reshape(out_t.shape), out_t, f"PE classifier {setting}")
        # the layer's default implementation too (packed_resnet builds it with "conv1d")
        assert_close(mod(x), tu_packed_linear(x, t.weight, t.groups, "einsum", t.bias),
                     f"PE classifier, einsum implementation, {setting}")
    assert nparams(mod) == nparams(t)


def test_packed_resnet18(packed: PackedPair) -> None:
    """The whole network, eval and train mode, on a tiled batch and on member-major input (member i reads rows
    [i·b, (i+1)·b), compared with theirs run once per member); and the parameter counts."""
    p, setting, b = packed, f"M={packed.m} α={packed.alpha} γ={packed.gamma}", 2
    x = torch.randn(b, 3, 64, 64)
    xm = torch.randn(p.m * b, 3, 64, 64)
    with torch.no_grad():
        for train in (False, True):  # train: BatchNorm on batch statistics (per member's own rows)
            p.ours.train(train)
            p.theirs.train(train)
            # theirs: the last layer makes (m b) rows
            assert_close(p.ours(x), p.theirs(x).view(p.m, b, -1), f"PE ResNet-18 {setting} train={train}")
            per_member = torch.stack([p.theirs(xm[i * b:(i + 1) * b]).view(p.m, b, -1)[i] for i in range(p.m)])
            assert_close(p.ours(xm, member_major=True), per_member,
                         f"PE ResNet-18 member-major {setting} train={train}")
    assert nparams(p.ours) == nparams(p.theirs)


# ----------------------------------------------------------------------------------------------------- initialisation
INIT_M, INIT_SAMPLES = 4, 200
BE_KINDS = ["linear64-64", "conv16-32-k3"]
INIT_SAME = [f"BE {k}: {q}" for k in BE_KINDS for q in ("r", "s", "bias", "shared W")] + [
    "PE linear256-10 a2 M4: weight", "PE linear256-10 a2 M4: bias", "PE conv64-64-k3 a2 M4: weight"]


@pytest.fixture(scope="module")
def init_draws() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each library's own default initialisation, pooled over INIT_SAMPLES fresh layers: key → (ours, theirs)."""
    std = ModelConfig.model_fields["fast_weight_init_std"].default
    m = INIT_M
    acc: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def add(key: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        pair = acc.setdefault(key, ([], []))
        pair[0].append(ours.detach().flatten())
        pair[1].append(theirs.detach().flatten())

    for i in range(INIT_SAMPLES):
        for kind in BE_KINDS:
            torch.manual_seed(i)
            linear = kind.startswith("linear")
            base: nn.Module = nn.Linear(64, 64) if linear else nn.Conv2d(16, 32, 3)
            ours = convert_to_batch_ensemble(nn.Sequential(base), m, init_std=std, seed=i).backbone[0]
            theirs = tl.BatchLinear(64, 64, m) if linear else tl.BatchConv2d(16, 32, 3, m)
            add(f"BE {kind}: r", ours.r, theirs.r_group)
            add(f"BE {kind}: s", ours.s, theirs.s_group)
            add(f"BE {kind}: bias", ours.bias, theirs.bias)
            add(f"BE {kind}: bias spread", ours.bias.std(0), theirs.bias.std(0))  # std over the M members
            add(f"BE {kind}: shared W", ours.base.weight, (theirs.linear if linear else theirs.conv).weight)
        torch.manual_seed(i)
        ours_l = PackedLinear(2 * 256, 10, m, bias=True)
        theirs_l = tl.PackedLinear(256, 10, alpha=2, num_estimators=m, last=True)
        add("PE linear256-10 a2 M4: weight", ours_l.conv.weight, theirs_l.weight)
        add("PE linear256-10 a2 M4: bias", ours_l.conv.bias, theirs_l.bias)
        ours_c = nn.Conv2d(2 * 64, 2 * 64, 3, groups=m)  # what convert_to_packed_ensemble builds (α=2, M=4)
        theirs_c = tl.PackedConv2d(64, 64, 3, alpha=2, num_estimators=m)
        add("PE conv64-64-k3 a2 M4: weight", ours_c.weight, theirs_c.conv.weight)
    return {key: (torch.cat(o), torch.cat(t)) for key, (o, t) in acc.items()}


@pytest.mark.parametrize("key", INIT_SAME, ids=lambda k: k.replace(": ", "-").replace(" ", "-"))
def test_init_same_distribution(init_draws: dict[str, tuple[torch.Tensor, torch.Tensor]], key: str) -> None:
    """Mean and std agree within 5 % of the std (BE: r, s ~ N(1, 0.5) in both; a fresh layer's W in ours is the
    source's, in theirs its own: the same distribution)."""
    ours, theirs = init_draws[key]
    (mo, so), (mt, st) = (float(ours.mean()), float(ours.std())), (float(theirs.mean()), float(theirs.std()))
    allowed = 0.05 * max(so, st) + 1e-9
    assert abs(mo - mt) <= allowed and abs(so - st) <= allowed, (
        f"{key}: ours mean {mo:.4f} std {so:.4f}, theirs mean {mt:.4f} std {st:.4f} (allowed ±{allowed:.4f})")


@pytest.mark.parametrize("kind", BE_KINDS)
def test_init_member_biases(init_draws: dict[str, tuple[torch.Tensor, torch.Tensor]], kind: str) -> None:
    """The deliberate difference: ours copies the source layer's bias into every member (equal biases at the start);
    torch-uncertainty draws each member's bias independently, U(±1/√fan_in)."""
    ours, theirs = init_draws[f"BE {kind}: bias spread"]
    assert float(ours.abs().max()) == 0, f"our members' biases differ at init (max std over M {ours.max():.2e})"
    assert float(theirs.mean()) > 0.01, f"torch-uncertainty's member biases are equal (mean std {theirs.mean():.2e})"
