"""Ensemble metrics against hand-computed values, batching invariance, distributed sync, reliability diagrams."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sigmanens_dist.evaluation.metrics import (
    DIAGNOSIS_KEYS,
    EnsembleMetrics,
    SampleMetrics,
    detection_auroc,
    diagnosis,
)
from sigmanens_dist.evaluation.plots import reliability_diagram, reliability_diagrams
from sigmanens_dist.evaluation.report import shift_mean

# Two members, three classes, two samples; logits = log-probabilities, so member softmaxes are exactly these.
MEMBER_PROBS = torch.tensor([
    [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]],
    [[0.5, 0.4, 0.1], [0.2, 0.2, 0.6]],
])
TARGET = torch.tensor([0, 1])
# Mean probabilities: sample 0 → (0.6, 0.3, 0.1), right (class 0); sample 1 → (0.15, 0.4, 0.45), wrong (class 2).


def _metrics(logits: torch.Tensor, target: torch.Tensor, n_bins: int = 15) -> dict[str, float]:
    metrics = EnsembleMetrics(logits.shape[-1], logits.shape[0], n_bins=n_bins)
    metrics.update(logits, target)
    return metrics.compute()


def _random_case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, k, (n,), generator=g)
    logits = 2 * torch.randn(m, n, k, generator=g)
    logits[:, torch.arange(n), target] += 1.5
    return logits, target


def test_hand_computed_two_members() -> None:
    out = _metrics(MEMBER_PROBS.log(), TARGET)
    assert out["acc"] == pytest.approx(0.5)
    assert out["nll"] == pytest.approx(-(math.log(0.6) + math.log(0.4)) / 2)
    assert out["brier"] == pytest.approx((0.26 + 0.585) / 2)  # (.4² + .3² + .1²) and (.15² + .6² + .45²)
    assert out["ece"] == pytest.approx((abs(1 - 0.6) + abs(0 - 0.45)) / 2)  # each sample alone in its bin
    assert out["disagreement"] == pytest.approx(0.5)  # member argmaxes (0, 1) vs (0, 2)
    entropy = [-sum(p * math.log(p) for p in row) for row in ([0.6, 0.3, 0.1], [0.15, 0.4, 0.45])]
    assert out["entropy"] == pytest.approx(sum(entropy) / 2)
    assert out["member0/acc"] == pytest.approx(1.0)
    assert out["member1/acc"] == pytest.approx(0.5)
    assert out["member0/nll"] == pytest.approx(-(math.log(0.7) + math.log(0.6)) / 2)
    assert out["member1/nll"] == pytest.approx(-(math.log(0.5) + math.log(0.2)) / 2)
    assert out["member0/ece"] == pytest.approx((0.3 + 0.4) / 2)
    assert out["member1/ece"] == pytest.approx((0.5 + 0.6) / 2)
    assert out["member_mean/acc"] == pytest.approx(0.75)
    assert out["member_mean/nll"] == pytest.approx(-(math.log(0.7 * 0.6 * 0.5 * 0.2)) / 4)
    assert out["member_mean/ece"] == pytest.approx((0.35 + 0.55) / 2)


def test_nll_is_of_the_mean_probability_and_stable() -> None:
    # Huge logits: a naive log(mean(softmax)) would give -log(0) = inf for member 1's confident miss.
    logits = torch.tensor([[[1000.0, 0.0]], [[0.0, 1000.0]]])  # (M=2, B=1, K=2)
    out = _metrics(logits, torch.tensor([0]))
    assert out["nll"] == pytest.approx(math.log(2))
    assert out["member1/nll"] == pytest.approx(1000.0)


def test_disagreement_three_members() -> None:
    preds = torch.tensor([[0, 1, 2, 0], [0, 1, 1, 0], [1, 1, 2, 0]])  # (M=3, B=4)
    logits = 5 * torch.nn.functional.one_hot(preds, 3).float()
    out = _metrics(logits, torch.zeros(4, dtype=torch.long))
    # pairs (0,1): 1/4 differ, (0,2): 1/4, (1,2): 2/4 → mean 1/3
    assert out["disagreement"] == pytest.approx(1 / 3)


def test_single_member() -> None:
    logits, target = _random_case(1, 50, 4)
    out = _metrics(logits, target)
    assert out["disagreement"] == 0.0
    for key in ("acc", "nll", "ece"):
        assert out[key] == pytest.approx(out[f"member0/{key}"], rel=1e-6)
        assert out[f"member_mean/{key}"] == out[f"member0/{key}"]
    assert out["acc"] == pytest.approx((logits[0].argmax(-1) == target).float().mean().item())
    assert out["nll"] == pytest.approx(torch.nn.functional.cross_entropy(logits[0], target).item(), rel=1e-6)


def test_perfect_confident_predictions() -> None:
    target = torch.tensor([0, 3, 1, 2, 2, 0])
    logits = 50 * torch.nn.functional.one_hot(target, 4).float().expand(3, -1, -1)
    out = _metrics(logits, target)
    assert out["acc"] == 1.0
    assert out["ece"] == pytest.approx(0.0, abs=1e-6)
    assert out["nll"] == pytest.approx(0.0, abs=1e-6)
    assert out["brier"] == pytest.approx(0.0, abs=1e-6)
    assert out["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert out["disagreement"] == 0.0


def test_batch_split_invariance() -> None:
    logits, target = _random_case(3, 257, 5)
    whole = _metrics(logits, target)
    split = EnsembleMetrics(5, 3)
    for lo, hi in ((0, 1), (1, 100), (100, 101), (101, 257)):
        split.update(logits[:, lo:hi], target[lo:hi])
    parts = split.compute()
    assert parts.keys() == whole.keys()
    assert whole["acc"] != pytest.approx(1.0)  # a non-trivial case
    for key in whole:
        if key.endswith(("acc", "ece")) or key == "disagreement":
            assert parts[key] == whole[key], key  # counts and per-sample lists: bit for bit
        else:
            assert parts[key] == pytest.approx(whole[key], rel=1e-12, abs=0), key  # float64 sums, other order


def test_reset_forgets_everything() -> None:
    logits, target = _random_case(2, 40, 3)
    metrics = EnsembleMetrics(3, 2)
    metrics.update(*_random_case(2, 30, 3, seed=1))
    metrics.reset()
    metrics.update(logits, target)
    assert metrics.compute() == _metrics(logits, target)


@pytest.mark.filterwarnings("ignore:The ``compute`` method of metric SumMetric was called before")
def test_compute_before_update() -> None:
    with pytest.raises(RuntimeError, match="before any update"):
        EnsembleMetrics(3, 2).compute()


@pytest.mark.parametrize(("shape", "target", "match"), [
    ((4, 3), torch.tensor([0, 1, 2, 0]), r"member_logits must have shape \(M=2, B, K=3\), got \(4, 3\)"),
    ((3, 4, 3), torch.tensor([0, 1, 2, 0]), r"member_logits must have shape \(M=2, B, K=3\), got \(3, 4, 3\)"),
    ((2, 4, 5), torch.tensor([0, 1, 2, 0]), r"member_logits must have shape \(M=2, B, K=3\), got \(2, 4, 5\)"),
    ((2, 4, 3), torch.tensor([0, 1, 2]), r"target must have shape \(B=4,\).*got \(3,\)"),
    ((2, 4, 3), torch.tensor([0, 1, 3, 0]), r"target values must lie in 0\.\.2, got min 0, max 3"),
    ((2, 4, 3), torch.tensor([0, -1, 2, 0]), r"target values must lie in 0\.\.2, got min -1, max 2"),
    ((2, 4, 3), torch.tensor([0.0, 1.0, 2.0, 0.0]), r"target must hold integer class indices, got dtype torch\.float"),
])
def test_bad_inputs(shape: tuple[int, ...], target: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EnsembleMetrics(3, 2).update(torch.zeros(shape), target)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_classes": 1, "num_members": 2}, "num_classes=1 must be at least 2"),
    ({"num_classes": 3, "num_members": 0}, "num_members=0 must be at least 1"),
    ({"num_classes": 3, "num_members": 2, "n_bins": 0}, "n_bins=0 must be at least 1"),
])
def test_bad_construction(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EnsembleMetrics(**kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranked_compute(rank: int, world: int, port: int, logits: torch.Tensor, target: torch.Tensor,
                    out: dict[int, dict[str, float]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        metrics = EnsembleMetrics(logits.shape[-1], logits.shape[0])
        shard = torch.arange(logits.shape[1]).chunk(world)[rank]
        for batch in shard.split(16):
            metrics.update(logits[:, batch], target[batch])
        out[rank] = metrics.compute()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_sync_matches_single_process() -> None:
    logits, target = _random_case(3, 90, 4)
    whole = _metrics(logits, target)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ranked_compute, args=(2, _free_port(), logits, target, out), nprocs=2)
        ranks = dict(out)
    assert ranks[0] == ranks[1]  # every rank sees the global result
    for key in whole:
        assert ranks[0][key] == pytest.approx(whole[key], rel=1e-6), key


def test_reliability_diagram_writes_png(tmp_path: Path) -> None:
    logits, target = _random_case(4, 300, 10)
    probs = logits.softmax(-1)
    path = reliability_diagram(probs.mean(0), target, tmp_path / "plots" / "rel.png", title="σN-Ens M=4")
    assert path == tmp_path / "plots" / "rel.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
    both = reliability_diagrams({"single model": (probs[0], target), "σN-Ens M=4": (probs.mean(0), target)},
                                tmp_path / "both.png", n_bins=10)
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram_rejects_bad_input(tmp_path: Path) -> None:
    logits, target = _random_case(1, 20, 3)
    with pytest.raises(ValueError, match=r"probs must be probabilities in \[0, 1\] \(softmax the logits first\)"):
        reliability_diagram(logits[0], target, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"expected probs \(N, K\) and target \(N,\).*got \(20, 3\) and \(19,\)"):
        reliability_diagram(logits[0].softmax(-1), target[:19], tmp_path / "x.png")
    with pytest.raises(ValueError, match="curves is empty"):
        reliability_diagrams({}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# -- the shift diagnosis ---------------------------------------------------------------------------------------------
def _entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p)


def test_shift_diagnosis_hand_computed() -> None:
    """Mean member NLL and ECE, disagreement, mutual information and the AUROC of telling shifted from clean inputs
    by it, on the two-member case above."""
    metrics = SampleMetrics(3, 2)
    metrics.update(MEMBER_PROBS.log(), TARGET)
    clean, shifted = torch.tensor([0.1, 0.4]), torch.tensor([0.3, 0.5])
    out = diagnosis(metrics.compute(), 2, clean, shifted)
    assert set(out) == set(DIAGNOSIS_KEYS)
    assert out["member_mean/nll"] == pytest.approx(-(math.log(0.7 * 0.6 * 0.5 * 0.2)) / 4)
    assert out["member_mean/ece"] == pytest.approx((0.35 + 0.55) / 2)
    assert out["disagreement"] == pytest.approx(0.5)  # sample 0 both say 0; sample 1: 1 against 2
    mi = [_entropy([0.6, 0.3, 0.1]) - (_entropy([0.7, 0.2, 0.1]) + _entropy([0.5, 0.4, 0.1])) / 2,
          _entropy([0.15, 0.4, 0.45]) - (_entropy([0.1, 0.6, 0.3]) + _entropy([0.2, 0.2, 0.6])) / 2]
    assert out["mutual_information"] == pytest.approx(sum(mi) / 2, rel=1e-5)
    # shifted 0.3 beats clean 0.1 not 0.4, 0.5 beats both: 3 of 4 pairs
    assert out["mi_auroc"] == pytest.approx(0.75)
    assert detection_auroc(torch.tensor([0.2]), torch.tensor([0.2, 0.3])) == pytest.approx(0.75)  # a tie is half
    assert "mi_auroc" not in diagnosis(metrics.compute(), 2)  # the clean pass: nothing to tell apart


def test_shift_diagnosis_of_one_member_is_undefined_not_zero() -> None:
    logits, target = _random_case(1, 20, 4)
    metrics = SampleMetrics(4, 1)
    metrics.update(logits, target)
    values = metrics.compute()
    out = diagnosis(values, 1, torch.zeros(20), torch.zeros(20))
    assert out["disagreement"] is None and out["mutual_information"] is None and out["mi_auroc"] is None
    assert out["member_mean/nll"] == pytest.approx(values["nll"]) and out["member_mean/ece"] == pytest.approx(
        values["ece"])
    table = {"fog": {"3": {"acc": 0.5, **out}}, "snow": {"3": {"acc": 0.7, **out}}}
    mean = shift_mean(table, [3])["3"]
    assert mean["acc"] == pytest.approx(0.6) and mean["mi_auroc"] is None  # undefined stays undefined
