"""Every number ``SampleMetrics`` reports, and the whole-set metrics and OOD scores behind them, against a reference
written out in numpy from the definitions (checks/mutation.py's survivors in evaluation/metrics.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from sigmanens_dist.evaluation.metrics import (
    EnsembleMetrics,
    SampleMetrics,
    adaptive_calibration_error,
    aurc,
    calibration_error,
    diagnosis,
    ood_detection,
)
from sigmanens_dist.inference.scores import disagreement, mutual_information


def _case(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, k, (n,), generator=g)
    logits = 1.5 * torch.randn(m, n, k, generator=g, dtype=torch.float64)
    logits[:, torch.arange(n), target] += 1.0
    return logits.float(), target


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(p)).sum(-1)


def _ece(conf: np.ndarray, correct: np.ndarray, n_bins: int) -> float:
    """Equal-width bins [b/n, (b+1)/n) as torchmetrics draws them, Σ_b |B_b|/N · |acc_b − conf_b|."""
    bins = np.clip(np.floor(conf * n_bins).astype(int), 0, n_bins - 1)
    return sum(abs(correct[bins == b].sum() - conf[bins == b].sum()) for b in range(n_bins)) / len(conf)


def _aece(conf: np.ndarray, correct: np.ndarray, n_bins: int) -> float:
    """Equal-mass bins: sorted by confidence, n_bins groups whose sizes differ by at most one (larger first)."""
    order = np.argsort(conf, kind="stable")
    total = sum(abs(c.sum() - a.sum()) for c, a in zip(np.array_split(conf[order], n_bins),
                                                      np.array_split(correct[order], n_bins), strict=True))
    return total / len(conf)


def _aurc(conf: np.ndarray, correct: np.ndarray) -> float:
    order = np.argsort(-conf, kind="stable")
    errors = 1 - correct[order].astype(np.float64)
    return float(np.mean([errors[: i + 1].mean() for i in range(len(errors))]))


def _reference(logits: torch.Tensor, target: torch.Tensor, n_bins: int) -> dict[str, float]:
    z, y = logits.double().numpy(), target.numpy()
    members = _softmax(z)  # (M, N, K)
    mean = members.mean(0)
    out: dict[str, float] = {}
    for prefix, p in [("", mean), *((f"member{i}/", members[i]) for i in range(len(members)))]:
        conf, correct = p.max(-1), (p.argmax(-1) == y).astype(float)
        onehot = np.eye(p.shape[-1])[y]
        out |= {f"{prefix}acc": correct.mean(), f"{prefix}nll": -np.log(p[np.arange(len(y)), y]).mean(),
                f"{prefix}ece": _ece(conf, correct, n_bins), f"{prefix}aece": _aece(conf, correct, n_bins),
                f"{prefix}brier": ((p - onehot) ** 2).sum(-1).mean(), f"{prefix}aurc": _aurc(conf, correct)}
    m = len(members)
    preds = members.argmax(-1)  # (M, N)
    pairs = [(a, b) for a in range(m) for b in range(a + 1, m)]
    out["disagreement"] = float(np.mean([np.mean([preds[a, j] != preds[b, j] for a, b in pairs])
                                         for j in range(len(y))])) if pairs else 0.0
    out["entropy"] = _entropy(mean).mean()
    out["mutual_information"] = (_entropy(mean) - _entropy(members).mean(0)).clip(min=0).mean()
    out["num_samples"] = float(len(y))
    return out


@pytest.mark.parametrize(("m", "n", "k", "n_bins"), [(3, 40, 4, 15), (3, 40, 4, 6), (1, 33, 3, 15), (2, 7, 5, 4)])
def test_sample_metrics_equal_the_numpy_reference(m: int, n: int, k: int, n_bins: int) -> None:
    logits, target = _case(m, n, k, seed=m * 100 + n)
    metrics = SampleMetrics(k, m) if n_bins == 15 else SampleMetrics(k, m, n_bins=n_bins)  # 15: the default
    metrics.update(logits[:, : n // 2], target[: n // 2])
    metrics.update(logits[:, n // 2 :], target[n // 2 :])
    got, want = metrics.compute(), _reference(logits, target, n_bins)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for key in ("acc", "nll", "ece", "aece", "brier", "aurc"):
        assert got[f"member_mean/{key}"] == pytest.approx(np.mean([want[f"member{i}/{key}"] for i in range(m)]),
                                                          rel=1e-4, abs=1e-6)
    if m == 1:
        assert got["disagreement"] == 0.0


def test_the_whole_set_metrics_default_to_15_bins_and_take_others() -> None:
    g = torch.Generator().manual_seed(5)
    conf = torch.rand(50, generator=g, dtype=torch.float64) * 0.7 + 0.3
    correct = (torch.rand(50, generator=g) < conf).float()
    c, a = conf.numpy(), correct.numpy()
    assert calibration_error(conf, correct) == pytest.approx(_ece(c, a, 15), rel=1e-5)
    assert calibration_error(conf, correct, n_bins=4) == pytest.approx(_ece(c, a, 4), rel=1e-5)
    assert adaptive_calibration_error(conf, correct) == pytest.approx(_aece(c, a, 15), rel=1e-9)
    assert adaptive_calibration_error(conf, correct, n_bins=4) == pytest.approx(_aece(c, a, 4), rel=1e-9)
    assert aurc(conf, correct) == pytest.approx(_aurc(c, a), rel=1e-9)


def test_ties_keep_dataset_order_in_aece_and_aurc() -> None:
    # four samples of one confidence, right then wrong: the order they are given in decides which bin and rank
    conf = torch.tensor([0.9, 0.6, 0.6, 0.6, 0.6, 0.2], dtype=torch.float64)
    correct = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    # thirds (0.2, 0.6 | 0.6, 0.6 | 0.6, 0.9) with their correctness (0, 1 | 1, 0 | 0, 1)
    assert adaptive_calibration_error(conf, correct, n_bins=3) == pytest.approx(
        (abs(1 - 0.8) + abs(1 - 1.2) + abs(1 - 1.5)) / 6)
    # most confident first, ties in dataset order: errors 0, 0, 0, 1, 1, 1
    assert aurc(conf, correct) == pytest.approx((0 + 0 + 0 + 1 / 4 + 2 / 5 + 3 / 6) / 6)
    # 300 samples on 3 confidence levels (a sort of this size reorders ties unless asked to be stable)
    g = torch.Generator().manual_seed(8)
    conf = torch.tensor([0.3, 0.6, 0.9], dtype=torch.float64)[torch.randint(0, 3, (300,), generator=g)]
    correct = (torch.rand(300, generator=g) < 0.5).float()
    c, a = conf.numpy(), correct.numpy()
    assert adaptive_calibration_error(conf, correct, n_bins=7) == pytest.approx(_aece(c, a, 7), rel=1e-9)
    assert aurc(conf, correct) == pytest.approx(_aurc(c, a), rel=1e-9)


def test_mutual_information_averages_the_members_entropies() -> None:
    logits, _ = _case(3, 5, 4, seed=11)  # M ≠ B: the mean is over members, per sample
    members = _softmax(logits.double().numpy())
    want = (_entropy(members.mean(0)) - _entropy(members).mean(0)).clip(min=0)
    np.testing.assert_allclose(mutual_information(logits).numpy(), want, rtol=1e-4, atol=1e-6)


def test_ensemble_metrics_ece_takes_its_bins() -> None:
    logits, target = _case(2, 30, 3, seed=3)
    metrics = EnsembleMetrics(3, 2, n_bins=4)
    metrics.update(logits, target)
    got = metrics.compute()
    mean = _softmax(logits.double().numpy()).mean(0)
    conf, correct = mean.max(-1), (mean.argmax(-1) == target.numpy()).astype(float)
    assert got["ece"] == pytest.approx(_ece(conf, correct, 4), rel=1e-4)
    one = EnsembleMetrics(3, 2, n_bins=1)  # one bin is a valid choice: |mean accuracy − mean confidence|
    one.update(logits, target)
    assert one.compute()["ece"] == pytest.approx(abs(correct.mean() - conf.mean()), rel=1e-4)


def test_sample_metrics_refuse_a_wrong_number_of_classes_or_targets() -> None:
    metrics = SampleMetrics(4, 2)
    logits, target = _case(2, 6, 4, seed=0)
    with pytest.raises(ValueError, match="expected member_logits"):
        metrics.update(logits[..., :3], target)  # K = 3, the members right
    with pytest.raises(ValueError, match="expected member_logits"):
        metrics.update(logits, target[:5])  # B targets wrong
    with pytest.raises(ValueError, match="expected member_logits"):
        metrics.update(logits[:1], target)  # M wrong


def test_scores_are_the_per_sample_values() -> None:
    logits, target = _case(3, 12, 4, seed=2)
    metrics = SampleMetrics(4, 3)
    metrics.update(logits[:, :5], target[:5])
    metrics.update(logits[:, 5:], target[5:])
    scores = metrics.scores()
    members = _softmax(logits.double().numpy())
    mean = members.mean(0)
    assert set(scores) == {"msp", "entropy", "mutual_information", "confidence", "correct"}
    np.testing.assert_allclose(scores["msp"].numpy(), -mean.max(-1), rtol=1e-5)
    np.testing.assert_allclose(scores["confidence"].numpy(), mean.max(-1), rtol=1e-5)
    np.testing.assert_array_equal(scores["correct"].numpy(), (mean.argmax(-1) == target.numpy()).astype(np.float32))
    np.testing.assert_allclose(scores["entropy"].numpy(), _entropy(mean), rtol=1e-4)
    np.testing.assert_allclose(scores["mutual_information"].numpy(),
                               (_entropy(mean) - _entropy(members).mean(0)).clip(min=0), rtol=1e-4, atol=1e-6)


def test_ood_detection_by_hand() -> None:
    score_in = torch.tensor([0.1, 0.4, 0.35, 0.8])
    score_out = torch.tensor([0.9, 0.3, 0.5])
    got = ood_detection(score_in, score_out)
    # pairs (out > in): 0.9 beats all 4, 0.3 beats 0.1 only, 0.5 beats 0.1, 0.4, 0.35: 8 of 12
    assert got["auroc"] == pytest.approx(8 / 12)
    # OOD positive, ranked 0.9+, 0.8-, 0.5+, 0.4-, 0.35-, 0.3+, 0.1-: precision at each positive 1, 2/3, 3/6
    assert got["aupr_out"] == pytest.approx((1 + 2 / 3 + 3 / 6) / 3)
    # in-distribution positive on the negated score, ranked 0.1+, 0.3-, 0.35+, 0.4+, 0.5-, 0.8+, 0.9-
    assert got["aupr_in"] == pytest.approx((1 + 2 / 3 + 3 / 4 + 4 / 6) / 4)
    # 95 % of the OOD samples (all 3) are detected first at threshold 0.3: in-distribution above it 0.4, 0.35, 0.8
    assert got["fpr95"] == pytest.approx(3 / 4)
    for empty in ((torch.tensor([]), score_out), (score_in, torch.tensor([]))):
        with pytest.raises(ValueError, match="samples on both sides"):
            ood_detection(*empty)


def test_diagnosis_needs_both_passes_for_its_auroc() -> None:
    values = {"member_mean/nll": 1.0, "member_mean/ece": 0.1, "disagreement": 0.2, "mutual_information": 0.3}
    assert "mi_auroc" not in diagnosis(values, 2, clean_mi=torch.tensor([0.1, 0.2]))
    assert "mi_auroc" not in diagnosis(values, 2, shifted_mi=torch.tensor([0.1, 0.2]))
    assert math.isclose(diagnosis(values, 2, torch.tensor([0.1]), torch.tensor([0.2]))["mi_auroc"], 1.0)


def test_fpr95_takes_the_first_threshold_detecting_exactly_95_percent() -> None:
    score_out = torch.cat([torch.arange(2.0, 21.0), torch.tensor([0.0])])  # 19 of 20 OOD above 1, one at 0
    score_in = torch.tensor([0.5, 0.1, 1.5])
    # at threshold 2, 19/20 = 95 % detected and no in-distribution sample is above: FPR 0 (not the 100 % that
    # detecting all 20 would cost)
    assert ood_detection(score_in, score_out)["fpr95"] == 0.0


@pytest.mark.parametrize("m", [1, 2, 4])
def test_disagreement_is_the_share_of_member_pairs_that_differ(m: int) -> None:
    """disagreement: per sample, the share of the M(M−1)/2 member pairs whose top-1 classes differ (0 with one)."""
    g = torch.Generator().manual_seed(m)
    logits = torch.randn(m, 7, 5, generator=g)  # M, B = 7, K = 5 all different: no axis stands in for another
    preds = logits.argmax(-1).tolist()
    pairs = list(itertools.combinations(range(m), 2))
    want = [sum(preds[i][b] != preds[j][b] for i, j in pairs) / len(pairs) if pairs else 0.0 for b in range(7)]
    got = disagreement(logits)
    assert got.shape == (7,) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=0)
    assert (float(got.max()) > 0.0) == (m > 1)  # the random members do disagree somewhere


def test_disagreement_of_chosen_top_classes() -> None:
    """disagreement on members whose top-1 classes are set by hand: all agree, one pair of three, a lone pair."""
    def of(top: list[list[int]], k: int) -> torch.Tensor:  # (M, B) top-1 classes as (M, B, K) logits
        return disagreement(5.0 * torch.nn.functional.one_hot(torch.tensor(top), k).float())

    # three members, two samples: all agree on sample 0; on sample 1 members 0 and 2 agree: 2 of 3 pairs differ
    assert of([[0, 1], [0, 2], [0, 1]], 4).tolist() == pytest.approx([0.0, 2 / 3])
    assert of([[0, 1, 2], [0, 3, 2]], 4).tolist() == [0.0, 1.0, 0.0]  # two members: one pair, 0 or 1
    assert of([[3, 1, 0]], 4).tolist() == [0.0, 0.0, 0.0]  # one member: no pair to disagree
    assert of([[0, 1, 2, 3]] * 3 + [[1, 2, 3, 0]], 4).tolist() == pytest.approx([0.5] * 4)  # 3 of 6 pairs
