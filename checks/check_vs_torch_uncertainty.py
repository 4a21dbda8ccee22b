"""Cross-check our BatchEnsemble and Packed-Ensembles layers against torch-uncertainty 0.13.0's reference layers.

    python checks/check_vs_torch_uncertainty.py                 # venv in /tmp/sigmanens-tu-venv (created or reused)
    python checks/check_vs_torch_uncertainty.py --venv DIR --out results/check_vs_torch_uncertainty.md

What it checks (same weights copied into both libraries, same input, outputs equal to 1e-5 in float32):

* BatchEnsemble: :class:`~sigmanens_dist.methods.batch.BatchEnsembleLayer` (made by ``convert_to_batch_ensemble``)
  against ``BatchLinear``/``BatchConv2d`` for several shapes, kernels, strides and paddings, M ∈ {1, 2, 4, 8}, on
  member-major input; and a whole timm ResNet-18 converted by us against torch-uncertainty's ``batched_resnet(18)``.
* Packed-Ensembles: a timm ResNet-18 converted by ``convert_to_packed_ensemble`` against torch-uncertainty's
  ``packed_resnet(18)`` (``PackedConv2d``/``PackedLinear``) for M ∈ {2, 4, 8}, α ∈ {1, 2, 3, 4}, γ ∈ {1, 2}: every
  convolution layer by layer (plus a stand-alone biased, strided one), the classifier, the whole network (tiled and
  member-major input), and parameter counts.
* Initialisation: mean/std of ``r``, ``s``, biases and weights over many freshly built layers of each library
  (informational; differences are flagged, not failed).

It prints a Markdown table (also written to ``--out``) and exits non-zero if any check fails. It is a bench script,
not a CI test: torch-uncertainty's package ``__init__`` imports lightning, so the script installs torch-uncertainty
into a throwaway virtual environment (``--system-site-packages`` plus a ``.pth`` to this interpreter's
site-packages, so torch and timm are reused) and re-runs itself there with ``--inside``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = Path("/tmp/sigmanens-tu-venv")  # `.venv-tu` in the repo is not git-ignored (only `.venv/` is)
DEFAULT_OUT = REPO / "results" / "check_vs_torch_uncertainty.md"
TU_VERSION = "0.13.0"
TOL = 1e-5
MARKER = ".sigmanens-install-path"  # in the venv: which install path produced it
PTH = "_sigmanens_parent_env.pth"

# The torch-uncertainty modules the checks need; in the fallback install their package __init__ files are skipped.
TU_MODULES = ["torch_uncertainty.layers", "torch_uncertainty.models.classification.resnet.batched",
              "torch_uncertainty.models.classification.resnet.packed"]


# --------------------------------------------------------------------------------------------------- outside the venv
def _probe(py: Path, mode: str) -> bool:
    """Whether interpreter ``py`` imports torch, timm and :data:`TU_MODULES` (``mode``: package or bypass)."""
    cmd = [str(py), str(Path(__file__).resolve()), "--probe", mode]
    return subprocess.run(cmd, capture_output=True, env=_env()).returncode == 0


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def ensure_venv(venv: Path) -> str:
    """Create (or reuse) the throwaway venv with torch-uncertainty; return a sentence naming the install path."""
    py, marker = venv / "bin" / "python", venv / MARKER
    if py.exists() and marker.exists():
        path = marker.read_text().strip()
        if _probe(py, "bypass" if path.startswith("fallback") else "package"):
            return f"{path} (venv {venv} reused)"
    if not py.exists():
        # From a venv's python, --system-site-packages exposes the *base* interpreter's site-packages only, so a
        # .pth adds this interpreter's (torch, timm, …): pip sees them as installed and never touches them.
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    parent = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / PTH).write_text("".join(f"{p}\n" for p in parent))
    if subprocess.run([str(py), "-c", "import torch, timm"], env=_env()).returncode:
        raise SystemExit(f"torch/timm not importable from {sys.executable}'s site-packages: run this script with the "
                         "repository's venv python (e.g. .venv/bin/python)")
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    ladder = [
        (f"pip install torch-uncertainty=={TU_VERSION} (pip brought its declared dependencies)",
         [f"torch-uncertainty=={TU_VERSION}"], "package"),
        (f"pip install 'torch-uncertainty[cpu]=={TU_VERSION}' (pip brought lightning[pytorch-extra] & co. for the "
         "package __init__; torch/torchvision/timm reused from the repo venv)",
         [f"torch-uncertainty[cpu]=={TU_VERSION}"], "package"),
        (f"fallback: pip install --no-deps torch-uncertainty=={TU_VERSION} einops, layer modules imported without "
         "the package __init__", ["--no-deps", f"torch-uncertainty=={TU_VERSION}", "einops"], "bypass"),
    ]
    for path, args, probe in ladder:
        print(f"[setup] pip install {' '.join(args)}", flush=True)
        done = subprocess.run([*pip, *args], env=_env())
        if done.returncode == 0 and _probe(py, probe):
            marker.write_text(path + "\n")
            return path
        print(f"[setup] not enough ({'pip failed' if done.returncode else 'import failed'}); next install path",
              flush=True)
    raise SystemExit("could not install torch-uncertainty in any way")


def outside(args: argparse.Namespace) -> int:
    """Set up the venv and re-run this script inside it."""
    start = time.perf_counter()
    path = ensure_venv(args.venv)
    setup_s = time.perf_counter() - start
    print(f"[setup] {path} ({setup_s:.0f} s)", flush=True)
    cmd = [str(args.venv / "bin" / "python"), str(Path(__file__).resolve()), "--inside", "--install-path", path,
           "--out", str(args.out)]
    rc = subprocess.run(cmd, env=_env()).returncode
    print(f"[done] exit {rc}, {time.perf_counter() - start:.0f} s in all (setup {setup_s:.0f} s)", flush=True)
    return rc


# ---------------------------------------------------------------------------------------------------- inside the venv
@dataclass
class Row:
    """One line of the summary table."""

    layer: str
    m: int | str
    alpha: str = "–"
    gamma: str = "–"
    diff: float | None = None  # max |ours − theirs| over every output compared
    scale: float | None = None  # max |output|: what the difference is relative to
    params: tuple[int, int] | None = None  # ours, theirs
    param_delta: int = 0  # expected ours − theirs (an explained, deliberate difference)
    note: str = ""  # shown with PASS
    why: str = ""  # non-empty: the check failed (or was skipped, with skip=True)
    skip: bool = False

    def reasons(self) -> list[str]:
        """Why this row fails (empty: it passes)."""
        out = [self.why] if self.why else []
        if self.diff is None and not self.why:
            out.append("nothing compared")
        if self.diff is not None and not self.diff <= TOL:
            out.append(f"max |Δ| {self.diff:.2e} > {TOL:g}")
        if self.scale is not None and self.scale < 1e-3:
            out.append(f"degenerate outputs (max |y| {self.scale:.1e})")
        if self.params is not None and self.params[0] - self.params[1] != self.param_delta:
            out.append(f"parameter counts differ by {self.params[0] - self.params[1]:,}")
        return out

    @property
    def ok(self) -> bool:
        return self.skip or not self.reasons()

    def cells(self) -> list[str]:
        diff = "–" if self.diff is None else f"{self.diff:.1e}"
        scale = "–" if self.scale is None else f"{self.scale:.2g}"
        params = "–" if self.params is None else f"{self.params[0]:,} / {self.params[1]:,}"
        if self.skip:
            verdict = f"skip: {self.why}"
        elif self.ok:
            verdict = "PASS" + (f" ({self.note})" if self.note else "")
        else:
            verdict = "FAIL: " + "; ".join(self.reasons())
        return [self.layer, str(self.m), self.alpha, self.gamma, diff, scale, params, verdict]

    def compare(self, ours: Any, theirs: Any) -> None:
        """Fold one output pair into ``diff`` and ``scale``."""
        d, y = float((ours - theirs).abs().max()), float(theirs.abs().max())
        if ours.shape != theirs.shape:
            raise ValueError(f"output shapes {tuple(ours.shape)} / {tuple(theirs.shape)}")
        self.diff = d if self.diff is None else max(self.diff, d)
        self.scale = y if self.scale is None else max(self.scale, y)


def _import_skipping_inits(name: str) -> types.ModuleType:
    """Import ``name`` with every parent package of it replaced by an empty stub (its ``__init__`` not run)."""
    import importlib
    import importlib.util

    parts = name.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in sys.modules:
            continue
        if i == 1:
            spec = importlib.util.find_spec(pkg)
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"{pkg} is not installed")
            path = list(spec.submodule_search_locations)
        else:
            path = [str(Path(sys.modules[".".join(parts[:i - 1])].__path__[0]) / parts[i - 1])]
        stub = types.ModuleType(pkg)
        stub.__path__ = path
        sys.modules[pkg] = stub
    return importlib.import_module(name)


def import_tu(mode: str = "auto") -> tuple[types.ModuleType, str]:
    """Import :data:`TU_MODULES`; return torch-uncertainty's ``layers`` module and how it was imported.

    ``mode``: ``package`` (normal imports), ``bypass`` (package ``__init__`` files skipped) or ``auto`` (package,
    else bypass)."""
    import importlib

    import timm  # noqa: F401  (the checks need it)
    import torch  # noqa: F401

    if mode in ("package", "auto"):
        try:
            mods = [importlib.import_module(n) for n in TU_MODULES]
            return mods[0], "the installed package (normal import)"
        except ImportError as err:
            if mode == "package":
                raise
            reason = f"{type(err).__name__}: {err}"
            for name in [n for n in sys.modules if n.startswith("torch_uncertainty")]:
                del sys.modules[name]
    else:
        reason = "asked for with --import-mode bypass"
    mods = [_import_skipping_inits(n) for n in TU_MODULES]
    return mods[0], f"modules only, package __init__ files skipped ({reason})"


def nparams(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- BatchEnsemble
BE_SHAPES: list[tuple[str, dict[str, Any]]] = [
    ("Linear 16→24 +bias", {"in": 16, "out": 24, "bias": True}),
    ("Linear 7→5 no bias", {"in": 7, "out": 5, "bias": False}),
    ("Conv2d 3→8 k3 s1 p1 +bias", {"in": 3, "out": 8, "k": 3, "stride": 1, "padding": 1, "bias": True}),
    ("Conv2d 8→16 k1 s2 p0 no bias", {"in": 8, "out": 16, "k": 1, "stride": 2, "padding": 0, "bias": False}),
    ("Conv2d 6→12 k5 s2 p2 +bias", {"in": 6, "out": 12, "k": 5, "stride": 2, "padding": 2, "bias": True}),
    ("Conv2d 4→4 k(3,1) s(1,2) p(1,0) +bias",
     {"in": 4, "out": 4, "k": (3, 1), "stride": (1, 2), "padding": (1, 0), "bias": True}),
]


def copy_be(ours: Any, theirs: Any) -> None:
    """Our BatchEnsembleLayer's W, r, s, bias into a BatchLinear/BatchConv2d (same (M, C) layouts)."""
    import torch

    inner = theirs.linear if hasattr(theirs, "linear") else theirs.conv
    with torch.no_grad():
        inner.weight.copy_(ours.base.weight)
        theirs.r_group.copy_(ours.r)
        theirs.s_group.copy_(ours.s)
        if (ours.bias is None) != (theirs.bias is None):
            raise ValueError(f"bias present: ours {ours.bias is not None}, theirs {theirs.bias is not None}")
        if ours.bias is not None:
            theirs.bias.copy_(ours.bias)


def check_be_layers(tl: types.ModuleType) -> list[Row]:
    """Stand-alone BatchEnsemble layers: ours (via convert_to_batch_ensemble) vs BatchLinear/BatchConv2d."""
    import torch
    from torch import nn

    from sigmanens_dist.methods.batch import convert_to_batch_ensemble

    rows = []
    for label, s in BE_SHAPES:
        for m in (1, 2, 4, 8):
            torch.manual_seed(1000 * m + len(label))
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
            row = Row(f"BE {label}", m)
            try:
                copy_be(ours, theirs)
                with torch.no_grad():
                    row.compare(ours(x), theirs(x))
            except Exception as err:  # a layout mismatch: report it, keep going
                row.why = f"{type(err).__name__}: {err}"
            row.params = (nparams(ours), nparams(theirs))
            rows.append(row)
    return rows


def _tu_name(name: str) -> str:
    """A timm ResNet module name → torch-uncertainty's ResNet name (downsample → shortcut, fc → linear)."""
    return "linear" if name == "fc" else name.replace(".downsample.", ".shortcut.")


def check_be_resnet(m: int) -> Row:
    """timm ResNet-18 converted by us vs torch-uncertainty's batched_resnet(18): tiled batch, eval and train mode."""
    import timm
    import torch
    from torch import nn

    from sigmanens_dist.methods.batch import BatchEnsembleLayer, convert_to_batch_ensemble

    batched_resnet = sys.modules["torch_uncertainty.models.classification.resnet.batched"].batched_resnet
    torch.manual_seed(m)
    ours = convert_to_batch_ensemble(timm.create_model("resnet18", pretrained=False, num_classes=10), m, seed=m)
    # legacy: theirs repeats the batch in train mode too, as ours does (their default, "paper", only in eval)
    theirs = batched_resnet(in_channels=3, num_classes=10, arch=18, num_estimators=m, conv_bias=False,
                            style="imagenet", repeat_strategy="legacy")
    row = Row("BE ResNet-18 (timm) vs batched_resnet(18)", m)
    try:
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
                        copy_be(mod, t)
                    mapped += 1
                elif isinstance(mod, nn.BatchNorm2d):
                    theirs.get_submodule(_tu_name(name)).load_state_dict(mod.state_dict())
                    mapped += 1
        be_types = (type(theirs.conv1), type(theirs.linear))  # BatchConv2d, BatchLinear
        inner = {id(getattr(t, "conv", None) or t.linear) for t in theirs.modules() if isinstance(t, be_types)}
        expected = sum(isinstance(t, (nn.BatchNorm2d, nn.Conv2d, *be_types)) and id(t) not in inner
                       for t in theirs.modules())
        if mapped != expected:
            raise ValueError(f"mapped {mapped} of torch-uncertainty's {expected} parametrised modules")
        row.param_delta = plain
        if plain:
            row.note = (f"theirs keeps the shortcut 1×1 convs plain and shared (no r, s): ours' set to r = s = 1 "
                        f"for the outputs; params differ by design by {plain:,}")
        x = torch.randn(3, 3, 64, 64)
        with torch.no_grad():
            for train in (False, True):  # train: BatchNorm on batch statistics
                ours.train(train)
                theirs.train(train)
                row.compare(ours(x), theirs(x).view(m, 3, -1))  # theirs repeats the batch as (m b) rows
    except Exception as err:
        row.why = f"{type(err).__name__}: {err}"
    row.params = (nparams(ours), nparams(theirs))
    return row


# ---- Packed-Ensembles
def _copy_conv(ours: Any, theirs: Any, name: str) -> None:
    """nn.Conv2d → nn.Conv2d, identity channel permutation; raise with the exact layout difference if any."""
    import torch

    if ours.groups != theirs.groups or ours.weight.shape != theirs.weight.shape:
        raise ValueError(f"{name}: groups ours {ours.groups} / theirs {theirs.groups}, weight "
                         f"{tuple(ours.weight.shape)} / {tuple(theirs.weight.shape)}")
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        if (ours.bias is None) != (theirs.bias is None):
            raise ValueError(f"{name}: bias ours {ours.bias is not None}, theirs {theirs.bias is not None}")
        if ours.bias is not None:
            theirs.bias.copy_(ours.bias)


def check_packed(tl: types.ModuleType, m: int, alpha: int, gamma: int) -> list[Row]:
    """ResNet-18 packed by us vs torch-uncertainty's packed_resnet(18): convs, classifier, network, params."""
    import timm
    import torch
    from torch import nn

    from sigmanens_dist.methods.packed import (
        PackedFirstConv,
        PackedLinear,
        _conv_like,
        convert_to_packed_ensemble,
        packed_groups,
    )

    packed_resnet = sys.modules["torch_uncertainty.models.classification.resnet.packed"].packed_resnet
    torch.manual_seed(100 * m + 10 * alpha + gamma)
    ours = convert_to_packed_ensemble(timm.create_model("resnet18", pretrained=False, num_classes=10), m,
                                      float(alpha), gamma)
    theirs = packed_resnet(in_channels=3, num_classes=10, arch=18, num_estimators=m, alpha=alpha, gamma=gamma,
                           conv_bias=False, style="imagenet")
    a, g = str(alpha), str(gamma)
    conv_row, lin_row = Row("PE Conv2d", m, a, g), Row("PE Linear (classifier; γ unused by both)", m, a, g)
    net_row = Row("PE ResNet-18 (timm) vs packed_resnet(18)", m, a, g)
    conv_params, errors, with_gamma, nconv = [0, 0], [], 0, 0
    net = ours.backbone
    first_inner = {f"{n}.conv" for n, mod in net.named_modules() if isinstance(mod, PackedFirstConv)}
    with torch.no_grad():
        for name, mod in net.named_modules():
            tname = _tu_name(name)
            try:
                if isinstance(mod, PackedFirstConv) or (type(mod) is nn.Conv2d and name not in first_inner):
                    o = mod.conv if isinstance(mod, PackedFirstConv) else mod
                    t = theirs.get_submodule(tname).conv
                    _copy_conv(o, t, name)
                    x = torch.randn(2, o.in_channels, 9, 9)
                    conv_row.compare(o(x), t(x))
                    conv_params[0] += nparams(o)
                    conv_params[1] += nparams(t)
                    nconv += 1
                    with_gamma += o.groups > m  # resnet18's convs have 1 group: M·γ groups where γ is kept
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
                    x = torch.randn(3, w.shape[1] * m)
                    out_t = t(x)  # (M·3, K): rows (m b)
                    lin_row.compare(mod(x).view(3, m, -1).transpose(0, 1).reshape(out_t.shape), out_t)
                    # the layer's default implementation too (packed_resnet builds it with "conv1d")
                    lin_row.compare(mod(x), tl.functional.packed.packed_linear(x, t.weight, t.groups, "einsum",
                                                                               t.bias))
                    lin_row.params = (nparams(mod), nparams(t))
            except Exception as err:
                errors.append(f"{type(err).__name__}: {err}")
        # A stand-alone in-block conv with bias, stride and padding, built as convert_to_packed_ensemble builds it.
        base = nn.Conv2d(128, 192, 3, stride=2, padding=1, bias=True)
        in_, out = 128 * alpha, 192 * alpha
        o = _conv_like(base, in_, out, packed_groups(in_, 1, m, gamma))
        t = tl.PackedConv2d(128, 192, 3, alpha=alpha, num_estimators=m, gamma=gamma, stride=2, padding=1,
                            bias=True).conv
        try:
            _copy_conv(o, t, "stand-alone 128→192 k3 s2 p1 +bias")
            x = torch.randn(2, in_, 9, 9)
            conv_row.compare(o(x), t(x))
            conv_params[0] += nparams(o)
            conv_params[1] += nparams(t)
        except Exception as err:
            errors.append(f"{type(err).__name__}: {err}")
    conv_row.params = (conv_params[0], conv_params[1])
    conv_row.layer = f"PE Conv2d: {nconv} ResNet-18 convs ({with_gamma} with M·γ groups) + 1 biased"
    if errors:
        conv_row.why = " | ".join(errors)
        net_row.why = "layer mapping failed (see the conv row)"
    else:
        b = 2
        x = torch.randn(b, 3, 64, 64)
        xm = torch.randn(m * b, 3, 64, 64)  # member-major: member i reads rows [i·b, (i+1)·b)
        with torch.no_grad():
            for train in (False, True):  # train: BatchNorm on batch statistics (per member's own rows)
                ours.train(train)
                theirs.train(train)
                net_row.compare(ours(x), theirs(x).view(m, b, -1))  # theirs: the last layer makes (m b) rows
                per_member = torch.stack([theirs(xm[i * b:(i + 1) * b]).view(m, b, -1)[i] for i in range(m)])
                net_row.compare(ours(xm, member_major=True), per_member)
    net_row.params = (nparams(ours), nparams(theirs))
    return [conv_row, lin_row, net_row]


# ---- initialisation
@dataclass
class InitStat:
    """Mean/std of one quantity in each library."""

    name: str
    ours: tuple[float, float]
    theirs: tuple[float, float]
    note: str = ""

    def cells(self) -> list[str]:
        (mo, so), (mt, st) = self.ours, self.theirs
        scale = max(st, so, 1e-12)
        same = abs(mo - mt) <= 0.05 * scale + 1e-9 and abs(so - st) <= 0.05 * scale + 1e-9
        flag = "same" if same else "**DIFFERENT**"
        return [self.name, f"{mo:.4f} / {so:.4f}", f"{mt:.4f} / {st:.4f}",
                flag + (f": {self.note}" if self.note else "")]


def _stats(t: Any) -> tuple[float, float]:
    return float(t.mean()), float(t.std())


def compare_init(tl: types.ModuleType, samples: int = 200) -> list[InitStat]:
    """Each library's own default initialisation, pooled over ``samples`` fresh layers."""
    import torch
    from torch import nn

    from sigmanens_dist.config import ModelConfig
    from sigmanens_dist.methods.batch import convert_to_batch_ensemble
    from sigmanens_dist.methods.packed import PackedLinear

    std = ModelConfig.model_fields["fast_weight_init_std"].default
    m = 4
    acc: dict[str, list[list[Any]]] = {}

    def add(key: str, ours: Any, theirs: Any) -> None:
        pair = acc.setdefault(key, [[], []])
        pair[0].append(ours.detach().flatten())
        pair[1].append(theirs.detach().flatten())

    for i in range(samples):
        for kind in ("Linear 64→64", "Conv2d 16→32 k3"):
            torch.manual_seed(i)
            base: nn.Module = nn.Linear(64, 64) if kind.startswith("Linear") else nn.Conv2d(16, 32, 3)
            ours = convert_to_batch_ensemble(nn.Sequential(base), m, init_std=std, seed=i).backbone[0]
            theirs = tl.BatchLinear(64, 64, m) if kind.startswith("Linear") else tl.BatchConv2d(16, 32, 3, m)
            inner = theirs.linear if kind.startswith("Linear") else theirs.conv
            add(f"BE {kind}: r", ours.r, theirs.r_group)
            add(f"BE {kind}: s", ours.s, theirs.s_group)
            add(f"BE {kind}: bias", ours.bias, theirs.bias)
            add(f"BE {kind}: bias spread across members (std over M)", ours.bias.std(0), theirs.bias.std(0))
            add(f"BE {kind}: shared W", ours.base.weight, inner.weight)
        torch.manual_seed(i)
        ours_l = PackedLinear(2 * 256, 10, m, bias=True)
        theirs_l = tl.PackedLinear(256, 10, alpha=2, num_estimators=m, last=True)
        add("PE Linear 256→10 (α=2, M=4): weight", ours_l.conv.weight, theirs_l.weight)
        add("PE Linear 256→10 (α=2, M=4): bias", ours_l.conv.bias, theirs_l.bias)
        ours_c = nn.Conv2d(2 * 64, 2 * 64, 3, groups=m)  # what convert_to_packed_ensemble builds (α=2, M=4)
        theirs_c = tl.PackedConv2d(64, 64, 3, alpha=2, num_estimators=m)
        add("PE Conv2d 64→64 k3 (α=2, M=4): weight", ours_c.weight, theirs_c.conv.weight)
    notes = {
        "bias spread": "ours copies the source layer's bias into every member (members start with equal biases); "
                       "torch-uncertainty draws each member's bias independently, U(±1/√fan_in)",
        "shared W": "same distribution for a fresh layer; ours keeps the source (e.g. pretrained) W, "
                    "torch-uncertainty's from_linear/from_conv2d discard it",
    }
    out = []
    for key, (o, t) in acc.items():
        note = next((v for k, v in notes.items() if k in key), "")
        out.append(InitStat(key, _stats(torch.cat(o)), _stats(torch.cat(t)), note))
    return out


def markdown(rows: list[Row], inits: list[InitStat], install: str, tu_import: str, seconds: float) -> str:
    """The report: summary table, initialisation table, layout notes."""
    import torch

    def table(header: list[str], lines: list[list[str]]) -> list[str]:
        return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                *("| " + " | ".join(cells) + " |" for cells in lines)]

    failed = [r for r in rows if not r.ok]
    checked = [r for r in rows if not r.skip]
    text = [
        f"# Cross-check against torch-uncertainty {TU_VERSION}",
        "",
        "Generated by `python checks/check_vs_torch_uncertainty.py` (float32, CPU, torch "
        f"{torch.__version__}); tolerance max |Δ| ≤ {TOL:g}.",
        f"Install path: {install}. torch-uncertainty imported as: {tu_import}. Run time inside the venv: "
        f"{seconds:.0f} s.",
        "",
        f"**{len(checked) - len(failed)}/{len(checked)} checks pass**"
        + (f", {len(failed)} FAIL." if failed else "."),
        "",
        *table(["layer", "M", "α", "γ", "max \\|Δ\\|", "max \\|y\\|", "params ours / theirs", "verdict"],
               [r.cells() for r in rows]),
        "",
        "## Initialisation (each library's own default; informational)",
        "",
        "Pooled over 200 fresh layers per row, M = 4; ours: `convert_to_batch_ensemble` with "
        "`model.fast_weight_init_std` (0.5) and the packed layers `convert_to_packed_ensemble` builds.",
        "",
        *table(["quantity", "ours mean / std", "torch-uncertainty mean / std", "flag"], [s.cells() for s in inits]),
        "",
        "## Layouts and deliberate differences",
        "",
        "- BatchEnsemble: same parameters, same layouts — ours `base.weight`, `r` (M, C_in), `s` (M, C_out), "
        "`bias` (M, C_out) ↔ theirs `linear|conv.weight`, `r_group`, `s_group`, `bias`; both take member-major "
        "batches `(m b)` and tile the batch as `repeat(x, 'b ... -> (m b) ...')`.",
        "- BatchEnsemble init: r, s ~ N(1, 0.5) in both (= uncertainty-baselines' `random_sign_init=-0.5`; its "
        "positive values would instead give random ±1 signs, another convention, not used here). Member biases: "
        "ours start equal (the source bias), theirs independent; W: ours keeps the source weights.",
        "- BatchEnsemble behaviour: torch-uncertainty accepts batches that are not a multiple of M (extra rows go to "
        "the first members), ours raises; their `BatchEnsemble` wrapper / `batched_resnet` (default "
        "`repeat_strategy='paper'`) repeat the batch only in eval, ours tiles in train and eval (the ResNet check "
        "uses `repeat_strategy='legacy'`, which tiles in both).",
        "- BatchEnsemble ResNet: torch-uncertainty's `batched_resnet` keeps each shortcut 1×1 conv a plain, shared "
        "`nn.Conv2d` (no r, s); ours converts every Conv2d, shortcuts included (M·(C_in + C_out) more parameters "
        "per shortcut, 1,344·M for ResNet-18). For the output check ours' shortcut r and s are set to 1.",
        "- Packed-Ensembles: the channel permutation between the two libraries is the identity. Member i owns the "
        "contiguous channels [i·αC/M, (i+1)·αC/M) and, with γ, its γ sub-groups are contiguous inside that block; "
        "groups = M·γ·g in both, and both lower γ while a group would hold < 64 input channels (so γ = 2 is in "
        "effect only where α·C_in/(2M) ≥ 64). The stem conv has 1 group and the first conv of each block γ = 1 "
        "in both. Classifier logit index i·K + k in both: theirs (`last=True`) rearranges to (m b) rows inside the "
        "layer, ours returns (B, M·K) and `PackedEnsemble` regroups it to (M, B, K).",
        "- Packed classifier weight: theirs (M, K, α·F/M) (`einsum`/`conv1d` implementations), ours Conv1d "
        "(M·K, α·F/M, 1): a reshape, same init (fan_in α·F/M). Ours has no γ for the classifier (a `PackedLinear` "
        "with γ > 1, i.e. hidden packed linears, is not supported by ours) and no `last`/`first` flags: the "
        "network's first conv is `PackedFirstConv`, which also accepts member-major input (member i's own rows "
        "feed member i's channels); the member-major check compares it with torch-uncertainty run once per member.",
        "- Channel counts: ours rounds α·C and rejects non-integers; torch-uncertainty truncates with `int()`.",
    ]
    return "\n".join(text) + "\n"


def inside(args: argparse.Namespace) -> int:
    """Run every check in this (torch-uncertainty) environment."""
    import torch

    start = time.perf_counter()
    tl, how = import_tu(args.import_mode)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    steps: list[tuple[str, Callable[[], list[Row]]]] = [("BatchEnsemble layers", lambda: check_be_layers(tl))]
    steps += [(f"BatchEnsemble ResNet-18 M={m}", lambda m=m: [check_be_resnet(m)]) for m in (1, 2, 4, 8)]
    steps += [(f"Packed M={m} α={a} γ={g}", lambda m=m, a=a, g=g: check_packed(tl, m, a, g))
              for m in (2, 4, 8) for a in (1, 2, 3, 4) for g in (1, 2)]
    rows: list[Row] = []
    for label, fn in steps:
        t0 = time.perf_counter()
        new = fn()
        rows += new
        bad = [r for r in new if not r.ok]
        print(f"[check] {label}: {'ok' if not bad else 'FAIL'} ({time.perf_counter() - t0:.1f} s)", flush=True)
    rows.append(Row("PE Linear hidden layer with γ>1", "any", "any", "2", why="ours has no γ for linear layers "
                    "(only the ResNet classifier is packed)", skip=True))
    print("[check] initialisation statistics", flush=True)
    inits = compare_init(tl)
    report = markdown(rows, inits, args.install_path, how, time.perf_counter() - start)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"[written] {args.out}")
    return 0 if all(r.ok for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="throwaway venv (created or reused)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the Markdown report goes")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--install-path", default="(run with --inside directly)", help=argparse.SUPPRESS)
    parser.add_argument("--probe", choices=["package", "bypass"], help=argparse.SUPPRESS)
    parser.add_argument("--import-mode", choices=["auto", "package", "bypass"], default="auto",
                        help="with --inside: how to import torch-uncertainty (auto: package, else bypass its __init__)")
    args = parser.parse_args()
    if args.probe:
        import_tu(args.probe)
        return 0
    return inside(args) if args.inside else outside(args)


if __name__ == "__main__":
    sys.exit(main())
