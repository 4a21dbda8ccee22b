"""``sigmanens export RUN --program OUT``: the program (torch.export .pt2 or ONNX) predicts what the eager ensemble
predicts, at any batch size and for every method, in a process where sigmanens_dist and timm (for ONNX: torch too)
cannot be imported; a sub-ensemble program is the eager sub-ensemble; the conformal set is eval's, at eval's q̂;
the metadata says what the program is; bad flags are one line and exit 2 before anything is computed; the two
formats give the same conformal sets at a q̂ one float step from 1; torch's benign save warning is not shown."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from sigmanens_dist.catalog.datasets import DATASETS
from sigmanens_dist.cli import main
from sigmanens_dist.cli.options import program_format
from sigmanens_dist.config import EvalConfig, load_config
from sigmanens_dist.data.loaders import CLASSES_FILE, build_data
from sigmanens_dist.data.raw import build_datasets
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.posthoc import fit_posthoc_on
from sigmanens_dist.export.fit import SATURATION_BAND, program_threshold
from sigmanens_dist.export.program import ProgramHead, class_names, export_program
from sigmanens_dist.export.program_file import QUIET_EXPORT_WARNINGS, TRANSLATIONS, write_program
from sigmanens_dist.inference.collect import collect_logits
from sigmanens_dist.inference.conformal import class_scores
from sigmanens_dist.inference.temperature import fit_temperature
from sigmanens_dist.models import build_model, load_trained
from sigmanens_dist.program_meta import METADATA_FILE, OUTPUTS
from tests.helpers import FIXTURE, import_blocking, untrained_run

METHODS = ("sigma", "single", "deep", "batch", "packed", "film")
# A tiny ResNet on generated 16x16 images: what the per-method programs are made of (a random one: the program does
# not depend on what training did to the weights).
TINY = ["model.name=test_resnet", "model.num_members=2", "data.dataset=synthetic", "data.img_size=16",
        "data.val_split=16", "data.val_subset=16", "train.batch_size=16"]


# Imports of sigmanens_dist and timm fail before the program is loaded.
LOAD_WITHOUT_PACKAGE = import_blocking("sigmanens_dist", "timm") + """
import torch
extra = {"sigmanens.json": ""}
program = torch.export.load(sys.argv[1], extra_files=extra).module()
x = torch.load(sys.argv[2])
torch.save({k: v for k, v in program(x).items()}, sys.argv[3])
print(extra["sigmanens.json"])
"""

# The same for ONNX with onnxruntime and numpy alone: torch and the onnx package are blocked too.
RUN_ONNX_ALONE = import_blocking("sigmanens_dist", "timm", "torch", "onnx") + """
import numpy as np
import onnxruntime as ort
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
meta = json.loads(session.get_modelmeta().custom_metadata_map["sigmanens.json"])
out = session.run(meta["outputs"], {meta["input"]["name"]: np.load(sys.argv[2])})
np.savez(sys.argv[3], **dict(zip(meta["outputs"], out)))
print(json.dumps(meta))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shutil.copytree(FIXTURE, tmp_path_factory.mktemp("program") / "run")


def _checkpoint(run: Path) -> Path:
    return next((run / "checkpoints").glob("step_*.pt"))


def _export(run: Path, name: str, *args: str) -> Path:
    out = run.parent / f"{run.name}_{name}"
    assert main(["export", str(run), "--program", str(out), *args]) == 0
    return out


def _random_run(run: Path, *overrides: str) -> Path:
    """A run directory holding one checkpoint of a freshly built TINY model."""
    return untrained_run(run, [*TINY, *overrides])


def test_ema_weights_export_as_eval_scores_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--weights ema``: the program of the run's EMA weights equals the eager EMA ensemble, not the raw one; a
    run without an EMA is refused in one line before anything is written."""
    run = _random_run(tmp_path / "run")
    path = run / "checkpoints" / "step_00000000.pt"
    state = torch.load(path, weights_only=True)
    torch.manual_seed(1)
    state["ema"] = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
                    for k, v in state["model"].items()}
    assert main(["export", str(run), "--program", str(tmp_path / "raw.pt2"), "--weights", "ema"]) == 2
    assert "holds no EMA weights" in capsys.readouterr().err and not (tmp_path / "raw.pt2").exists()
    torch.save(state, path)
    out = _export(run, "ema.pt2", "--weights", "ema")
    assert _metadata(out)["weights"] == "ema"
    loaded = load_trained(path)
    x = torch.rand(7, 3, 16, 16)
    with torch.no_grad():
        want = loaded.ema(x).softmax(-1).mean(0)  # the synthetic recipe: mean 0, std 1
        raw = loaded.model(x).softmax(-1).mean(0)
    got = _run_program(out, x)["probabilities"]
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, raw, atol=1e-3)


def _metadata(path: Path) -> dict:
    if path.suffix == ".onnx":
        return json.loads(ort.InferenceSession(path).get_modelmeta().custom_metadata_map[METADATA_FILE])
    extra = {METADATA_FILE: ""}
    torch.export.load(path, extra_files=extra)
    return json.loads(extra[METADATA_FILE])


def _run_program(path: Path, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The program's outputs on ``x``, whichever format it is."""
    return _loaded(path)(x)


@functools.cache
def _loaded(path: Path) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """The program at ``path`` as a function (loaded once: every program file is written once)."""
    if path.suffix == ".pt2":
        return torch.export.load(path).module()
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    names = [o.name for o in session.get_outputs()]
    return lambda x: {k: torch.from_numpy(v) for k, v in zip(names, session.run(None, {"images": x.numpy()}),
                                                             strict=True)}


def _eager_probs(run: Path, x: torch.Tensor, members: list[int] | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
    model = load_trained(_checkpoint(run)).model
    model = model.select_members(members or list(range(model.num_members)))
    with torch.no_grad():
        return (model(x) / temperature).softmax(-1).mean(0)  # the synthetic recipe: mean 0, std 1


def _images(batch: int) -> torch.Tensor:
    return torch.rand(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))


@pytest.fixture(scope="module")
def calibrated(run: Path) -> Path:
    return _export(run, "calibrated.pt2", "--calibration", "temperature")


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_program_equals_the_eager_ensemble(run: Path, calibrated: Path, batch: int) -> None:
    meta = _metadata(calibrated)
    assert meta["members"] == [0, 1] and meta["method"] == "sigma" and meta["fitted_on"] == "val"
    assert meta["val_nll_after"] <= meta["val_nll_before"]
    assert meta["program_format"] == "torch" and meta["class_names"] is None  # synthetic data: no names to give
    assert meta["input"] | {"shape": None} == {"name": "images", "shape": None, "channels": 3, "size": 16,
                                               "dtype": "float32", "range": [0.0, 1.0],
                                               "crop_ratio": 1.0}  # a raw-format run: the whole shorter side
    x = _images(batch)
    out = _run_program(calibrated, x)
    expected = _eager_probs(run, x, [0, 1], meta["temperature"])
    torch.testing.assert_close(out["probabilities"], expected, rtol=0, atol=1e-5)
    assert torch.equal(out["prediction"], expected.argmax(-1))
    assert {k: v.shape[0] for k, v in out.items()} == dict.fromkeys(meta["outputs"], batch)


def test_program_loads_and_runs_without_sigmanens_and_timm(run: Path, calibrated: Path, tmp_path: Path) -> None:
    x = torch.rand(5, 3, 16, 16)
    torch.save(x, tmp_path / "x.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PACKAGE, str(calibrated), str(tmp_path / "x.pt"),
                           str(tmp_path / "out.pt")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["probabilities"], _eager_probs(run, x, [0, 1], meta["temperature"]),
                               rtol=0, atol=1e-5)


def test_sub_ensemble_program_is_the_eager_sub_ensemble(run: Path) -> None:
    program = _export(run, "one.pt2", "--members", "0")
    assert _metadata(program)["members"] == [0]
    module = torch.export.load(program).module()
    n_ops = sum(1 for node in module.graph.nodes if node.op == "call_function")
    full = torch.export.load(_export(run, "full.pt2")).module()
    assert n_ops < sum(1 for node in full.graph.nodes if node.op == "call_function")  # smaller, not masked
    x = torch.rand(7, 3, 16, 16)
    out = module(x)
    torch.testing.assert_close(out["probabilities"], _eager_probs(run, x, [0]), rtol=0, atol=1e-5)
    assert torch.all(out["disagreement"] == 0) and torch.allclose(out["mutual_information"], torch.zeros(7))


# -- every method, both formats -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``programs(method, name, *flags)``: the program exported from that method's random run (each made once)."""
    root, made = tmp_path_factory.mktemp("methods"), {}

    def program(method: str, name: str, *flags: str) -> Path:
        if (method, name, flags) not in made:
            run = root / method
            if not run.exists():
                _random_run(run, f"model.method={method}")
            made[method, name, flags] = _export(run, name, *flags)
        return made[method, name, flags]

    return program


def _check_method_program(path: Path, method: str, fmt: str) -> None:
    """``path`` says what it is and predicts what the method's eager ensemble predicts at batch 1, 7 and 64."""
    meta = _metadata(path)
    assert (meta["program_format"], meta["method"], meta["outputs"]) == (fmt, method, list(OUTPUTS))
    assert meta["members"] == list(range(1 if method == "single" else 2))
    for batch in (1, 7, 64):
        x = _images(batch)
        expected = _eager_probs(path.parent / method, x)
        out = _run_program(path, x)
        assert list(out) == list(OUTPUTS)  # ONNX: the session's output names, in the metadata's order
        torch.testing.assert_close(out["probabilities"], expected, rtol=0, atol=1e-5, msg=f"{path.name} {batch}")
        assert torch.equal(out["prediction"], expected.argmax(-1))
        assert {k: v.shape[0] for k, v in out.items()} == dict.fromkeys(OUTPUTS, batch)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_exports_a_torch_program(programs: Callable[..., Path], method: str) -> None:
    _check_method_program(programs(method, "full.pt2"), method, "torch")


# ONNX export takes seconds per method (docs/deploy.md): σN-Ens in the quick run, every method in the slow one
@pytest.mark.parametrize("method", [m if m == "sigma" else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_every_method_exports_an_onnx_program(programs: Callable[..., Path], method: str) -> None:
    _check_method_program(programs(method, "full.onnx"), method, "onnx")  # the format from OUT's suffix


def test_onnx_sub_ensemble_is_smaller_and_the_eager_sub_ensemble(programs: Callable[..., Path]) -> None:
    one = programs("sigma", "one.onnx", "--members", "1")
    assert _metadata(one)["members"] == [1]
    full = programs("sigma", "full.onnx")
    assert len(onnx.load(one).graph.node) < len(onnx.load(full).graph.node)  # smaller, not masked
    x = _images(7)
    out = _run_program(one, x)
    torch.testing.assert_close(out["probabilities"], _eager_probs(one.parent / "sigma", x, [1]), rtol=0, atol=1e-5)
    assert np.all(out["disagreement"].numpy() == 0)


# -- conformal sets ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def conformal(run: Path) -> dict[str, Path]:
    flags = ("--calibration", "temperature", "--conformal", "0.2", "--conformal-score", "aps")
    return {fmt: _export(run, f"conformal.{fmt}", *flags) for fmt in ("pt2", "onnx")}


def test_conformal_set_is_evals_at_evals_threshold(run: Path, conformal: dict[str, Path]) -> None:
    loaded = load_trained(_checkpoint(run))
    data = build_data(loaded.cfg.data, 16, loaded.cfg.seed, DistEnv(0, 1, 0, torch.device("cpu")))
    with torch.no_grad():
        fitted = fit_posthoc_on(loaded.model, data.val, EvalConfig(calibration="temperature", conformal=[0.2]),
                                torch.device("cpu"), "test")
    qhat = fitted.fit.thresholds[0]["aps"]
    x = _images(7)
    expected = _eager_probs(run, x, temperature=fitted.fit.temperature)
    for path in conformal.values():
        meta = _metadata(path)
        assert meta["outputs"] == [*OUTPUTS, "conformal_set"]
        assert meta["temperature"] == pytest.approx(fitted.fit.temperature, rel=1e-6)
        sets = meta["conformal"]
        assert (sets["alpha"], sets["score"], sets["num_calibration"], sets["fitted_on"]) == (0.2, "aps", 16, "val")
        assert sets["qhat"] == pytest.approx(qhat, rel=1e-6) and 0 <= sets["val_coverage"] <= 1
        out = _run_program(path, x)
        torch.testing.assert_close(out["probabilities"], expected, rtol=0, atol=1e-5)
        assert out["conformal_set"].dtype == torch.bool
        assert torch.equal(out["conformal_set"], class_scores(expected, "aps") <= qhat), path.name


def test_a_calibration_split_is_what_the_program_is_fitted_on(tmp_path: Path) -> None:
    """A run trained with data.calib_split: the program's T and q̂ are fitted on the calibration split, as eval's
    are, not on the validation split best.pt was chosen on; T is fit_temperature on that split's logits."""
    run = _random_run(tmp_path / "run", "data.train_subset=96", "data.calib_split=24")
    meta = _metadata(_export(run, "calib.pt2", "--calibration", "temperature", "--conformal", "0.2"))
    loaded = load_trained(_checkpoint(run))
    calib = build_datasets(loaded.cfg.data, loaded.cfg.data_root()).calib
    logits, target = collect_logits(loaded.model, DataLoader(calib, batch_size=16), torch.device("cpu"), "by hand")
    assert meta["fitted_on"] == "calib" == meta["conformal"]["fitted_on"]
    assert meta["num_fit"] == 24 == meta["conformal"]["num_calibration"]
    assert meta["temperature"] == pytest.approx(fit_temperature(logits, target), rel=1e-6)


def test_onnx_program_runs_with_onnxruntime_alone(run: Path, conformal: dict[str, Path], tmp_path: Path) -> None:
    x = _images(5)
    np.save(tmp_path / "x.npy", x.numpy())
    proc = subprocess.run([sys.executable, "-c", RUN_ONNX_ALONE, str(conformal["onnx"]), str(tmp_path / "x.npy"),
                           str(tmp_path / "out.npz")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    assert meta == _metadata(conformal["pt2"]) | {"program_format": "onnx"}
    out = np.load(tmp_path / "out.npz")
    expected = _eager_probs(run, x, temperature=meta["temperature"])
    torch.testing.assert_close(torch.from_numpy(out["probabilities"]), expected, rtol=0, atol=1e-5)
    assert np.array_equal(out["conformal_set"], (class_scores(expected, "aps") <= meta["conformal"]["qhat"]).numpy())


def test_infinite_threshold_puts_every_class_in_the_set(run: Path) -> None:
    program = _export(run, "all.onnx", "--conformal", "0.01", "--conformal-score", "raps")  # 16 samples: α < 1/17
    meta = _metadata(program)
    assert meta["conformal"]["qhat"] is None and meta["conformal"]["val_coverage"] == 1.0
    assert meta["calibration"] == "none" and meta["temperature"] == 1.0
    assert bool(_run_program(program, _images(7))["conformal_set"].all())


def test_onnx_aps_sort_breaks_ties_like_torch(tmp_path: Path) -> None:
    class Scores(nn.Module):
        def forward(self, probs: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"aps": class_scores(probs, "aps"), "raps": class_scores(probs, "raps")}

    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.1, 0.4], [0.7, 0.1, 0.1, 0.1]] * 3)
    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(Scores().eval(), (probs,), dynamo=True, input_names=["probs"],
                                output_names=["aps", "raps"], dynamic_shapes={"probs": {0: batch}},
                                custom_translation_table=TRANSLATIONS, verbose=False)
    program.save(tmp_path / "scores.onnx")
    aps, raps = ort.InferenceSession(tmp_path / "scores.onnx").run(None, {"probs": probs.numpy()})
    np.testing.assert_allclose(aps, class_scores(probs, "aps").numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(raps, class_scores(probs, "raps").numpy(), rtol=0, atol=1e-6)


def test_both_formats_give_the_same_sets_at_a_qhat_one_ulp_below_1(run: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44, finding 10: at q̂ = 0.99999994 (one float32 step below 1) the .pt2 and the .onnx program gave
    different aps sets on 79 of 256 inputs: the tail classes' scores pile up at 1 ± float32 summation error, which
    the two runtimes round differently. The program compares with q̂ moved above the pile: the same sets."""
    from sigmanens_dist.export import fit as program_fit
    from sigmanens_dist.inference.posthoc import PostHocFit

    below_one = float(np.nextafter(np.float32(1), np.float32(0)))
    fit = program_fit.fit_posthoc

    def fit_at_the_edge(*args: object, **kwargs: object) -> PostHocFit:
        fitted = fit(*args, **kwargs)
        return dataclasses.replace(fitted, thresholds=tuple(dict.fromkeys(q, below_one) for q in fitted.thresholds))

    monkeypatch.setattr(program_fit, "fit_posthoc", fit_at_the_edge)
    paths = {fmt: tmp_path / f"edge.{fmt}" for fmt in ("pt2", "onnx")}
    for path in paths.values():
        export_program(load_trained(_checkpoint(run)), path, calibration="temperature",
                       fmt=program_format(None, path), conformal=0.1, score="aps")
    sets = _metadata(paths["onnx"])["conformal"]
    assert sets["qhat_fitted"] == below_one and sets["qhat"] == 1 + SATURATION_BAND
    x = torch.rand(256, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    pt2, onnx_out = _run_program(paths["pt2"], x), _run_program(paths["onnx"], x)
    scores = class_scores(pt2["probabilities"], "aps")
    assert int(((scores - 1).abs() < 1e-6).any(-1).sum()) > 64  # the pile the raw q̂ would have split
    assert torch.equal(pt2["conformal_set"], onnx_out["conformal_set"])


@pytest.mark.parametrize(("score", "fitted", "stored"), [
    ("aps", 0.9061958, 0.9061958),
    ("aps", 1 - 2**-24, 1 + SATURATION_BAND),
    ("aps", 1 + 2**-23, 1 + SATURATION_BAND),
    ("raps", 1.03 - 2**-23, 1.03 + SATURATION_BAND),
    ("raps", 1.025, 1.025),
    ("thr", 1 - 2**-24, 1 - 2**-24),  # 1 − p: no summation, no pile
    ("aps", math.inf, math.inf),
])
def test_program_threshold_moves_only_a_qhat_at_a_pile(score: str, fitted: float, stored: float) -> None:
    assert program_threshold(score, fitted) == pytest.approx(stored, rel=0, abs=1e-12)


def test_torchs_save_warning_is_silenced_and_only_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44, finding 12: torch.export.save warns "No complete tensor found in the group!" on the σN-Ens members'
    shared weights (shown first); saving a program silences that text, and any other warning still shows."""
    model = build_model(load_config(None, TINY), 10, 3).eval()
    head = ProgramHead(model, [0.0] * 3, [1.0] * 3, 1.0).eval()
    with torch.no_grad():
        program = torch.export.export(head, (torch.rand(2, 3, 16, 16),),
                                      dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1)}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.export.save(program, tmp_path / "plain.pt2")
    (message, category), = QUIET_EXPORT_WARNINGS
    assert [w for w in caught if issubclass(w.category, category) and re.match(message, str(w.message))]
    save = torch.export.save

    def save_and_warn(*args: object, **kwargs: object) -> None:
        warnings.warn("something else", UserWarning, stacklevel=1)
        save(*args, **kwargs)

    monkeypatch.setattr(torch.export, "save", save_and_warn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_program(head, torch.rand(2, 3, 16, 16), (METADATA_FILE, "{}"), 1, "torch", tmp_path / "quiet.pt2")
    assert [str(w.message) for w in caught] == ["something else"]
    assert (tmp_path / "quiet.pt2").is_file()


# -- class names ------------------------------------------------------------------------------------------------------
def test_class_names_are_the_datasets_own_or_none(tmp_path: Path) -> None:
    assert DATASETS["fashion_mnist"].classes[0] == "T-shirt/top" and len(DATASETS["fashion_mnist"].classes) == 10
    assert len(DATASETS["cifar10"].classes) == 10 and DATASETS["cifar10"].classes[0] == "airplane"
    cifar100 = DATASETS["cifar100"].classes
    assert len(set(cifar100)) == 100 and list(cifar100) == sorted(cifar100)  # the meta file's order: alphabetical
    for name in ("b_cat", "a_dog", "c_fox"):
        (tmp_path / "raw" / "train" / name).mkdir(parents=True)
    (tmp_path / "conv").mkdir()
    (tmp_path / "conv" / CLASSES_FILE).write_text(json.dumps({"classes": ["x", "y"]}))

    def names(num_classes: int, *overrides: str) -> list[str] | None:
        return class_names(load_config(None, list(overrides), check_data=False), num_classes)

    assert names(3, "data.dataset=imagefolder", f"data.root={tmp_path / 'raw'}") == ["a_dog", "b_cat", "c_fox"]
    assert names(4, "data.dataset=imagefolder", f"data.root={tmp_path / 'raw'}") is None  # not what it trained on
    assert names(2, "data.dataset=imagenet", "data.format=webdataset", f"data.root={tmp_path / 'conv'}") == ["x", "y"]
    assert names(3, "data.dataset=imagefolder", f"data.root={tmp_path / 'missing'}") is None
    assert names(10, "data.dataset=cifar10") == list(DATASETS["cifar10"].classes)
    assert names(10, "data.dataset=synthetic") is None


# -- usage errors -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("members", "message"), [
    ("2", "--members '2': give distinct member indices in 0..1"),
    ("", "--members '': give distinct member indices in 0..1"),
    ("0,x", "--members '0,x': give member indices separated by commas, e.g. 0,1"),
])
def test_bad_members_is_one_line_and_exit_2(run: Path, members: str, message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = run.parent / "bad.pt2"
    assert main(["export", str(run), "--program", str(out), "--members", members]) == 2
    err = capsys.readouterr().err
    assert err == f"sigmanens export: error: {message}\n"
    assert not out.exists()


@pytest.mark.parametrize(("out", "flags", "message"), [
    ("x.pt2", ["--format", "tflite"], "--format 'tflite': choose torch or onnx"),
    ("x.pt2", ["--format", "onnx"], "--format onnx with OUT {out}: the suffix .pt2 means --format torch; give "
                                    "--format torch or an OUT ending in .onnx"),
    ("x.onnx", ["--format", "torch"], "--format torch with OUT {out}: the suffix .onnx means --format onnx; give "
                                      "--format onnx or an OUT ending in .pt2"),
    ("x.pt2", ["--conformal", "1.5"], "--conformal '1.5': give one miscoverage α in (0, 1), e.g. 0.1"),
    ("x.pt2", ["--conformal", "0"], "--conformal '0': give one miscoverage α in (0, 1), e.g. 0.1"),
    ("x.pt2", ["--conformal", "nan"], "--conformal 'nan': give one miscoverage α in (0, 1), e.g. 0.1"),
    ("x.pt2", ["--conformal", "0.1,0.2"], "--conformal '0.1,0.2': give one miscoverage α in (0, 1), e.g. 0.1"),
    ("x.pt2", ["--conformal-score", "aps"], "--conformal-score aps goes with --conformal ALPHA"),
    ("x.pt2", ["--conformal", "0.1", "--conformal-score", "lac"], "--conformal-score 'lac': choose thr, aps, raps"),
])
def test_bad_program_flags_are_refused_before_the_checkpoint_is_read(
        tmp_path: Path, out: str, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / out
    assert main(["export", str(tmp_path / "no-such-run"), "--program", str(target), *flags]) == 2  # flags first
    assert capsys.readouterr().err == f"sigmanens export: error: {message.format(out=target)}\n"
    assert not target.exists()


def test_program_under_a_file_says_the_file(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44, finding 12: `export --program afile/p.pt2` said the folder "does not exist"."""
    afile = tmp_path / "afile"
    afile.write_text("a file")
    for out in (afile / "p.pt2", afile / "sub" / "p.pt2"):
        assert main(["export", str(run), "--program", str(out)]) == 2
        where = f"{afile} is a file" if out.parent == afile else f"{out.parent}: a part of this path is a file"
        assert capsys.readouterr().err == (f"sigmanens export: error: OUT {out}: its folder {where}, not a folder"
                                           f"{'' if out.parent == afile else f' ({afile})'}\n")
    assert afile.read_text() == "a file"


def test_register_without_an_mlflow_run_is_refused_before_the_program_is_written(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Review item 2: `--register` for a run trained without MLflow was refused only after OUT was written (and a
    rerun without --force then refused OUT); now before anything is exported, and the store is never opened."""
    out, db = tmp_path / "p.pt2", tmp_path / "mlflow.db"
    assert main(["export", str(run), "--program", str(out), "--register", "tiny", "--tracking-uri",
                 f"sqlite:///{db}"]) == 2
    assert capsys.readouterr().err == ("sigmanens export: error: --register: the run was trained without MLflow "
                                       "tracking (its checkpoint names no MLflow run), so there is no run to log "
                                       "the model into\n")
    assert not out.exists() and not db.exists()


def test_program_flags_without_program_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    message = ("sigmanens export: error: --members, --calibration, --format, --conformal(-score), --weights and "
               "--norm-stats(-prior) go with --program OUT\n")
    for flags in (["--format", "onnx"], ["--weights", "ema"], ["--norm-stats", "batch"], ["--norm-stats-prior", "2"]):
        assert main(["export", str(tmp_path / "run"), str(tmp_path / "w.pt"), *flags]) == 2
        assert capsys.readouterr().err == message


def test_fits_on_a_run_that_validates_on_test_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _random_run(tmp_path / "run", "data.val_split=0", "data.val_from_test=true")
    for flags, asked in ((["--conformal", "0.1"], "--conformal 0.1"),
                         (["--calibration", "temperature", "--conformal", "0.1"],
                          "--calibration temperature and --conformal 0.1")):
        assert main(["export", str(run), "--program", str(tmp_path / "x.onnx"), *flags]) == 2
        assert capsys.readouterr().err == (
            f"sigmanens export: error: {asked}: this run validates on the test set (data.val_from_test); give it a "
            "validation split (data.val_split)\n")
        assert not (tmp_path / "x.onnx").exists()


def test_a_program_without_data_img_size_takes_its_datasets_own_side() -> None:
    """A recipe that leaves ``data.img_size`` unset exports the side its loaders use: the dataset's own (CIFAR-10:
    32), the synthetic recipe's 16."""
    from types import SimpleNamespace

    from sigmanens_dist.export.program import _default_size

    assert _default_size(SimpleNamespace(data=SimpleNamespace(dataset="cifar10"))) == 32
    assert _default_size(SimpleNamespace(data=SimpleNamespace(dataset="fashion_mnist"))) == 28
    assert _default_size(SimpleNamespace(data=SimpleNamespace(dataset="synthetic"))) == 16


def test_export_program_given_a_path_says_what_it_takes(tmp_path: Path) -> None:
    """It took the checkpoint's path until 0.3.0; given one now it says to rebuild the model first, before any
    file is written."""
    with pytest.raises(UsageError, match=r"takes the model load_trained rebuilt .*not a PosixPath"):
        export_program(tmp_path / "ckpt.pt", tmp_path / "model.pt2")  # type: ignore[arg-type]
    assert not (tmp_path / "model.pt2").exists()
