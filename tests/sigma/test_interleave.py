"""The ensemble runs its backbone on interleaved rows (row ``b·M + m``), where σBatchNorm / σGroupNorm / σLayerNorm are
one native call; it must equal the member-major reference (every layer called alone) exactly, and its aten op count
must not grow with M."""

from __future__ import annotations

import copy
import functools

import pytest
import timm
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.sigma.layers import SigmaBatchNorm
from tests.sigma_cases import CASES, randomised

B = 3


def _pair(net: nn.Module, m: int):
    """The ensemble (interleaved pass) and a deep copy of it, whose backbone called alone is the reference."""
    ens = convert_to_sigma_ensemble(net, m, seed=3)
    with torch.no_grad():  # members really different, beyond the γ compensation
        ens.sigma.flat.add_(torch.randn(ens.sigma.flat.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    return ens, copy.deepcopy(ens)


def _step(ens, ref, x: torch.Tensor, out_weight: torch.Tensor | None = None):
    """One forward + backward of both on the member-major batch ``x``; the outputs as member-major rows."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = ens.forward_members(xa).flatten(0, 1)
    yb = ref.backbone(xb)
    w = torch.randn(ya.shape, generator=torch.Generator().manual_seed(5)) if out_weight is None else out_weight
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    return ya, yb, xa.grad, xb.grad


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """Largest difference within ``tol`` times the reference's scale (at least 1): gradients of the member affines
    are sums over a member's rows, and the two layouts sum them in different orders, so a large entry may differ by
    a few ulps of itself (float32: ~1e-7 relative)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if not b.numel():
        return
    err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
    assert err <= tol * scale, f"max difference {err:.3g} > {tol:g} × {scale:.3g}"


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_sigma_layer_interleaved_equals_member_major(name: str, mode: str, m: int) -> None:
    """Forward, input gradient, flat-parameter gradient over 3 steps, running stats and num_batches_tracked."""
    make, feat = CASES[name]
    ens, ref = _pair(nn.Sequential(randomised(make)), m)
    ens.train(mode == "train")
    ref.train(mode == "train")
    for step in range(3):
        x = torch.randn(m * B, *feat, generator=torch.Generator().manual_seed(10 + step))
        ya, yb, ga, gb = _step(ens, ref, x)
        _close(ya, yb, 1e-6)
        _close(ga, gb, 1e-6)
    _close(ens.sigma.flat.grad, ref.sigma.flat.grad, 1e-6)
    _close(ens.sigma.running_stats, ref.sigma.running_stats, 1e-6)
    layer, twin = ens.backbone[0], ref.backbone[0]
    if isinstance(layer, SigmaBatchNorm) and layer.track_running_stats:
        assert int(layer.num_batches_tracked) == int(twin.num_batches_tracked) == 3 * (mode == "train")


@pytest.mark.parametrize("name", ["BatchNorm2d", "timm.GroupNormAct", "timm.LayerNorm2d", "timm.RmsNorm2d"])
def test_channels_last_input_is_exact(name: str) -> None:
    """channels_last has no (B, M·C, …) view: the layers copy to NCHW (or stay on the broadcast affine)."""
    make, feat = CASES[name]
    ens, ref = _pair(nn.Sequential(randomised(make)), 4)
    ens.train()
    ref.train()
    x = torch.randn(4 * B, *feat, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)
    ya, yb, ga, gb = _step(ens, ref, x)
    _close(ya, yb, 1e-6)
    _close(ga, gb, 1e-6)
    _close(ens.sigma.flat.grad, ref.sigma.flat.grad, 1e-6)


def _vit() -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5)


NETS = {
    "resnet10t": lambda: timm.create_model("resnet10t", num_classes=5),
    "convnext_atto": lambda: timm.create_model("convnext_atto", num_classes=5),
    "vit": _vit,
}


@pytest.mark.parametrize(("name", "dtype", "batch", "tol"), [
    *((n, torch.float32, 8, 1e-5) for n in NETS),
    # At 2 samples per member the last BatchNorms of resnet10t (1×1 spatial) normalise 2 values: fp32 rounding is
    # amplified to ~1e-3 in the gradients, in either layout; float64 shows the two layouts compute the same thing.
    ("resnet10t", torch.float64, 2, 1e-12),
])
def test_whole_network_interleaved_equals_member_major(name: str, dtype: torch.dtype, batch: int, tol: float) -> None:
    """Logits, input and every parameter gradient, running stats: equal to the member-major reference."""
    torch.manual_seed(0)
    ens, ref = _pair(NETS[name]().train(), 4)
    ens.to(dtype)
    ref.to(dtype)
    x = torch.randn(4 * batch, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)
    ya, yb, ga, gb = _step(ens, ref, x, torch.randn(4 * batch, 5, dtype=dtype))
    _close(ya, yb, tol)
    _close(ga, gb, tol)
    for (n, a), (_, b) in zip(ens.named_parameters(), ref.named_parameters(), strict=True):
        assert a.grad is not None, n
        _close(a.grad, b.grad, tol)
    _close(ens.sigma.running_stats, ref.sigma.running_stats, tol)
    # The shared-batch entry replicates straight into interleaved rows: same member logits.
    ens.eval()
    ref.eval()
    with torch.no_grad():
        shared = x[:2]
        _close(ens(shared), ref.backbone(shared.repeat(4, 1, 1, 1)).view(4, 2, -1), tol)


def test_tokenised_dict_inputs_are_interleaved_too() -> None:
    """Every tensor of a mapping is interleaved (a backbone taking keyword inputs sees consistent rows)."""

    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(6)

        def forward(self, input_ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.norm(input_ids.float() * scale)

    ens, ref = _pair(Keyed(), 4)
    ids = torch.arange(4 * B * 6).view(4 * B, 6) % 7
    scale = torch.rand(4 * B, 1, generator=torch.Generator().manual_seed(0))
    _close(ens.forward_members({"input_ids": ids, "scale": scale}).flatten(0, 1),
           ref.backbone(input_ids=ids, scale=scale), 1e-6)


class _CountOps(TorchDispatchMode):
    """Counts the aten ops that do work. Excluded: ops whose schema returns an alias of an input without writing it
    (views: view, expand, transpose, slice, select, split, unbind, detach, …) and ``aten._unsafe_view`` (a view that
    autograd does not track): they only make tensor metadata, no kernel runs on an accelerator. In-place ops also
    return an alias, but one they write: those are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ret = func._schema.returns
        alias = ret and ret[0].alias_info is not None and not ret[0].alias_info.is_write
        if not alias and func is not torch.ops.aten._unsafe_view.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(model, call, x: torch.Tensor) -> int:
    """Ops of one forward + backward of ``call(model, x)``."""
    with _CountOps() as mode:
        call(model, x).sum().backward()
    return mode.count


OP_MODELS = {  # name: (backbone, the most σN-Ens / plain may cost)
    "resnet18": (lambda: timm.create_model("resnet18", num_classes=10), 1.25),
    "groupnorm-resnet10t": (lambda: timm.create_model(
        "resnet10t", num_classes=10, norm_layer=functools.partial(timm.layers.GroupNorm, num_groups=8)), 1.25),
    "vit-tiny": (lambda: timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                           num_classes=10), 1.4),
}


@pytest.mark.parametrize("name", list(OP_MODELS))
def test_op_count_of_a_train_step_does_not_grow_with_members(name: str) -> None:
    """A CPU stand-in for a launch-bound accelerator: the aten ops of one forward + backward of σN-Ens on M·B rows
    against the plain backbone on as many rows; the same at M=4 and M=16, and within the issue's bound."""
    make, bound = OP_MODELS[name]
    counts = {}
    for m in (4, 16):
        x = torch.randn(m * 2, 3, 32, 32)
        plain = make().train()
        ens = convert_to_sigma_ensemble(make(), m).train()
        counts[m] = (_ops(plain, nn.Module.__call__, x), _ops(ens, type(ens).forward_members, x))
    assert counts[4] == counts[16], counts
    plain_ops, sigma_ops = counts[4]
    assert sigma_ops / plain_ops <= bound, counts


@pytest.mark.parametrize("name", ["resnet18", "vit-tiny"])
def test_the_sigma_pass_compiles_to_one_graph(name: str) -> None:
    """torch.compile traces the whole ensemble pass (interleave, σ layers, de-interleave) as one graph: a break
    would split the step into pieces and put Python between them on an accelerator."""
    ens = convert_to_sigma_ensemble(OP_MODELS[name][0](), 4).train()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(ens)(torch.randn(2, 3, 32, 32))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
