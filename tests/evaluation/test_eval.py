"""`sigmanens eval`: metrics against hand-computed values and torchmetrics, real sub-ensembles, and end to end on
Fashion-MNIST: corruptions, OOD, raw and EMA weights, MLflow, and the errors raised before any work."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from sklearn.metrics import average_precision_score, roc_auc_score
from torch import nn
from torchmetrics.functional.classification import multiclass_calibration_error

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.catalog.corruption_table import TEST_CORRUPTIONS, VAL_CORRUPTIONS
from sigmanens_dist.cli.eval import main as eval_main
from sigmanens_dist.config import EvalConfig, load_config
from sigmanens_dist.data.idx import FASHION_MNIST_ROOT
from sigmanens_dist.evaluation import run_eval
from sigmanens_dist.evaluation.metrics import (
    DIAGNOSIS_KEYS,
    EnsembleMetrics,
    SampleMetrics,
    adaptive_calibration_error,
    aurc,
    calibration_error,
    ood_detection,
)
from sigmanens_dist.evaluation.run import score_pass
from sigmanens_dist.inference.scores import mutual_information, predictive_entropy
from sigmanens_dist.models import build_model, load_trained
from tests.helpers import run_train

# -- metrics -------------------------------------------------------------------------------------------------------
MEMBER_PROBS = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]],
                             [[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]]])
TARGET = torch.tensor([0, 1])  # ensemble: (0.6, 0.3, 0.1) right, (0.15, 0.4, 0.45) wrong


def test_sample_metrics_hand_computed() -> None:
    metrics = SampleMetrics(3, 2)
    metrics.update(MEMBER_PROBS.log(), TARGET)
    out = metrics.compute()
    assert out["acc"] == pytest.approx(0.5)
    assert out["nll"] == pytest.approx(-(math.log(0.6) + math.log(0.4)) / 2, rel=1e-6)
    brier = ((0.4**2 + 0.3**2 + 0.1**2) + (0.15**2 + 0.6**2 + 0.45**2)) / 2
    assert out["brier"] == pytest.approx(brier, rel=1e-6)
    assert out["ece"] == pytest.approx((abs(1 - 0.6) + abs(0 - 0.45)) / 2, rel=1e-6)  # one sample per bin
    assert out["aurc"] == pytest.approx((0 + 0.5) / 2)  # most confident (0.6) right, then 1 error in 2
    assert out["member1/acc"] == pytest.approx(0.5) and out["member0/acc"] == pytest.approx(1.0)
    assert out["member0/nll"] == pytest.approx(-(math.log(0.7) + math.log(0.6)) / 2, rel=1e-6)
    assert out["disagreement"] == pytest.approx(0.5)
    assert out["member_mean/acc"] == pytest.approx(0.75)


def test_sample_metrics_agree_with_torchmetrics_and_the_loop_metrics() -> None:
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, 5, (400,), generator=g)
    logits = 2 * torch.randn(3, 400, 5, generator=g)
    logits[:, torch.arange(400), target] += 1.0
    sample, loop = SampleMetrics(5, 3), EnsembleMetrics(5, 3)
    for chunk in range(0, 400, 64):  # batching must not matter
        sample.update(logits[:, chunk: chunk + 64], target[chunk: chunk + 64])
        loop.update(logits[:, chunk: chunk + 64], target[chunk: chunk + 64])
    a, b = sample.compute(), loop.compute()
    for key in ("acc", "nll", "ece", "brier", "disagreement", "entropy", "member2/acc", "member2/nll", "member2/ece"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    probs = logits.softmax(-1).mean(0)
    assert a["ece"] == pytest.approx(float(multiclass_calibration_error(probs, target, 5, n_bins=15)), rel=1e-5)


def test_adaptive_ece_and_aurc_by_hand() -> None:
    conf, correct = torch.tensor([0.9, 0.6, 0.8, 0.7]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    # equal-mass bins {0.6, 0.7} (acc 0.5, conf 0.65) and {0.8, 0.9} (acc 0.5, conf 0.85)
    assert adaptive_calibration_error(conf, correct, n_bins=2) == pytest.approx(0.5 * 0.15 + 0.5 * 0.35)
    # by confidence: right, wrong, right, wrong → risks 0, 1/2, 1/3, 2/4
    assert aurc(conf, correct) == pytest.approx((0 + 1 / 2 + 1 / 3 + 2 / 4) / 4)
    assert calibration_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0])) == pytest.approx(0.0)


def test_ood_detection_against_sklearn() -> None:
    g = torch.Generator().manual_seed(1)
    inside, outside = torch.randn(300, generator=g), torch.randn(200, generator=g) + 1.0
    out = ood_detection(inside, outside)
    y = [0] * 300 + [1] * 200
    s = torch.cat([inside, outside]).numpy()
    assert out["auroc"] == pytest.approx(roc_auc_score(y, s), abs=1e-6)
    assert out["aupr_out"] == pytest.approx(average_precision_score(y, s), abs=1e-6)
    assert out["aupr_in"] == pytest.approx(average_precision_score([1 - v for v in y], -s), abs=1e-6)
    threshold = torch.sort(outside).values[math.floor(0.05 * 200)]  # the highest threshold keeping 95 % of OOD
    assert out["fpr95"] == pytest.approx(float((inside >= threshold).double().mean()), abs=1e-6)
    separated = ood_detection(torch.tensor([0.1, 0.2]), torch.tensor([0.8, 0.9]))
    assert separated == {"auroc": 1.0, "aupr_out": 1.0, "aupr_in": 1.0, "fpr95": 0.0}
    with pytest.raises(ValueError, match="samples on both sides"):
        ood_detection(torch.tensor([]), torch.tensor([1.0]))


def test_entropy_and_mutual_information() -> None:
    split = torch.tensor([[[100.0, 0.0]], [[0.0, 100.0]]])  # confident members, opposite classes
    assert predictive_entropy(split).item() == pytest.approx(math.log(2), abs=1e-6)
    assert mutual_information(split).item() == pytest.approx(math.log(2), abs=1e-6)
    same = torch.tensor([[[2.0, 0.0]], [[2.0, 0.0]]])
    assert mutual_information(same).item() == pytest.approx(0.0, abs=1e-6)
    assert predictive_entropy(same).item() > 0.1


# -- sub-ensembles -------------------------------------------------------------------------------------------------
def _tiny_sigma(members: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LayerNorm(4 * 6 * 6),
                        nn.Linear(4 * 6 * 6, 3))
    ens = convert_to_sigma_ensemble(net, members)
    ens.train()
    for _ in range(3):  # members' running statistics drift apart
        ens.forward_members(torch.randn(members * 5, 1, 8, 8))
    return ens.eval()


def test_sub_ensemble_runs_only_the_chosen_members() -> None:
    ens = _tiny_sigma(3)
    x = torch.randn(6, 1, 8, 8)
    full = ens(x)
    sub = ens.select_members([2, 0])
    assert sub.num_members == 2 and sub.sigma.flat.shape[0] == 2
    torch.testing.assert_close(sub(x), full[[2, 0]])
    torch.testing.assert_close(ens.select_members([1])(x), full[[1]])
    assert ens.select_members(range(3)) is ens
    for bad in ([], [0, 0], [3]):
        with pytest.raises(ValueError, match=r"must be distinct indices in 0..2"):
            ens.select_members(bad)


def test_sub_ensemble_of_film_stays_ungated() -> None:
    from sigmanens_dist.methods.film import FiLMEnsemble, convert_to_film_ensemble

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    film = convert_to_film_ensemble(net, 3, init_std=0.5).eval()
    x = torch.randn(4, 1, 8, 8)
    sub = film.select_members([1])
    assert isinstance(sub, FiLMEnsemble) and not sub.sigma.plan.gated
    torch.testing.assert_close(sub(x), film(x)[[1]])


# -- ImageNet-C folders --------------------------------------------------------------------------------------------
def _images(folder: Path, classes: list[str], n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in classes:
        (folder / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = (torch.rand(20, 20, 3, generator=g) * 255).byte().numpy()
            Image.fromarray(pixels).save(folder / c / f"{i}.png")


def test_imagenet_c_folder(tmp_path: Path) -> None:
    root, corrupted = tmp_path / "imgs", tmp_path / "imagenet-c"
    _images(root / "train", ["cat", "dog"], 4, 0)
    _images(root / "val", ["cat", "dog"], 2, 1)
    # a folder of a validation corruption (ImageNet-C's extras) is not read for the test columns
    for i, (name, severity) in enumerate([(n, s) for n in ("fog", "snow", "spatter") for s in (1, 2)]):
        _images(corrupted / name / str(severity), ["cat", "dog"], 2, 10 + i)
    cfg = load_config(None, ["data.dataset=imagefolder", f"data.root={root}", "data.img_size=16", "data.num_workers=0",
                             "model.name=test_resnet", "model.num_members=2", "train.batch_size=4",
                             "tracking.enabled=false"])
    torch.manual_seed(0)
    model = build_model(cfg, 2, 3).eval()
    report = run_eval(cfg, model, options=EvalConfig(imagenet_c=corrupted, severities=[1, 2]), out_dir=tmp_path / "o")
    shift = report["weights"]["raw"]["shift"]
    assert set(shift) == {"fog", "snow", "mean"} and set(shift["fog"]) == {"1", "2"}
    assert shift["mean"]["2"]["acc"] == pytest.approx((shift["fog"]["2"]["acc"] + shift["snow"]["2"]["acc"]) / 2)
    assert (tmp_path / "o" / "shift_raw.png").is_file()
    with pytest.raises(ValueError, match=r"missing folder\(s\) .*fog/3"):
        run_eval(cfg, model, options=EvalConfig(imagenet_c=corrupted, severities=[3]), out_dir=tmp_path / "p")
    shutil.rmtree(corrupted / "snow" / "1" / "dog")
    with pytest.raises(ValueError, match=r"snow/1: class folders \['cat'\]… differ from the training classes"):
        run_eval(cfg, model, options=EvalConfig(imagenet_c=corrupted, severities=[1]), out_dir=tmp_path / "q")


# -- the shift diagnosis, against its definition -------------------------------------------------------------------
def _record_passes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """Every pass eval scores, by its label (``raw val k=2``, ``raw spatter s5``, …; a later pass of one label
    replaces it): the member logits ``(M, B, K)`` of each batch, taken at the model's output. The reference the shift
    diagnosis is held to, computed here from its definition, not by eval's metrics."""
    from sigmanens_dist.evaluation import run as run_module

    passes: dict[str, list[torch.Tensor]] = {}
    real = run_module.score_pass

    def recording(model: nn.Module, batches: object, num_classes: int, device: torch.device, desc: str,
                  *args: object, **kwargs: object) -> object:
        passes[desc] = logits = []
        handle = model.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().double().cpu()))
        try:
            return real(model, batches, num_classes, device, desc, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(run_module, "score_pass", recording)
    return passes


def _hand_mutual_information(logits: list[torch.Tensor]) -> torch.Tensor:
    """Per sample: the entropy of the mean member distribution minus the members' mean entropy."""
    probs = torch.cat(logits, 1).softmax(-1)  # (M, N, K)

    def entropy(p: torch.Tensor) -> torch.Tensor:
        return -(p * p.clamp_min(1e-300).log()).sum(-1)

    return entropy(probs.mean(0)) - entropy(probs).mean(0)


def _check_diagnosis(shift: dict, passes: dict[str, list[torch.Tensor]], clean: str, variant: str,
                     severities: list[str]) -> None:
    """Each cell's mutual information and MI AUROC are the hand-computed ones: the AUROC (sklearn's) of telling the
    corrupted pass (positives) from the clean pass ``clean`` (negatives) by the per-sample mutual information, and the
    mean row their average. Some cell is far from 0.5, so a swap of the two passes (1 − AUROC) cannot pass."""
    clean_mi = _hand_mutual_information(passes[clean])
    aurocs: dict[str, list[float]] = {severity: [] for severity in severities}
    for name in set(shift) - {"mean"}:
        for severity in severities:
            shifted = _hand_mutual_information(passes[f"{variant} {name} s{severity}"])
            labels = [0] * len(clean_mi) + [1] * len(shifted)
            want = roc_auc_score(labels, torch.cat([clean_mi, shifted]).numpy())
            cell = shift[name][severity]
            assert cell["mi_auroc"] == pytest.approx(want, abs=1e-3), (name, severity)  # eval ranks float32 MI
            assert cell["mutual_information"] == pytest.approx(float(shifted.mean()), rel=1e-4, abs=1e-7)
            aurocs[severity].append(want)
    for severity, values in aurocs.items():
        assert shift["mean"][severity]["mi_auroc"] == pytest.approx(sum(values) / len(values), abs=1e-3)
    assert max(abs(v - 0.5) for values in aurocs.values() for v in values) > 0.1, aurocs


# -- the validation shift -----------------------------------------------------------------------------------------
def test_validation_shift_never_reads_the_test_split_nor_a_test_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shift_split: val` scores the validation corruptions (disjoint from the test ones) on the validation split,
    clean and corrupted, with the diagnosis columns; a test split wrapped to fail when read is never read. With one
    member (`members=1`) the member-based columns are undefined, and say so."""
    import dataclasses

    from sigmanens_dist.data import loaders

    root = tmp_path / "imgs"
    _images(root / "train", ["cat", "dog"], 8, 0)
    _images(root / "val", ["cat", "dog"], 2, 1)
    cfg = load_config(None, ["data.dataset=imagefolder", f"data.root={root}", "data.img_size=16", "data.num_workers=0",
                             "data.val_split=6", "model.name=test_resnet", "model.num_members=2",
                             "train.batch_size=4", "tracking.enabled=false"])
    real_build = loaders.build_data

    def build(*args: object, **kwargs: object) -> loaders.Data:
        def test() -> object:
            raise AssertionError("the validation shift read the test split")

        return dataclasses.replace(real_build(*args, **kwargs), test=test)

    monkeypatch.setattr(loaders, "build_data", build)
    passes = _record_passes(monkeypatch)
    torch.manual_seed(0)
    model = build_model(cfg, 2, 3).eval()
    with torch.no_grad():  # members that differ (at init they agree but for rounding): a mutual information to rank
        for parameter in model.sigma.parameters():  # each member's σ-norm affines and gates
            parameter.add_(0.5 * torch.randn_like(parameter))
    options = EvalConfig(split="val", shift_split="val", corruptions=["all"], severities=[5], sub_ensembles=False)
    report = run_eval(cfg, model, options=options, out_dir=tmp_path / "o")
    assert report["split"] == report["shift_split"] == "val"
    raw = report["weights"]["raw"]
    assert raw["metrics"]["num_samples"] == 6  # the validation split, and only it
    assert set(raw["shift"]) - {"mean"} == set(VAL_CORRUPTIONS) and not set(raw["shift"]) & set(TEST_CORRUPTIONS)
    for name, by_sev in raw["shift"].items():
        for cell in by_sev.values():
            assert set(cell) == {"acc", "nll", "ece", *DIAGNOSIS_KEYS}, name
            assert 0 <= cell["mi_auroc"] <= 1 and cell["mutual_information"] >= 0 and 0 <= cell["disagreement"] <= 1
    _check_diagnosis(raw["shift"], passes, "raw val k=2", "raw", ["5"])
    md = (tmp_path / "o" / "eval.md").read_text()
    assert "### Diagnosis under shift (validation corruptions on the validation split)" in md
    assert "| spatter s5 |" in md and "| mean s5 |" in md and "| clean |" in md

    one = options.model_copy(update={"members": 1, "corruptions": ["saturate"]})
    single = run_eval(cfg, model, options=one, out_dir=tmp_path / "one")
    cell = single["weights"]["raw"]["shift"]["mean"]["5"]
    assert cell["disagreement"] is None and cell["mutual_information"] is None and cell["mi_auroc"] is None
    assert cell["member_mean/nll"] == pytest.approx(cell["nll"])
    md = (tmp_path / "one" / "eval.md").read_text()
    assert "One member: the member-based columns are undefined (—)." in md
    assert "disagreement and mutual information undefined (one member)" in md
    assert json.loads((tmp_path / "one" / "eval.json").read_text())["weights"]["raw"]["shift"]["saturate"]["5"][
        "mi_auroc"] is None  # null in the file, not a number that looks measured


def test_shift_split_refusals_before_the_checkpoint_is_read(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(tmp_path / "never-read.pt")
    for args, match in ((["--shift-split", "val", "--corruptions", "gaussian_noise"],
                         r"--corruptions gaussian_noise: test corruption\(s\), not scored on --shift-split val; "
                         r"choose from all, speckle_noise, gaussian_blur, spatter, saturate"),
                        (["--corruptions", "contrast,spatter"],
                         r"--corruptions spatter: validation corruption\(s\), not scored on --shift-split test"),
                        (["--split", "test", "--shift-split", "val"],
                         r"--shift-split val corrupts the val split, but --split is test: the clean and corrupted "
                         r"passes read one split"),
                        (["--split", "val", "--corruptions", "fog"], r"--corruptions fog: test corruption")):
        assert eval_main(["--checkpoint", ckpt, *args]) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and len(err.strip().splitlines()) == 1, err


# -- end to end on Fashion-MNIST -----------------------------------------------------------------------------------
needs_fmnist = pytest.mark.skipif(not FASHION_MNIST_ROOT.is_dir(),
                                  reason="needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-member σN-Ens with EMA, trained briefly through the CLI, evaluated at the end, tracked in sqlite.
    CPU training is deterministic for one code and thread count, but 60 steps at lr 0.05 amplify rounding: a 2e-7
    loss difference at step 2 is 1e-2 by step 6. This recipe's entropy AUROC against digits measured 0.957 before
    the interleaved σ layout, 0.916 (one thread) and 0.883 (CI) after it; MSP 0.83 (docs/eval.md). The test asks
    for what no reordering of sums moves: well above the 0.5 that the test set against itself scores."""
    run = tmp_path_factory.mktemp("eval") / "run"
    run_train(run, "data.dataset=fashion_mnist", "data.train_subset=3000", "data.val_split=300",
              "data.test_subset=300", "data.num_workers=0", "model.name=test_resnet", "model.num_members=2",
              "train.max_steps=60", "train.batch_size=32", "optim.lr=0.05", "train.eval_every_steps=30",
              "train.ema_decay=0.9", "eval.at_end=true", "eval.sub_ensembles=false", "tracking.enabled=true",
              f"tracking.uri=sqlite:///{run.parent / 'mlflow.db'}")
    return run


@needs_fmnist
@pytest.mark.slow
def test_corruption_and_ood_eval_end_to_end(trained: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = trained / "checkpoints" / "best.pt"
    passes = _record_passes(monkeypatch)
    assert eval_main(["--checkpoint", str(ckpt), "--corruptions", "gaussian_noise,contrast", "--severities", "1,5",
                      "--ood", "digits"]) == 0
    out = ckpt.parent / "eval_best"
    report = json.loads((out / "eval.json").read_text())
    assert report["split"] == "test" and set(report["weights"]) == {"raw", "ema"}  # EMA scored too
    raw = report["weights"]["raw"]
    assert raw["metrics"]["num_samples"] == 300
    # sub-ensembles really run k members: k=1 is member 0, k=2 the ensemble
    k1, k2 = raw["sub_ensembles"]
    assert k1["acc"] == pytest.approx(raw["metrics"]["member0/acc"]) and k1["nll"] == pytest.approx(
        raw["metrics"]["member0/nll"], rel=1e-5)
    assert k2["nll"] == pytest.approx(raw["metrics"]["nll"], rel=1e-6) and k1["ms_per_image"] > 0
    shift = raw["shift"]
    assert set(shift) == {"gaussian_noise", "contrast", "mean"} and set(shift["contrast"]) == {"1", "5"}
    assert shift["contrast"]["5"]["acc"] < shift["contrast"]["1"]["acc"] < raw["metrics"]["acc"] + 0.02
    assert report["shift_split"] == "test"  # the diagnosis columns, per corruption and severity and their mean
    for cell in (shift["contrast"]["5"], shift["mean"]["1"]):
        assert set(cell) == {"acc", "nll", "ece", *DIAGNOSIS_KEYS}
        assert 0 <= cell["disagreement"] <= 1 and cell["mutual_information"] >= 0 and 0 <= cell["mi_auroc"] <= 1
    for variant in ("raw", "ema"):  # the trained model's diagnosis, against its definition
        _check_diagnosis(report["weights"][variant]["shift"], passes, f"{variant} test k=2", variant, ["1", "5"])
    assert "### Diagnosis under shift (test corruptions)" in (out / "eval.md").read_text()
    ood = raw["ood"]
    assert ood["num_out"] == 1797 and ood["num_in"] == 300
    assert ood["entropy"]["auroc"] > 0.8 and ood["msp"]["auroc"] > 0.75  # digits are obviously not clothes
    assert 0 < raw["sharing"]["all"] <= 2
    for name in ("eval.md", "reliability_raw.png", "shift_ema.png", "ood_raw.png", "sharing_ema.png"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out.splitlines()  # the terminal summary; eval.md keeps the Markdown tables
    assert any(line.startswith("ensemble ") for line in printed) and max(map(len, printed)) <= 100
    assert "| ensemble |" in (out / "eval.md").read_text()

    # logged to the training run's MLflow run, beside the end-of-training evaluation (eval.sub_ensembles=false)
    from mlflow.tracking import MlflowClient

    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    client = MlflowClient(tracking_uri=f"sqlite:///{trained.parent / 'mlflow.db'}")
    run = client.get_run(state["mlflow_run_id"])
    assert run.data.metrics["eval/test/raw/ood_digits/entropy/auroc"] == pytest.approx(ood["entropy"]["auroc"])
    assert {a.path for a in client.list_artifacts(run.info.run_id, "eval/best")} >= {"eval/best/eval.json",
                                                                                   "eval/best/eval.md"}
    at_end = json.loads((trained / "eval" / "eval.json").read_text())
    assert at_end["members"] == 2 and [r["k"] for r in at_end["weights"]["ema"]["sub_ensembles"]] == [2]


@needs_fmnist
@pytest.mark.slow
def test_test_set_against_itself_is_chance(trained: Path) -> None:
    cfg, model, *_ = load_trained(trained / "checkpoints" / "best.pt")
    from sigmanens_dist.data.raw import build_datasets

    test = build_datasets(cfg.data, cfg.data_root()).test
    x = torch.stack([test[i][0] for i in range(len(test))])
    y = torch.tensor([test[i][1] for i in range(len(test))])
    halves = [score_pass(model, [(x[s], y[s])], 10, torch.device("cpu"), "half")[0].scores()
              for s in (slice(0, 150), slice(150, 300))]
    assert ood_detection(halves[0]["entropy"], halves[1]["entropy"])["auroc"] == pytest.approx(0.5, abs=0.1)


@needs_fmnist
@pytest.mark.slow
@pytest.mark.parametrize(("args", "match"), [
    (["--corruptions", "smoke"], r"unknown corruption\(s\) 'smoke'; allowed: all, gaussian_noise, shot_noise"),
    (["--severities", "0-7"], r"--severities '0-7': give severities in 1..5"),
    (["--members", "3"], r"--members 3: the model has only M=2 members \(choose 1..2\)"),
    (["--ood", "svhn"], r"--ood 'svhn': for data.dataset='fashion_mnist' the OOD sets are digits"),
])
def test_bad_input_is_refused_before_work(trained: Path, args: list[str], match: str,
                                          capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = eval_main(["--checkpoint", str(trained / "checkpoints" / "best.pt"), "--out", str(out), *args])
    assert code == 2
    assert re.search(match, capsys.readouterr().err)
    assert not out.exists()  # nothing was evaluated


@needs_fmnist
@pytest.mark.slow
def test_missing_or_mismatched_checkpoint(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert eval_main(["--checkpoint", str(tmp_path / "nope.pt")]) == 2
    assert f"--checkpoint {tmp_path / 'nope.pt'}: no such file" in capsys.readouterr().err
    state = torch.load(trained / "checkpoints" / "best.pt", map_location="cpu", weights_only=False)
    state["config"]["model"]["method"] = "single"  # the file's weights are σN-Ens, its config now says single
    torch.save(state, tmp_path / "odd.pt")
    assert eval_main(["--checkpoint", str(tmp_path / "odd.pt")]) == 2
    assert "the 'model' weights are not those of a model.method='single' model as the checkpoint's config says" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "match"), [
    (["eval.members=5"], r"eval.members: the model has only model.num_members=4 members \(got 5\)"),
    (["eval.corruptions=[smoke]"], r"eval.corruptions: unknown corruption\(s\) 'smoke'; allowed: all, gaussian_noise"),
    (["eval.severities=[0, 6]"], r"eval.severities: severities must be a non-empty list of 1..5"),
    (["eval.corruptions=[spatter]"], r"eval.corruptions: spatter: validation corruption\(s\), not scored on "
                                     r"eval.shift_split=test"),
    (["eval.split=val", "eval.corruptions=[fog]"], r"eval.corruptions: fog: test corruption\(s\)"),
    (["eval.shift_split=val"], r"eval.shift_split: val corrupts the val split, but eval.split is test"),
])
def test_eval_config_errors(overrides: list[str], match: str) -> None:
    from sigmanens_dist.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides, check_data=False)


@needs_fmnist
@pytest.mark.slow
def test_calibration_and_conformal_end_to_end(trained: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """`--calibration temperature --conformal 0.1` through the CLI: fitted on the 300 validation samples, scored on
    the 300 test samples, clean and under shift (tests/evaluation/test_posthoc.py proves the fit never reads the test
    split)."""
    out = tmp_path / "out"
    assert eval_main(["--checkpoint", str(trained / "checkpoints" / "best.pt"), "--out", str(out), "--no-mlflow",
                      "--no-sub-ensembles", "--corruptions", "contrast", "--severities", "1", "--calibration",
                      "temperature", "--conformal", "0.1"]) == 0
    for part in json.loads((out / "eval.json").read_text())["weights"].values():
        cal, (conf,) = part["calibration"], part["conformal"]
        assert cal["num_fit"] == 300 and cal["val_nll_after"] <= cal["val_nll_before"]
        assert set(cal["shift"]["contrast"]) == {"1"}
        for r in conf["methods"].values():
            assert r["coverage"] > 0.8 and len(r["per_class"]) == 10 and "mean" in r["shift"]
    printed = capsys.readouterr().out
    assert "Temperature scaling: T = " in printed and "Conformal sets at α = 0.1" in printed


@needs_fmnist
@pytest.mark.slow
def test_batch_norm_stats_and_member_temperatures_end_to_end(trained: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`--norm-stats batch --calibration member-temperature` through the CLI on the trained run: every pass (the
    validation fit, test, shift) uses each batch's statistics, which under contrast (a shift of the activations' scale
    that the training statistics cannot follow) score better than the training ones; the member temperatures are
    reported beside the ensemble's."""
    ckpt = str(trained / "checkpoints" / "best.pt")
    common = ["--no-mlflow", "--no-sub-ensembles", "--corruptions", "contrast", "--severities", "5"]
    assert eval_main(["--checkpoint", ckpt, "--out", str(tmp_path / "train"), *common]) == 0
    assert eval_main(["--checkpoint", ckpt, "--out", str(tmp_path / "batch"), *common, "--norm-stats", "batch",
                      "--calibration", "member-temperature"]) == 0
    train, batch = (json.loads((tmp_path / name / "eval.json").read_text()) for name in ("train", "batch"))
    assert batch["norm_stats"] == {"mode": "batch", "prior": 0.0}
    for variant in ("raw", "ema"):
        before, after = train["weights"][variant], batch["weights"][variant]
        assert after["shift"]["contrast"]["5"]["acc"] > before["shift"]["contrast"]["5"]["acc"] + 0.05, variant
        cal = after["member_calibration"]
        assert len(cal["temperatures"]) == 2 and cal["num_fit"] == 300 and set(cal["shift"]["contrast"]) == {"5"}
    printed = capsys.readouterr().out
    assert "Member temperatures: T_m = " in printed and "re-estimated from each batch of 32" in (
        tmp_path / "batch" / "eval.md").read_text()
