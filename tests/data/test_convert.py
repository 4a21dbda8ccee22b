"""Model conversion: every norm replaced, nothing else changed, function preserved, one flat σ parameter."""

from __future__ import annotations

import pytest
import timm
import torch
import torchvision
from torch import nn

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.sigma.layers import SigmaNorm, looks_like_norm, sigma_class_for


def _hf_bert() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


MODELS = {
    "timm.resnet18": (lambda: timm.create_model("resnet18", num_classes=5), (2, 3, 32, 32)),
    "timm.vit_tiny_patch16_224": (lambda: timm.create_model("vit_tiny_patch16_224", num_classes=5), (2, 3, 224, 224)),
    "timm.vit_tiny_patch4_32": (lambda: timm.create_model("vit_tiny_patch16_224", num_classes=5, img_size=32,
                                                          patch_size=4), (2, 3, 32, 32)),
    "timm.convnext_atto": (lambda: timm.create_model("convnext_atto", num_classes=5), (2, 3, 32, 32)),
    "timm.efficientnet_b0": (lambda: timm.create_model("efficientnet_b0", num_classes=5), (2, 3, 32, 32)),
    "torchvision.resnet18": (lambda: torchvision.models.resnet18(num_classes=5), (2, 3, 32, 32)),
    "hf.bert": (_hf_bert, None),
}


def _inputs(shape: tuple[int, ...] | None) -> torch.Tensor | dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if shape is None:
        return {"input_ids": torch.randint(0, 100, (2, 7), generator=g), "attention_mask": torch.ones(2, 7).long()}
    return torch.randn(*shape, generator=g)


def _source(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    with torch.no_grad():  # non-trivial statistics and affines, so a wrong copy cannot hide behind 0/1 defaults
        for mod in model.modules():
            if sigma_class_for(mod) is not None:
                for p in mod.parameters(recurse=False):
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5)).add_(torch.randn_like(p) * 0.1)
                if getattr(mod, "running_mean", None) is not None:
                    mod.running_mean.uniform_(-0.3, 0.3)
                    mod.running_var.uniform_(0.5, 1.5)
    return model


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _count_norms(model: nn.Module) -> int:
    return sum(sigma_class_for(m) is not None for m in model.modules())


@pytest.mark.parametrize("name", list(MODELS))
def test_conversion_replaces_norms_and_preserves_function(name: str) -> None:
    src = _source(name).eval()
    x = _inputs(MODELS[name][1])
    with torch.no_grad():
        ref = _logits(src(**x) if isinstance(x, dict) else src(x))
    ens = convert_to_sigma_ensemble(src, 4, gamma_init_std=1.0, seed=0).eval()

    # Every norm replaced, none left behind, none unsupported.
    n_norms = _count_norms(src)
    assert n_norms > 0
    assert len(ens.sigma_layers()) == n_norms
    assert _count_norms(ens.backbone) == 0
    assert not any(looks_like_norm(m) and not isinstance(m, SigmaNorm) for m in ens.backbone.modules())

    # Nothing else changed: every non-norm tensor is still there, with the same value.
    norm_prefixes = tuple(n + "." for n, _ in ens.sigma_layers())
    src_sd = {k: v for k, v in src.state_dict().items() if not k.startswith(norm_prefixes)}
    ens_sd = {k[len("backbone."):]: v for k, v in ens.state_dict().items() if k.startswith("backbone.")}
    ens_sd = {k: v for k, v in ens_sd.items() if not k.startswith(norm_prefixes)}
    assert src_sd.keys() == ens_sd.keys()
    for k in src_sd:
        assert torch.equal(src_sd[k], ens_sd[k]), k

    # Function preserving: every member reproduces the source output, although γ is random.
    assert ens.gamma().std() > 0.5
    with torch.no_grad():
        out = ens(x)
    assert out.shape == (4, *ref.shape)
    for m in range(4):
        torch.testing.assert_close(out[m], ref, atol=1e-5, rtol=1e-5)
    # And each member exports to a plain model of the source architecture with the same output.
    member = ens.member(3).eval()
    assert type(member) is type(src)
    assert _count_norms(member) == n_norms
    with torch.no_grad():
        torch.testing.assert_close(_logits(member(**x) if isinstance(x, dict) else member(x)), ref, atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("name", ["timm.resnet18", "timm.convnext_atto", "hf.bert"])
def test_single_member_equals_source_in_train_mode(name: str) -> None:
    src = _source(name)
    ens = convert_to_sigma_ensemble(src, 1, seed=0)
    x = _inputs(MODELS[name][1])
    torch.manual_seed(1)  # dropout draws the same masks in both passes
    ref = _logits(src.train()(**x) if isinstance(x, dict) else src.train()(x))
    torch.manual_seed(1)
    out = ens.train()(x)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_exactly_one_sigma_parameter_and_parameter_counts() -> None:
    rows = []
    for name in ["resnet18", "vit_tiny_patch16_224"]:
        src = timm.create_model(name, num_classes=10)
        n_src = sum(p.numel() for p in src.parameters())
        norm_params = sum(p.numel() for m in src.modules() if sigma_class_for(m) is not None for p in m.parameters())
        for m in (1, 2, 4, 8, 16):
            ens = convert_to_sigma_ensemble(src, m)
            sigma_params = [n for n, _ in ens.named_parameters() if n.startswith("sigma.")]
            assert sigma_params == ["sigma.flat"]
            assert all(not list(layer.parameters(recurse=False)) for _, layer in ens.sigma_layers())
            n_ens = sum(p.numel() for p in ens.parameters())
            # Every norm feature gets γ, weight and bias per member (RMS norms have no bias; none here).
            n_features = sum(layer.num_features for _, layer in ens.sigma_layers())
            assert n_ens == n_src - norm_params + m * 3 * n_features
            rows.append(f"{name:22s} M={m:2d}  params {n_ens:>11,d}  ratio {n_ens / n_src:.4f}  "
                        f"(deep ensemble {m}x)")
    print("\n" + "\n".join(rows))


def test_state_dict_round_trip() -> None:
    src = _source("timm.resnet18")
    a = convert_to_sigma_ensemble(src, 4, seed=0)
    a.train()(torch.randn(4, 3, 32, 32))  # move running stats away from the source's
    with torch.no_grad():
        a.sigma.flat.add_(0.1)
    b = convert_to_sigma_ensemble(src, 4, seed=123)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(a.eval()(x), b.eval()(x), atol=0, rtol=0)


def test_mismatched_members_or_architecture_is_refused() -> None:
    src = _source("timm.resnet18")
    sd4 = convert_to_sigma_ensemble(src, 4).state_dict()
    with pytest.raises(RuntimeError, match=r"checkpoint has num_members=4, this ensemble has num_members=8"):
        convert_to_sigma_ensemble(src, 8).load_state_dict(sd4)
    regularised_elsewhere = convert_to_sigma_ensemble(src, 4, regularize=["layer1.*"])
    with pytest.raises(RuntimeError, match=r"differ in name, kind or order|num_regularized"):
        regularised_elsewhere.load_state_dict(sd4)
    other = convert_to_sigma_ensemble(timm.create_model("resnet34", num_classes=5), 4)
    with pytest.raises(RuntimeError, match=r"different architecture.*num_layers: checkpoint 20 vs model 36"):
        other.load_state_dict(sd4)


def test_bad_inputs_are_clear_errors() -> None:
    src = _source("timm.resnet18")
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"num_members must be an int ≥ 1"):
            convert_to_sigma_ensemble(src, bad)
    ens = convert_to_sigma_ensemble(src, 4)
    with pytest.raises(ValueError, match=r"batch size 6 is not a multiple of num_members=4"):
        ens.forward_members(torch.randn(6, 3, 32, 32))
    with pytest.raises(ValueError, match=r"tau must be a finite number > 0"):
        ens.diversity_loss(0.0)
    with pytest.raises(ValueError, match=r"already contains σ layers"):
        convert_to_sigma_ensemble(ens, 2)
    with pytest.raises(ValueError, match=r"pattern 'head\*' matches no normalization layer"):
        convert_to_sigma_ensemble(src, 2, layers=["head*"])
    with pytest.raises(IndexError, match=r"member index 4 out of range"):
        ens.member(4)


@pytest.mark.parametrize("bad", [nn.InstanceNorm2d(4, affine=True), torchvision.ops.FrozenBatchNorm2d(4),
                                 timm.layers.FrozenBatchNormAct2d(4)])
def test_unsupported_norm_is_an_error_listing_supported_types(bad: nn.Module) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), bad)
    with pytest.raises(TypeError, match=rf"unsupported normalization layer\(s\): '2' \({type(bad).__name__}\).*"
                                        r"Supported types: .*torch.nn.BatchNorm2d"):
        convert_to_sigma_ensemble(model, 2)
    # Converting only the supported ones is allowed, and says which stay shared.
    ens = convert_to_sigma_ensemble(model, 2, layers=["1"])
    assert [n for n, _ in ens.sigma_layers()] == ["1"]


def test_partial_conversion_and_regularised_subset() -> None:
    src = _source("timm.resnet18")
    ens = convert_to_sigma_ensemble(src, 4, layers=["layer*"], regularize=["layer4.*"])
    names = [n for n, _ in ens.sigma_layers()]
    assert "bn1" not in names and all(n.startswith("layer") for n in names)
    reg_feats = sum(layer.num_features for n, layer in ens.sigma_layers() if n.startswith("layer4."))
    assert ens.gamma().shape == (4, reg_feats)
    assert ens.gamma(regularized_only=False).shape[1] == sum(layer.num_features for _, layer in ens.sigma_layers())
    assert set(ens.sharing()) == {n for n in names if n.startswith("layer4.")} | {"all"}


def test_same_sizes_other_regularised_layers_is_refused() -> None:
    # Every ViT LayerNorm has the same width: only the regularised flag tells the layouts apart.
    vit = timm.create_model("vit_tiny_patch16_224", num_classes=5, depth=2)
    sd = convert_to_sigma_ensemble(vit, 2, regularize=["blocks.0.*"]).state_dict()
    with pytest.raises(RuntimeError, match=r"differ in name, kind or order"):
        convert_to_sigma_ensemble(vit, 2, regularize=["blocks.1.*"]).load_state_dict(sd)


def test_sync_batchnorm_conversion_says_statistics_stay_per_rank() -> None:
    with pytest.warns(UserWarning, match="per-rank statistics"):
        convert_to_sigma_ensemble(nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4)), 2)
