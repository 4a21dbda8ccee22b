"""Post-hoc temperature scaling and split conformal sets (`sigmanens eval --calibration temperature --conformal α`):
the fit on synthetic logits, coverage on synthetic calibrated data, that fitting reads the validation split only (or
the calibration split only, data.calib_split), and the errors raised before any work."""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import sigmanens_dist.data.loaders as loaders
import sigmanens_dist.evaluation.run as run
from sigmanens_dist.cli.eval import _check_split_overrides
from sigmanens_dist.cli.eval import main as eval_main
from sigmanens_dist.config import ConfigError, EvalConfig, load_config
from sigmanens_dist.data.raw import build_datasets
from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.metrics import SampleMetrics
from sigmanens_dist.evaluation.posthoc import ConformalSets, TemperedMetrics
from sigmanens_dist.evaluation.report import flat_metrics
from sigmanens_dist.inference.collect import collect_logits
from sigmanens_dist.inference.conformal import class_scores, conformal_quantile
from sigmanens_dist.inference.temperature import ensemble_nll, fit_member_temperatures, fit_temperature
from sigmanens_dist.models import build_model
from tests.helpers import FIXTURE


# -- temperature -----------------------------------------------------------------------------------------------------
def test_fit_recovers_the_temperature_of_overconfident_members() -> None:
    g = torch.Generator().manual_seed(0)
    true = 1.5 * torch.randn(2, 4000, 5, generator=g)  # two members; labels drawn from their mean softmax
    target = torch.multinomial(true.softmax(-1).mean(0), 1, generator=g)[:, 0]
    temperature = fit_temperature(3 * true, target)  # members three times too confident
    assert temperature == pytest.approx(3.0, rel=0.1)
    assert ensemble_nll(3 * true, target, temperature) < ensemble_nll(3 * true, target)
    assert fit_temperature(true, target) == pytest.approx(1.0, rel=0.1)  # calibrated already: T stays near 1


def test_tempered_metrics_score_the_scaled_logits() -> None:
    g = torch.Generator().manual_seed(1)
    logits, target = torch.randn(3, 50, 4, generator=g), torch.randint(0, 4, (50,), generator=g)
    tempered, plain = TemperedMetrics(2.5, 4, 3), SampleMetrics(4, 3)
    tempered.update(logits, target)
    plain.update(logits / 2.5, target)
    assert tempered.compute() == pytest.approx(plain.compute())


def test_member_temperatures_minimise_each_members_own_nll() -> None:
    """``--calibration member-temperature``: T_m is member m's own best temperature, and averaging the members so
    tempered is another model than the one T of the ensemble."""
    g = torch.Generator().manual_seed(2)
    true = 1.5 * torch.randn(2, 4000, 5, generator=g)
    target = torch.multinomial(true.softmax(-1).mean(0), 1, generator=g)[:, 0]
    logits = torch.stack([3 * true[0], 0.5 * true[1]])  # one member far too confident, the other too timid
    temperatures = fit_member_temperatures(logits, target)
    for m, t in enumerate(temperatures):
        own = [float(ensemble_nll(logits[m: m + 1], target, t * f)) for f in (1.0, 1.05, 1 / 1.05)]
        assert own[0] <= min(own[1:]), m  # a minimum of member m's own validation NLL
    # exchangeable members scaled 3× and 0.5×: their own temperatures stand about 6 to 1
    assert temperatures[0] / temperatures[1] == pytest.approx(6, rel=0.25)
    one = fit_temperature(logits, target)
    assert float(ensemble_nll(logits, target, temperatures)) != pytest.approx(float(ensemble_nll(logits, target, one)),
                                                                               rel=1e-3)
    tempered, plain = TemperedMetrics(temperatures, 5, 2), SampleMetrics(5, 2)
    tempered.update(logits, target)
    plain.update(logits / torch.tensor(temperatures)[:, None, None], target)
    assert tempered.compute() == pytest.approx(plain.compute())


# -- conformal -------------------------------------------------------------------------------------------------------
def test_quantile_and_scores_by_hand() -> None:
    scores = torch.arange(1.0, 11.0)  # n = 10
    assert conformal_quantile(scores, 0.1) == 10.0  # ⌈11 · 0.9⌉ = 10th smallest
    assert conformal_quantile(scores, 0.2) == 9.0  # ⌈8.8⌉ = 9
    assert conformal_quantile(scores, 0.05) == math.inf  # ⌈10.45⌉ = 11 > n: every class
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    torch.testing.assert_close(class_scores(probs, "thr"), torch.tensor([[0.9, 0.4, 0.7]]))
    torch.testing.assert_close(class_scores(probs, "aps"), torch.tensor([[1.0, 0.6, 0.9]]))
    wide = torch.full((1, 8), 1 / 8)  # RAPS adds 0.01 per rank beyond 5
    assert class_scores(wide, "raps")[0, -1].item() == pytest.approx(1.0 + 3 * 0.01)
    with pytest.raises(ValueError, match="conformal method 'lac': choose from thr, aps, raps"):
        class_scores(probs, "lac")


def _calibrated(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (1, n, K) whose softmax is the true label distribution: perfectly calibrated data."""
    logits = 2 * torch.randn(1, n, k, generator=g)
    return logits, torch.multinomial(logits[0].softmax(-1), 1, generator=g)[:, 0]


@pytest.mark.parametrize("alpha", [0.1, 0.05])
def test_split_conformal_covers_and_thr_is_smallest(alpha: float) -> None:
    g = torch.Generator().manual_seed(2)
    coverage: dict[str, list[float]] = {"thr": [], "aps": [], "raps": []}
    sizes: dict[str, list[float]] = {m: [] for m in coverage}
    for _ in range(20):  # 20 random calibration/test splits: coverage is ≥ 1 − α in expectation over them
        cal_logits, cal_y = _calibrated(500, 10, g)
        probs = cal_logits[0].softmax(-1)
        q = {m: conformal_quantile(class_scores(probs, m).gather(-1, cal_y[:, None])[:, 0], alpha) for m in coverage}
        sets = ConformalSets(q, 10)
        sets.update(*_calibrated(2000, 10, g))
        for m, r in sets.compute().items():
            coverage[m].append(r["coverage"])
            sizes[m].append(r["set_size"])
    for m in coverage:
        mean = sum(coverage[m]) / len(coverage[m])
        # E[coverage] ∈ [1 − α, 1 − α + 1/(n+1)]; the mean of 20 × 2000 test samples has sd < 0.003
        assert 1 - alpha - 0.01 <= mean <= 1 - alpha + 1 / 501 + 0.01, (m, mean)
    assert sum(sizes["thr"]) < sum(sizes["raps"]) <= sum(sizes["aps"]) + 1e-6


def test_per_class_coverage_and_size() -> None:
    sets = ConformalSets({"thr": 0.5}, 3)  # the class of probability ≥ 0.5, if any
    logits = torch.tensor([[[0.9, 0.05, 0.05], [0.2, 0.7, 0.1], [0.4, 0.3, 0.3]]]).log()
    sets.update(logits, torch.tensor([0, 0, 1]))
    r = sets.compute()["thr"]
    assert r["coverage"] == pytest.approx(1 / 3) and r["set_size"] == pytest.approx(2 / 3)
    by_class = {c["class"]: c for c in r["per_class"]}
    assert by_class[0]["n"] == 2 and by_class[0]["coverage"] == pytest.approx(0.5)
    assert by_class[1]["coverage"] == 0.0 and by_class[1]["set_size"] == 0.0
    assert by_class[2]["n"] == 0 and math.isnan(by_class[2]["coverage"])


# -- in sigmanens eval -----------------------------------------------------------------------------------------------
def _images(folder: Path, classes: list[str], n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in classes:
        (folder / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray((torch.rand(12, 12, 3, generator=g) * 255).byte().numpy()).save(folder / c / f"{i}.png")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    tmp = tmp_path_factory.mktemp("posthoc")
    _images(tmp / "imgs" / "train", ["cat", "dog"], 20, 0)
    _images(tmp / "imgs" / "val", ["cat", "dog"], 6, 1)
    for severity in (1, 2):
        _images(tmp / "imagenet-c" / "fog" / str(severity), ["cat", "dog"], 3, 10 + severity)
    cfg = load_config(None, ["data.dataset=imagefolder", f"data.root={tmp / 'imgs'}", "data.img_size=12",
                             "data.val_split=16", "data.num_workers=0", "model.name=test_resnet",
                             "model.num_members=2", "train.batch_size=4", "tracking.enabled=false"])
    torch.manual_seed(0)
    return cfg, build_model(cfg, 2, 3).eval(), tmp


def test_eval_fits_on_val_only_and_reports_before_and_after(setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, model, tmp = setup
    options = EvalConfig(calibration="temperature", conformal=[0.2, 0.5], imagenet_c=tmp / "imagenet-c",
                         severities=[1, 2], sub_ensembles=False)
    real_build, real_fit = loaders.build_data, run.fit_posthoc_on
    fitting: list[bool] = []
    noise = torch.Generator().manual_seed(3)

    def build(*args: object, **kwargs: object) -> loaders.Data:
        data = real_build(*args, **kwargs)

        def test() -> object:
            if fitting:  # a dataset wrapper that refuses to be read while fitting
                raise AssertionError("the test split was read while fitting on the validation split")
            if build.garbage:  # type: ignore[attr-defined]
                return [(torch.randn(6, 3, 12, 12, generator=noise), torch.randint(0, 2, (6,), generator=noise))]
            return data.test()

        return dataclasses.replace(data, test=test)

    fit = _flagged(real_fit, fitting)

    build.garbage = False  # type: ignore[attr-defined]
    monkeypatch.setattr(loaders, "build_data", build)
    monkeypatch.setattr(run, "fit_posthoc_on", fit)
    raw = run.run_eval(cfg, model, options=options, out_dir=tmp / "a")["weights"]["raw"]
    build.garbage = True  # type: ignore[attr-defined]
    other = run.run_eval(cfg, model, options=options, out_dir=tmp / "b")["weights"]["raw"]

    cal, (conf, loose) = raw["calibration"], raw["conformal"]
    assert cal["fitted_on"] == "val" and cal["num_fit"] == 16 and cal["val_nll_after"] <= cal["val_nll_before"]
    assert cal["metrics"]["num_samples"] == 12 == raw["metrics"]["num_samples"]
    assert set(cal["shift"]) == {"fog", "mean"} and set(cal["shift"]["mean"]) == {"1", "2"}
    assert set(conf["methods"]) == {"thr", "aps", "raps"} and conf["temperature"] == cal["temperature"]
    thr = conf["methods"]["thr"]
    assert 0 <= thr["coverage"] <= 1 and 0 <= thr["set_size"] <= 2 and len(thr["per_class"]) == 2
    assert set(thr["shift"]["fog"]) == {"1", "2"} and "mean" in thr["shift"]
    # a second α from the same pass: a larger miscoverage, a lower threshold and sets no larger
    assert (conf["alpha"], loose["alpha"]) == (0.2, 0.5)
    for method, r in loose["methods"].items():
        assert r["qhat"] <= conf["methods"][method]["qhat"] and r["set_size"] <= conf["methods"][method]["set_size"]
    # what is fitted depends on the validation split alone: a test split of noise changes the scores, not the fit
    assert other["calibration"]["temperature"] == cal["temperature"]
    assert other["conformal"][0]["methods"]["aps"]["qhat"] == conf["methods"]["aps"]["qhat"]
    assert other["calibration"]["metrics"]["nll"] != cal["metrics"]["nll"]
    _assert_reported(tmp / "a", raw, ["### Temperature scaling: T = ", "### Conformal sets: α = 0.2",
                                      "### Conformal sets: α = 0.5"],
                     {"eval/test/raw/calibrated/nll", "eval/test/raw/conformal/a0.2/aps/coverage",
                      "eval/test/raw/conformal/a0.5/thr/set_size"})


def _assert_reported(folder: Path, raw: dict, headings: list[str], keys: set[str]) -> None:
    """``folder``'s eval.md has every heading, and the flat metrics of ``raw`` (the MLflow keys) every key."""
    md = (folder / "eval.md").read_text()
    assert [h for h in headings if h not in md] == []
    assert keys <= set(flat_metrics({"split": "test", "weights": {"raw": raw}}))


def test_member_temperatures_are_reported_beside_the_ensemble_temperature(setup: tuple) -> None:
    cfg, model, tmp = setup
    options = EvalConfig(calibration="member-temperature", conformal=[0.2], imagenet_c=tmp / "imagenet-c",
                         severities=[1], sub_ensembles=False)
    raw = run.run_eval(cfg, model, options=options, out_dir=tmp / "m")["weights"]["raw"]
    one, members = raw["calibration"], raw["member_calibration"]
    assert members["method"] == "member-temperature" and len(members["temperatures"]) == 2
    assert members["num_fit"] == 16 and members["val_nll_before"] == one["val_nll_before"]
    assert members["metrics"]["num_samples"] == 12 and set(members["shift"]) == {"fog", "mean"}
    assert members["val_nll_after"] <= members["val_nll_before"] + 1e-6
    assert raw["conformal"][0]["temperature"] == members["temperatures"]  # the sets use the member temperatures
    _assert_reported(tmp / "m", raw, ["### Temperature scaling: T = ", "### Member temperatures: T_m = "],
                     {"eval/test/raw/calibrated/nll", "eval/test/raw/member_calibrated/nll",
                      "eval/test/raw/member_calibrated/temperature/1"})


def test_fitting_on_the_scored_split_is_refused(setup: tuple) -> None:
    cfg, model, _ = setup
    with pytest.raises(ValueError, match=r"cannot be scored on the split they are fitted on: use --split test"):
        run.check_options(cfg, model, EvalConfig(split="val", calibration="temperature"))
    leaky = cfg.model_copy(update={"data": cfg.data.model_copy(update={"val_from_test": True})})
    with pytest.raises(ValueError, match=r"fitting would read the test set"):
        run.check_options(leaky, model, EvalConfig(conformal=[0.1]))


def test_a_calibration_split_is_what_the_fit_reads_and_frees_the_validation_split(
        setup: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """With data.calib_split the temperature and the thresholds are fitted on the calibration split, and nothing
    else (the validation and test passes are wrapped to fail while fitting): T equals fit_temperature on that
    split's logits computed by hand. The validation split, which best.pt was chosen on and the fit no longer reads,
    may then be scored with calibration, clean and under the validation shift; without the split it may not."""
    cfg, model, tmp = setup
    options = EvalConfig(split="val", shift_split="val", corruptions=["saturate"], severities=[3],
                         calibration="temperature", conformal=[0.2], sub_ensembles=False)
    with pytest.raises(ValueError, match=r"cannot be scored on the split they are fitted on"):
        run.check_options(cfg, model, options)
    calib_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"calib_split": 10})})
    run.check_options(calib_cfg, model, options)

    bundle = build_datasets(calib_cfg.data, calib_cfg.data_root())
    logits, target = collect_logits(model, DataLoader(bundle.calib, batch_size=4), torch.device("cpu"), "by hand")
    real_build, real_fit = loaders.build_data, run.fit_posthoc_on
    fitting: list[bool] = []

    def build(*args: object, **kwargs: object) -> loaders.Data:
        data = real_build(*args, **kwargs)

        def guarded(read: Callable[[], object], name: str) -> Callable[[], object]:
            def one_pass() -> object:
                if fitting:
                    raise AssertionError(f"the {name} split was read while fitting on the calibration split")
                return read()
            return one_pass

        return dataclasses.replace(data, val=guarded(data.val, "val"), test=guarded(data.test, "test"))

    fit = _flagged(real_fit, fitting)

    monkeypatch.setattr(loaders, "build_data", build)
    monkeypatch.setattr(run, "fit_posthoc_on", fit)
    raw = run.run_eval(calib_cfg, model, options=options, out_dir=tmp / "calib")["weights"]["raw"]
    cal, (conf,) = raw["calibration"], raw["conformal"]
    assert cal["fitted_on"] == "calib" == conf["calibrated_on"] and cal["num_fit"] == 10 == conf["num_calibration"]
    assert cal["temperature"] == pytest.approx(fit_temperature(logits, target), rel=1e-6)
    assert cal["metrics"]["num_samples"] == 16 == raw["metrics"]["num_samples"]  # scored: the validation split
    assert set(cal["shift"]) == {"saturate", "mean"} and set(conf["methods"]["thr"]["shift"]) == {"saturate", "mean"}
    md = (tmp / "calib" / "eval.md").read_text()
    assert "fitted on 10 calibration samples" in md and "calibrated on 10 calibration samples" in md
    # without a calibration split the same fit reads the validation split (as before), and says so
    monkeypatch.undo()
    plain = run.run_eval(cfg, model, options=options.model_copy(update={"split": "test", "shift_split": "test",
                                                                       "corruptions": []}),
                         out_dir=tmp / "plain")["weights"]["raw"]
    assert plain["calibration"]["fitted_on"] == "val" and plain["calibration"]["num_fit"] == 16


def test_the_calibration_split_cannot_be_set_or_moved_at_eval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import sigmanens_dist.models as models

    run_dir = shutil.copytree(FIXTURE, tmp_path / "run")  # trained with data.calib_split absent, so 0
    monkeypatch.setattr(models, "_rebuilt", lambda *a, **k: pytest.fail("the model was built"))
    assert eval_main(["--checkpoint", str(run_dir), "--data", "calib_split=5", "--calibration", "temperature",
                      "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sigmanens eval: error: --data calib_split=5: the calibration split "
                                               "is carved from the training pool when the run trains")
    assert not (tmp_path / "e" / "eval.json").exists()

    def check(given: list[str], trained: list[str]) -> None:
        """``given`` (--data texts) on a run trained with ``trained``."""
        before = load_config(None, trained, check_data=False)
        after = load_config(None, [*trained, *(kv if kv.startswith("data.") else f"data.{kv}" for kv in given)],
                            check_data=False)
        _check_split_overrides(given, before, after)

    check(["val_split=8"], [])  # no calibration split: nothing moves
    check(["calib_split=0"], [])  # the run's own value: nothing changes
    check(["calib_split=10", "data.split_seed=0", "train_subset=null"], ["data.calib_split=10"])
    with pytest.raises(UsageError, match=r"--data data.split_seed=3: .*\(this run: data.calib_split=10, "
                                         r"data.split_seed=0\); data.split_seed cannot change at eval"):
        check(["data.split_seed=3"], ["data.calib_split=10"])
    with pytest.raises(UsageError, match=r"--data calib_split=0: .* data.calib_split cannot change at eval"):
        check(["calib_split=0"], ["data.calib_split=10"])


@pytest.mark.parametrize("alpha", ["0", "1", "-0.1", "1.5", "abc", "nan", "0.1,", "0.1,2"])
def test_bad_alpha_is_one_error_before_any_work(alpha: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                               ) -> None:
    # the checkpoint does not exist either: α is checked first, before anything is read
    assert eval_main(["--checkpoint", str(tmp_path / "none.pt"), "--conformal", alpha]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sigmanens eval: error: --conformal {alpha!r}: give the miscoverage α as a number strictly "
                   "between 0 and 1 (e.g. 0.1), or several separated by commas (0.1,0.05)"]


def test_eval_config_checks_alpha_and_calibration() -> None:
    with pytest.raises(ConfigError, match=r"eval.conformal"):
        load_config(None, ["eval.conformal=1"], check_data=False)
    with pytest.raises(ConfigError, match=r"eval.calibration"):
        load_config(None, ["eval.calibration=platt"], check_data=False)
    with pytest.raises(ConfigError, match=r"eval.conformal"):
        load_config(None, ["eval.conformal=[0.1,true]"], check_data=False)
    assert load_config(None, ["eval.conformal=0.05"], check_data=False).eval.conformal == [0.05]
    assert load_config(None, ["eval.conformal=[0.1,0.05]"], check_data=False).eval.conformal == [0.1, 0.05]
    assert load_config(None, ["eval.conformal=null"], check_data=False).eval.conformal == []


def test_an_alpha_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert eval_main(["--checkpoint", str(tmp_path / "none.pt"), "--conformal", "0.1,0.1"]) == 2
    assert capsys.readouterr().err.strip() == "sigmanens eval: error: --conformal '0.1,0.1': an α is given twice"


def _flagged(real_fit: Any, fitting: list[bool]) -> Any:
    """``real_fit`` that marks ``fitting`` while it runs: the guarded splits know when they are read by the fit."""
    def fit(*args: object, **kwargs: object) -> object:
        fitting.append(True)
        try:
            return real_fit(*args, **kwargs)
        finally:
            fitting.clear()
    return fit
