"""Temperature, conformal and post-hoc fits at their edges, each against a hand computation or a numpy reference:
per-member temperatures, under-confident members, exact-tie thresholds, the finite-sample rank, what ``fit_posthoc``
records (checks/mutation.py's survivors in evaluation/calibration.py, conformal.py and posthoc.py)."""

from __future__ import annotations

import copy
import math
import typing

import numpy as np
import pytest
import torch
from torch import nn

from sigmanens_dist.cli.options import parse_alphas
from sigmanens_dist.config import EvalConfig, choices
from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.posthoc import ConformalSets, PostHoc, fit_posthoc_on
from sigmanens_dist.inference.conformal import RAPS_K_REG, RAPS_LAMBDA, class_scores, conformal_quantile, fit_conformal
from sigmanens_dist.inference.posthoc import Calibration, PostHocFit, fit_posthoc
from sigmanens_dist.inference.scores import ensemble_log_probs
from sigmanens_dist.inference.temperature import ensemble_nll, fit_temperature, scale_logits


def _members(scale: float, seed: int = 0, n: int = 2000) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    true = 1.5 * torch.randn(2, n, 5, generator=g)
    target = torch.multinomial(true.softmax(-1).mean(0), 1, generator=g)[:, 0]
    return scale * true, target


def _mean_probs(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).mean(0)


# -- temperature -----------------------------------------------------------------------------------------------------
def test_ensemble_nll_defaults_to_the_raw_logits() -> None:
    logits, target = _members(2.0, n=30)
    p = _mean_probs(logits.double().numpy())
    want = -np.log(p[np.arange(30), target.numpy()]).mean()
    assert float(ensemble_nll(logits, target)) == pytest.approx(want, rel=1e-5)
    p3 = _mean_probs(logits.double().numpy() / 3)
    assert float(ensemble_nll(logits, target, 3.0)) == pytest.approx(-np.log(p3[np.arange(30), target.numpy()]).mean(),
                                                                      rel=1e-5)


def test_under_confident_members_get_a_temperature_below_one() -> None:
    logits, target = _members(0.2)  # five times too timid: T ≈ 0.2 sharpens them
    temperature = fit_temperature(logits, target)
    assert temperature == pytest.approx(0.2, rel=0.1)
    assert ensemble_nll(logits, target, temperature) < ensemble_nll(logits, target)


def test_max_iter_bounds_the_fit() -> None:
    logits, target = _members(3.0)
    converged, one_step = fit_temperature(logits, target), fit_temperature(logits, target, max_iter=1)
    assert converged == pytest.approx(3.0, rel=0.1)
    assert abs(one_step - converged) > 0.1  # one LBFGS iteration is not the optimum


def test_scale_logits_divides_each_member_by_its_own_temperature() -> None:
    logits = torch.randn(2, 3, 4, dtype=torch.float64)  # M = 2 members, K = 4 classes: no accidental broadcast
    for temperatures in ([1.1, 3.0], torch.tensor([1.1, 3.0], dtype=torch.float64), (1.1, 3.0)):
        got = scale_logits(logits, temperatures)
        assert torch.equal(got[0], logits[0] / 1.1) and torch.equal(got[1], logits[1] / 3.0)
    assert torch.equal(scale_logits(logits, 2.5), logits / 2.5)
    assert torch.equal(scale_logits(logits, torch.tensor(2.5, dtype=torch.float64)), logits / 2.5)


# -- conformal -------------------------------------------------------------------------------------------------------
def test_the_finite_sample_rank_at_an_exact_product() -> None:
    # n = 9, α = 0.1: (n+1)(1−α) = 9 exactly, so q̂ is the 9th smallest score, not +inf
    assert conformal_quantile(torch.arange(1.0, 10.0), 0.1) == 9.0
    assert conformal_quantile(torch.arange(1.0, 20.0), 0.5) == 10.0  # ⌈20 · 0.5⌉ = 10


def test_aps_and_raps_rank_tied_classes_in_class_order() -> None:
    probs = torch.full((2, 120), 1 / 120, dtype=torch.float64)  # 120 tied classes: a stable sort keeps 0, 1, 2, …
    rank = torch.arange(1, 121, dtype=torch.float64)
    torch.testing.assert_close(class_scores(probs, "aps"), (rank / 120).expand(2, -1))
    raps = rank / 120 + RAPS_LAMBDA * (rank - RAPS_K_REG).clamp_min(0)
    torch.testing.assert_close(class_scores(probs, "raps"), raps.expand(2, -1))


def test_class_scores_rank_over_the_last_dim_in_the_probs_dtype() -> None:
    """class_scores ranks each row's classes over the last dim, whatever leads it, and keeps float64 probabilities
    float64 (the raps penalty too), against a numpy hand computation."""
    g = torch.Generator().manual_seed(7)
    probs = torch.rand(2, 3, 9, generator=g, dtype=torch.float64)  # A = 2, B = 3, K = 9 > RAPS_K_REG: all differ
    probs = probs / probs.sum(-1, keepdim=True)
    p = probs.numpy().reshape(-1, 9)
    aps, raps = np.empty_like(p), np.empty_like(p)
    for i, row in enumerate(p):
        order = np.argsort(-row, kind="stable")
        mass = np.cumsum(row[order])
        aps[i, order] = mass
        raps[i, order] = mass + RAPS_LAMBDA * np.clip(np.arange(1, 10) - RAPS_K_REG, 0, None)
    for method, want in (("thr", 1 - p), ("aps", aps), ("raps", raps)):
        got = class_scores(probs, method)
        assert got.shape == (2, 3, 9) and got.dtype == torch.float64, method
        # float64 to the last bits: a float32 penalty (λ·rank rounded to float32) is ~1e-10 off
        np.testing.assert_allclose(got.numpy().reshape(-1, 9), want, rtol=0, atol=1e-13, err_msg=method)


def test_fit_conformal_by_hand() -> None:
    g = torch.Generator().manual_seed(4)
    logits, target = torch.randn(2, 9, 8, generator=g), torch.randint(0, 8, (9,), generator=g)
    p = _mean_probs(logits.double().numpy())
    y = target.numpy()
    rows = np.arange(9)
    order = np.argsort(-p, axis=-1, kind="stable")
    rank_of_y = np.array([int(np.where(order[i] == y[i])[0][0]) + 1 for i in rows])
    aps = np.array([np.sort(p[i])[::-1][: rank_of_y[i]].sum() for i in rows])
    want = {"thr": 1 - p[rows, y], "aps": aps,
            "raps": aps + RAPS_LAMBDA * np.clip(rank_of_y - RAPS_K_REG, 0, None)}
    # α = 0.2: ⌈10 · 0.8⌉ = 8th smallest of the 9 true-class scores; α = 0.5: the 5th
    got = fit_conformal(logits, target, [0.2, 0.5])
    for j, k in enumerate((8, 5)):
        for method, scores in want.items():
            assert got[j][method] == pytest.approx(np.sort(scores)[k - 1], rel=1e-5), (method, k)
    p2 = _mean_probs(logits.double().numpy() / 2)  # a temperature divides the member logits first
    assert fit_conformal(logits, target, [0.2], 2.0)[0]["thr"] == pytest.approx(np.sort(1 - p2[rows, y])[7], rel=1e-5)


def test_a_class_whose_score_equals_the_threshold_is_in_the_set() -> None:
    g = torch.Generator().manual_seed(6)
    logits, target = torch.randn(2, 5, 4, generator=g), torch.randint(0, 4, (5,), generator=g)
    probs = ensemble_log_probs(scale_logits(logits, 1.0)).exp()
    q = float(class_scores(probs, "thr")[0, target[0]])  # sample 0's own score, bit for bit
    sets = ConformalSets({"thr": q}, 4)
    sets.update(logits, target)
    assert sets.covered[0][0, 0] == 1.0


def test_per_class_set_sizes_and_an_empty_class() -> None:
    sets = ConformalSets({"thr": 0.75}, 3)  # classes of probability ≥ 0.25
    probs = torch.tensor([[[0.5, 0.3, 0.2], [0.4, 0.35, 0.25 + 1e-6], [0.9, 0.05, 0.05]]])
    sets.update(probs.log(), torch.tensor([0, 0, 1]))
    by_class = {c["class"]: c for c in sets.compute()["thr"]["per_class"]}
    assert by_class[0]["n"] == 2 and by_class[0]["set_size"] == pytest.approx((2 + 3) / 2)
    assert by_class[1]["set_size"] == pytest.approx(1.0) and by_class[1]["coverage"] == 0.0
    assert set(by_class[2]) == {"class", "n", "coverage", "set_size"} and math.isnan(by_class[2]["set_size"])


def test_parse_alphas_single() -> None:
    assert parse_alphas("0.1", single=True) == [0.1]
    assert parse_alphas("0.1,0.05") == [0.1, 0.05]
    with pytest.raises(UsageError) as caught:
        parse_alphas("0.1,0.05", single=True)
    assert str(caught.value) == "--conformal '0.1,0.05': give one miscoverage α in (0, 1), e.g. 0.1"
    with pytest.raises(UsageError, match="strictly between 0 and 1"):
        parse_alphas("0.1,2")


# -- fit_posthoc and PostHoc -----------------------------------------------------------------------------------------
def test_fit_posthoc_records_what_it_fitted() -> None:
    logits, target = _members(3.0, n=600)
    fit = fit_posthoc(logits, target, "temperature", [0.1])
    post = PostHoc.of(fit)
    t = fit_temperature(logits, target)
    assert fit.temperature == t and fit.calibrate and fit.member_temperatures is None
    assert (fit.fitted_on, fit.num_fit, fit.alphas) == ("val", 600, (0.1,))
    assert fit.nll_before == pytest.approx(float(ensemble_nll(logits, target)))
    assert fit.nll_after == pytest.approx(float(ensemble_nll(logits, target, t))) and fit.member_nll_after is None
    part = post.parts["calibration"]
    assert part["method"] == "temperature" and part["fitted_on"] == "val" and part["num_fit"] == 600
    assert part["val_nll_before"] == pytest.approx(float(ensemble_nll(logits, target)))
    assert part["val_nll_after"] == pytest.approx(float(ensemble_nll(logits, target, t)))
    assert list(fit.thresholds) == fit_conformal(logits, target, [0.1], t)
    (entry,) = post.parts["conformal"]
    assert entry["temperature"] == t and entry["calibrated_on"] == "val"
    assert entry["methods"]["thr"]["qhat"] == fit.thresholds[0]["thr"]


def test_fit_posthoc_member_temperatures() -> None:
    logits, target = _members(3.0, n=600)
    fit = fit_posthoc(logits, target, "member-temperature", [0.1], split="calib")
    post = PostHoc.of(fit)
    part = post.parts["member_calibration"]
    members = list(fit.member_temperatures)
    assert part["method"] == "member-temperature" and part["fitted_on"] == "calib"
    assert part["temperatures"] == members and fit.applied == members
    assert part["val_nll_after"] == pytest.approx(float(ensemble_nll(logits, target, members)))
    assert fit.member_nll_after == part["val_nll_after"]
    assert list(fit.thresholds) == fit_conformal(logits, target, [0.1], members)
    assert post.parts["conformal"][0]["temperature"] == members


def test_without_calibration_nothing_is_fitted_but_the_sets() -> None:
    logits, target = _members(3.0, n=600)
    post = PostHoc.of(fit_posthoc(logits, target, "none", [0.1]))
    assert post.fit.temperature == 1.0 and not post.fit.calibrate and "calibration" not in post.parts
    assert post.fit.nll_after is None
    assert post.parts["conformal"][0]["temperature"] is None
    assert list(post.fit.thresholds) == fit_conformal(logits, target, [0.1])
    bare = PostHoc.of(fit_posthoc(logits, target, "none", []))
    assert bare.fit.thresholds == () and bare.parts == {}
    assert bare.metrics(5, 2, sync=False) == {}
    bare.finish_shift([1, 3])  # nothing to average


class _Fixed(nn.Module):
    num_members = 2

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[:, x.long()]


def test_fit_posthoc_on_reads_one_pass() -> None:
    logits, target = _members(3.0, n=200)
    batches = [(torch.arange(i, i + 50), target[i: i + 50]) for i in range(0, 200, 50)]
    post = fit_posthoc_on(_Fixed(logits), lambda: iter(batches), EvalConfig(calibration="temperature"),
                          torch.device("cpu"), "test")
    assert post.parts["calibration"]["fitted_on"] == "val"
    assert post.fit.temperature == pytest.approx(fit_temperature(logits, target), rel=1e-6)


def test_post_hoc_metrics_use_the_applied_temperature_and_record_severity_zero() -> None:
    fit = PostHocFit(calibration="temperature", temperature=2.0, member_temperatures=None, alphas=(0.1,),
                     thresholds=({"thr": 0.5},), fitted_on="val", num_fit=6, nll_before=1.0, nll_after=0.9,
                     member_nll_after=None)
    post = PostHoc(fit, {"calibration": {"shift": {}}, "conformal": [{"methods": {"thr": {"shift": {}}}}]})
    metrics = post.metrics(4, 2, sync=False)
    assert metrics["calibration"].temperature == 2.0 and metrics["conformal/0"].temperature == 2.0
    logits, target = torch.randn(2, 6, 4), torch.randint(0, 4, (6,))
    for metric in metrics.values():
        metric.update(logits, target)
    post.record(metrics, "fog")
    assert set(post.parts["calibration"]["shift"]["fog"]) == {"0"}
    assert set(post.parts["conformal"][0]["methods"]["thr"]["shift"]["fog"]) == {"0"}


def test_the_fit_knows_every_calibration_the_config_offers() -> None:
    """``inference.posthoc.Calibration`` (torch only, so not the config's) names what ``--calibration`` offers."""
    assert typing.get_args(Calibration) == choices(EvalConfig, "calibration")


def test_record_stream_puts_each_metric_of_a_mixed_stream_into_its_part() -> None:
    """record_stream: every part's ``stream[which]`` holds its metrics' own values, the shift keys of a calibration
    and coverage and set size of every conformal method at every α; nothing else of the part changes."""
    logits, target = _members(2.0, n=300)
    post = PostHoc.of(fit_posthoc(logits[:, :200], target[:200], "member-temperature", [0.1, 0.3]))
    before = copy.deepcopy(post.parts)
    computed = {}
    for which, rows in (("overall", slice(200, 300)), ("clean", slice(200, 250))):
        metrics = post.metrics(5, 2, sync=False)
        assert set(metrics) == {"calibration", "member_calibration", "conformal/0", "conformal/1"}
        for metric in metrics.values():
            metric.update(logits[:, rows], target[rows])
        post.record_stream(metrics, which)
        computed[which] = {name: metric.compute() for name, metric in metrics.items()}
    for name in ("calibration", "member_calibration"):
        part = post.parts[name]
        assert {k: v for k, v in part.items() if k != "stream"} == before[name]
        assert part["stream"] == {which: {k: computed[which][name][k] for k in ("acc", "nll", "ece")}
                                  for which in ("overall", "clean")}
    assert computed["overall"]["calibration"] != computed["overall"]["member_calibration"]
    for j, entry in enumerate(post.parts["conformal"]):
        for method, result in entry["methods"].items():
            assert {k: v for k, v in result.items() if k != "stream"} == before["conformal"][j]["methods"][method]
            assert result["stream"] == {which: {k: computed[which][f"conformal/{j}"][method][k]
                                                for k in ("coverage", "set_size")} for which in ("overall", "clean")}
    sizes = [entry["methods"]["aps"]["stream"]["overall"]["set_size"] for entry in post.parts["conformal"]]
    assert sizes[0] > sizes[1]  # α = 0.1 asks for larger sets than α = 0.3: the entries are not interchangeable


@pytest.mark.parametrize("sync", [False, True])
def test_post_hoc_metrics_pass_the_sync_flag_to_every_metric(sync: bool) -> None:
    """PostHoc.metrics: every metric syncs on compute across ranks exactly when asked (torchmetrics' default: it
    does), the calibrations' and every α's sets alike."""
    logits, target = _members(2.0, n=100)
    metrics = PostHoc.of(fit_posthoc(logits, target, "member-temperature", [0.1, 0.3])).metrics(5, 2, sync=sync)
    assert set(metrics) == {"calibration", "member_calibration", "conformal/0", "conformal/1"}
    assert {name: metric.sync_on_compute for name, metric in metrics.items()} == dict.fromkeys(metrics, sync)


def test_a_fit_whose_thresholds_do_not_match_its_alphas_is_refused() -> None:
    """PostHoc.of pairs each α with its thresholds: a fit holding fewer threshold sets than α's is an error, not a
    report that silently drops an α."""
    fit = PostHocFit(calibration="none", temperature=1.0, member_temperatures=None, alphas=(0.1, 0.2),
                     thresholds=({"thr": 0.5},), fitted_on="val", num_fit=6, nll_before=1.0, nll_after=None,
                     member_nll_after=None)
    with pytest.raises(ValueError, match="zip"):
        PostHoc.of(fit)
