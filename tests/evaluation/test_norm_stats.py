"""``--norm-stats batch`` and ``--norm-stats-prior N`` (evaluation/norm_stats.py): each member's BatchNorm statistics
re-estimated from the prediction batch equal a hand-written re-estimation, mixed with the training statistics by the
prior; every BatchNorm method; the stored statistics never change; a model without BatchNorm and bad flags are one
line and exit 2 before any work; an exported batch-statistics program is eager eval's, and predict checks it."""

from __future__ import annotations

import copy
import itertools
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.cli import main
from sigmanens_dist.config import load_config
from sigmanens_dist.errors import UsageError
from sigmanens_dist.inference.norm_stats import batch_norm_layers, norm_stats_problem, with_norm_stats
from sigmanens_dist.models import build_model, load_trained
from sigmanens_dist.predict.norm_stats import check_norm_stats
from sigmanens_dist.program_meta import OUTPUTS, ProgramMeta
from sigmanens_dist.sigma.layers import SigmaBatchNorm
from tests.helpers import FIXTURE, REPO, env, torchrun, untrained_run

METHODS = ("sigma", "single", "deep", "batch", "packed", "film")  # every method of test_resnet keeps BatchNorms
TINY = ["model.name=test_resnet", "model.num_members=2", "data.dataset=synthetic", "data.img_size=16",
        "data.val_split=16", "data.val_subset=16", "data.test_subset=24", "train.batch_size=8",
        "data.num_workers=0", "tracking.enabled=false"]


def _drifted_sigma() -> nn.Module:
    """A 2-member σN-Ens of conv → BatchNorm → ReLU → linear whose members' running statistics differ."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    ens = convert_to_sigma_ensemble(net, 2)
    ens.train()
    for _ in range(3):
        ens.forward_members(2 * torch.randn(10, 1, 8, 8) + 1)
    return ens.eval()


@pytest.mark.parametrize("prior", [0.0, 7.0])
def test_batch_stats_equal_a_hand_written_re_estimation(prior: float) -> None:
    ens = _drifted_sigma()
    stored = ens.sigma.running_stats.clone()
    x = torch.randn(5, 1, 8, 8)
    adapted = with_norm_stats(ens, "batch", prior)
    with torch.no_grad():
        got = adapted(x)
        conv, bn, linear = ens.backbone[0], ens.backbone[1], ens.backbone[4]
        h = conv(x)  # the shared convolution: every member sees the same activations here
        n = x.shape[0]
        for m in range(2):  # by hand: member m's mean and variance over the batch, its affine and σ gate
            mean, var = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
            mean = (prior * bn.running_mean[m] + n * mean) / (prior + n)
            var = (prior * bn.running_var[m] + n * var) / (prior + n)
            per_channel = [t[:, None, None] for t in (mean, var, bn.weight[m], bn.bias[m], bn.gamma[m])]
            mu, sigma2, w, b, gamma = per_channel
            y = torch.sigmoid(gamma) * (w * (h - mu) / torch.sqrt(sigma2 + bn.eps) + b)
            torch.testing.assert_close(got[m], linear(torch.relu(y).flatten(1)), rtol=0, atol=1e-5)
        assert not torch.allclose(got, ens(x), atol=1e-3)  # not the training statistics
        torch.testing.assert_close(adapted(x), got, rtol=0, atol=0)  # eval after eval: the same
    assert torch.equal(ens.sigma.running_stats, stored) and torch.equal(adapted.sigma.running_stats, stored)
    assert with_norm_stats(ens, "train") is ens


def test_a_layer_alone_takes_member_major_rows() -> None:
    """Called alone (member-major rows), member m's statistics come from rows m·B … (m+1)·B − 1."""
    layer = with_norm_stats(_drifted_sigma(), "batch").backbone[1]
    h = torch.randn(2 * 6, 4, 5, 5)
    with torch.no_grad():
        scale, shift = layer.gated_affine()
        want = torch.cat([F.batch_norm(h[6 * m: 6 * (m + 1)], None, None, scale[m], shift[m], True, 0.0, layer.eps)
                          for m in range(2)])
        torch.testing.assert_close(layer(h), want, rtol=0, atol=1e-5)


def _as_if_trained(model: nn.Module) -> nn.Module:
    """``model`` with what training leaves in its BatchNorms and an untrained model lacks: running statistics moved
    by batches of another distribution, weights away from 1 and biases away from 0 (a σ model: its store's member
    affines and gates). Then a BatchNorm that drops its bias or its weight gives another output."""
    with torch.no_grad():
        model.train()
        for _ in range(3):
            model(2 * torch.randn(8, 3, 16, 16) + 1)
        for module in model.modules():
            if isinstance(module, _BatchNorm) and module.affine:
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.5)
        if isinstance(getattr(model, "sigma", None), nn.Module):
            for parameter in model.sigma.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.eval()


def _normalised_by_the_batch(model: nn.Module) -> nn.Module:
    """The reference: a copy whose BatchNorms alone are in training mode, where torch (and a σ BatchNorm, member by
    member) normalises with the batch's own statistics and applies the affine."""
    copy_ = copy.deepcopy(model)
    for module in copy_.modules():
        if isinstance(module, _BatchNorm | SigmaBatchNorm):
            module.train()
    return copy_


@pytest.mark.parametrize("method", METHODS)
def test_every_batchnorm_method(method: str) -> None:
    """Every method's BatchNorms, as training leaves them, use the batch (per member): the output is that of the
    model with its BatchNorms in training mode; the stored statistics stay; an overwhelming prior gives back the
    training statistics' output."""
    torch.manual_seed(0)
    model = _as_if_trained(build_model(load_config(None, [*TINY, f"model.method={method}"], check_data=False), 10, 3))
    assert batch_norm_layers(model) and norm_stats_problem(model, "batch", "it") is None
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = 3 * torch.rand(6, 3, 16, 16)  # far from the statistics the model keeps
    with torch.no_grad():
        train, batch = model(x), with_norm_stats(model, "batch")(x)
        prior = with_norm_stats(model, "batch", 1e9)(x)
        torch.testing.assert_close(batch, _normalised_by_the_batch(model)(x), rtol=0, atol=1e-4)
        assert not torch.allclose(batch, train, atol=1e-3)
        torch.testing.assert_close(prior, train, rtol=0, atol=1e-4)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", METHODS)
def test_per_sample_statistics_predict_each_image_as_a_batch_of_its_own(method: str) -> None:
    """``per_sample`` (eval's ``--batch-size 1`` with a prior, in one pass): every image's prediction is the one it
    gets called alone, for every method as training leaves it, in both σ row layouts; not the batch's."""
    torch.manual_seed(0)
    model = _as_if_trained(build_model(load_config(None, [*TINY, f"model.method={method}"], check_data=False), 10, 3))
    x = 3 * torch.rand(5, 3, 16, 16)
    if model.pools_member_rows:  # BatchEnsemble: eval predicts its images one by one instead
        with pytest.raises(ValueError, match="norms pool its members' rows of an image"):
            with_norm_stats(model, "batch", 16.0, per_sample=True)
        return
    with torch.no_grad():
        one = with_norm_stats(model, "batch", 16.0)
        alone = torch.cat([one(x[i: i + 1]) for i in range(len(x))], dim=-2)
        per_sample = with_norm_stats(model, "batch", 16.0, per_sample=True)
        torch.testing.assert_close(per_sample(x), alone, rtol=0, atol=1e-5)
        assert not torch.allclose(one(x), alone, atol=1e-3)
        # member-major rows (each member its own copy of the batch), as in training
        m = model.num_members
        rows = x.repeat(m, 1, 1, 1)
        alone = torch.cat([one(x[i: i + 1].repeat(m, 1, 1, 1), member_major=True) for i in range(len(x))], dim=-2)
        torch.testing.assert_close(per_sample(rows, member_major=True), alone, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="per-sample statistics need a prior > 0"):
        with_norm_stats(model, "batch", 0.0, per_sample=True)


def test_a_model_without_batchnorm_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert norm_stats_problem(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), "batch", "it") is not None
    run = shutil.copytree(FIXTURE, tmp_path / "run")  # a σN-Ens of a ViT: LayerNorms only
    out = tmp_path / "out"
    assert main(["eval", "--checkpoint", str(run), "--norm-stats", "batch", "--out", str(out), "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--norm-stats batch: model.method='sigma' (model.name='vit_tiny_patch16_224') has no " \
        "BatchNorm layer with running statistics" in err[0] and not out.exists()
    assert main(["export", str(run), "--program", str(tmp_path / "p.pt2"), "--norm-stats", "batch"]) == 2
    assert "has no BatchNorm layer" in capsys.readouterr().err and not (tmp_path / "p.pt2").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--norm-stats-prior", "4"], "--norm-stats-prior 4 goes with --norm-stats batch"),
    (["--norm-stats", "batch", "--norm-stats-prior", "-1"], "--norm-stats-prior '-1': give the prior strength N"),
    (["--norm-stats", "batch", "--norm-stats-prior", "inf"], "--norm-stats-prior 'inf': give the prior strength N"),
])
def test_bad_prior_is_one_line_before_the_checkpoint_is_read(args: list[str], message: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--checkpoint", str(tmp_path / "none.pt"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def _random_run(run: Path) -> Path:
    """A run directory holding one checkpoint of a freshly built TINY σN-Ens."""
    return untrained_run(run, TINY)


def test_eval_with_batch_stats_end_to_end(tmp_path: Path) -> None:
    """`sigmanens eval --norm-stats batch` scores the prediction copy on every pass, says so, and a second run gives
    the same numbers (the checkpoint's statistics are not touched)."""
    run = _random_run(tmp_path / "run")
    ckpt = run / "checkpoints" / "step_00000000.pt"
    stored = ckpt.read_bytes()
    reports = []
    for name, flags in (("train", []), ("batch", ["--norm-stats", "batch"]), ("again", ["--norm-stats", "batch"])):
        assert main(["eval", "--checkpoint", str(run), "--out", str(tmp_path / name), "--no-mlflow",
                     "--no-sub-ensembles", *flags]) == 0
        reports.append(json.loads((tmp_path / name / "eval.json").read_text()))
    train, batch, again = reports
    assert train["norm_stats"] == {"mode": "train"} and batch["norm_stats"] == {"mode": "batch", "prior": 0.0}
    assert any("re-estimated from each batch of 8" in note for note in batch["notes"])
    assert batch["weights"]["raw"]["metrics"] == again["weights"]["raw"]["metrics"] and ckpt.read_bytes() == stored
    assert batch["weights"]["raw"]["metrics"]["nll"] != train["weights"]["raw"]["metrics"]["nll"]
    # by hand: the eager prediction copy over the same 3 test batches of 8
    assert batch["weights"]["raw"]["metrics"]["nll"] == pytest.approx(_eager_nll(ckpt, [0, 8, 16, 24]), rel=1e-5)


def _eager_nll(ckpt: Path, edges: list[int]) -> float:
    """The test NLL of the checkpoint's prediction copy (batch statistics) over the test batches [edges[i],
    edges[i+1])."""
    cfg, model, *_ = load_trained(ckpt)
    from sigmanens_dist.data.raw import build_datasets

    test = build_datasets(cfg.data, cfg.data_root()).test
    n = edges[-1]
    x, y = torch.stack([test[i][0] for i in range(n)]), torch.tensor([test[i][1] for i in range(n)])
    adapted = with_norm_stats(model, "batch")
    with torch.no_grad():
        probs = torch.cat([adapted(x[lo:hi]).softmax(-1).mean(0) for lo, hi in itertools.pairwise(edges)])
    return float(-probs[torch.arange(n), y].log().mean())


@pytest.mark.slow
def test_every_rank_normalises_with_its_own_batches(tmp_path: Path) -> None:
    """Under torchrun each rank scores its contiguous shard (12 of the 24 test samples) in its own batches, each
    normalised by itself, with nothing synced: rank 0's batches are samples 0-7 and 8-11, rank 1's 12-19 and 20-23."""
    run = _random_run(tmp_path / "run")
    out = tmp_path / "out"
    proc = subprocess.run([*torchrun(2), "-m", "sigmanens_dist.cli", "eval", "--checkpoint", str(run), "--out",
                           str(out), "--no-mlflow", "--no-sub-ensembles", "--device", "cpu", "--norm-stats", "batch"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((out / "eval.json").read_text())["weights"]["raw"]["metrics"]
    assert metrics["num_samples"] == 24
    ckpt = run / "checkpoints" / "step_00000000.pt"
    assert metrics["nll"] == pytest.approx(_eager_nll(ckpt, [0, 8, 12, 20, 24]), rel=1e-5)


def _metadata(path: Path) -> dict:
    extra = {"sigmanens.json": ""}
    torch.export.load(path, extra_files=extra)
    return json.loads(extra["sigmanens.json"])


def test_batch_stats_program_is_eager_eval_and_predict_checks_it(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = _random_run(tmp_path / "run")
    program = tmp_path / "batch.pt2"
    assert main(["export", str(run), "--program", str(program), "--norm-stats", "batch", "--norm-stats-prior",
                 "2"]) == 0
    assert _metadata(program)["norm_stats"] == {"mode": "batch", "prior": 2.0}
    model = with_norm_stats(load_trained(run / "checkpoints" / "step_00000000.pt").model, "batch", 2.0)
    module = torch.export.load(program).module()
    for batch in (2, 7):
        x = torch.rand(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            want = model(x).softmax(-1).mean(0)  # the synthetic recipe: mean 0, std 1
        torch.testing.assert_close(module(x)["probabilities"], want, rtol=0, atol=1e-5)
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        pixels = np.random.default_rng(i).integers(0, 255, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels, "RGB").save(images / f"{i}.png")
    capsys.readouterr()
    assert main(["predict", str(program), str(images), "--out", str(tmp_path / "p"), "--norm-stats", "train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "normalises with the batch statistics it was exported with; export one with " \
        "`sigmanens export RUN --program OUT --norm-stats train`" in err[0] and not (tmp_path / "p").exists()
    assert main(["predict", str(program), str(images), "--out", str(tmp_path / "q"), "--norm-stats", "batch"]) == 0


def _meta(**norm_stats: object) -> ProgramMeta:
    """A program's metadata with these BatchNorm statistics (none: a program from before ``--norm-stats``)."""
    raw = {"format": "sigmanens-program/1", "num_classes": 2, "input": {"shape": ["B", 3, 16, 16]},
           "normalisation": {"mean": [0.0] * 3, "std": [1.0] * 3}, "members": [0], "trained_members": 1,
           "method": "single", "tau": None, "run_id": None, "step": 0, "dataset": "synthetic",
           "package_version": "0", "calibration": "none", "temperature": 1.0, "outputs": list(OUTPUTS)}
    return ProgramMeta.from_dict(raw | ({"norm_stats": norm_stats} if norm_stats else {}))


def test_predict_refuses_batches_of_one_for_batch_statistics_alone() -> None:
    batch_alone, mixed = _meta(mode="batch", prior=0.0), _meta(mode="batch", prior=4)
    with pytest.raises(UsageError, match=r"--batch-size 1: PROGRAM p.pt2 normalises each batch with that batch's "
                                         r"own BatchNorm statistics"):
        check_norm_stats(Path("p.pt2"), batch_alone, None, 1)
    check_norm_stats(Path("p.pt2"), batch_alone, "batch", 2)
    check_norm_stats(Path("p.pt2"), mixed, None, 1)  # the training statistics count too: one image is enough
    check_norm_stats(Path("p.pt2"), _meta(), "train", 1)  # a program from before --norm-stats: the training statistics
