"""Evaluation of member-vectorised ensembles: the ensemble predicts with the mean of its members' softmaxes.

The one place for every metric definition (the per-input scores they aggregate:
:mod:`sigmanens_dist.inference.scores`). :class:`EnsembleMetrics` streams the loop's cheap metrics;
:class:`SampleMetrics` keeps a few numbers per sample (confidence, correctness, losses, uncertainty scores) for the
metrics that need the whole set (adaptive ECE, AURC, OOD detection). Both are torchmetrics metrics, so ``compute``
syncs across ranks under torch.distributed. Loss sums accumulate in float64: feeding the data in one batch or in many
gives the same numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchmetrics import Metric, SumMetric
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError
from torchmetrics.functional.classification import (
    binary_auroc,
    binary_average_precision,
    binary_calibration_error,
    binary_roc,
)
from torchmetrics.utilities import dim_zero_cat

from sigmanens_dist.errors import UsageError
from sigmanens_dist.inference.scores import ensemble_log_probs, entropy, mutual_information

__all__ = ["DIAGNOSIS_KEYS", "EnsembleMetrics", "SampleMetrics", "adaptive_calibration_error", "aurc",
           "calibration_error", "detection_auroc", "diagnosis", "ood_detection"]


# -- whole-set metrics from (confidence, correct) ----------------------------------------------------------------
def calibration_error(confidence: Tensor, correct: Tensor, n_bins: int = 15) -> float:
    """ECE with ``n_bins`` equal-width bins (torchmetrics' l1 definition): the same number as
    ``multiclass_calibration_error(probs, target)``, from the top-1 confidence and its correctness alone."""
    return float(binary_calibration_error(confidence.float().contiguous(), correct.long().contiguous(), n_bins=n_bins,
                                          norm="l1"))


def adaptive_calibration_error(confidence: Tensor, correct: Tensor, n_bins: int = 15) -> float:
    """Adaptive ECE (Nguyen & O'Connor 2015): like ECE but with equal-mass bins, the samples sorted by confidence
    and split into ``n_bins`` groups of sizes differing by at most one; ``Σ_b |B_b|/N · |acc_b − conf_b|``."""
    order = confidence.argsort(stable=True)
    conf, corr = confidence[order].double(), correct[order].double()
    total = conf.new_zeros(())
    for c, a in zip(conf.tensor_split(n_bins), corr.tensor_split(n_bins), strict=True):
        if len(c):
            total += (a.sum() - c.sum()).abs()
    return float(total / len(conf))


def aurc(confidence: Tensor, correct: Tensor) -> float:
    """Area under the risk-coverage curve (Geifman et al. 2019): keep the most confident i of N samples, measure the
    error rate among them, average over i = 1..N. Lower is better; ties keep dataset order."""
    order = confidence.argsort(descending=True, stable=True)
    errors = 1.0 - correct[order].double()
    risk = errors.cumsum(0) / torch.arange(1, len(errors) + 1, dtype=torch.float64, device=errors.device)
    return float(risk.mean())


def ood_detection(score_in: Tensor, score_out: Tensor) -> dict[str, float]:
    """How well a score (higher: more likely OOD) separates OOD samples (the positive class) from in-distribution
    ones: AUROC, AUPR-out (OOD positive), AUPR-in (in-distribution positive, score negated) and the FPR on
    in-distribution samples at the first threshold that detects 95 % of the OOD ones."""
    # an invariant: score_ood refuses an empty OOD set first (a bug if hit)
    if len(score_in) == 0 or len(score_out) == 0:
        raise ValueError(f"ood_detection needs samples on both sides, got {len(score_in)} in and {len(score_out)} out")
    scores = torch.cat([score_in, score_out]).double()
    is_out = torch.cat([torch.zeros(len(score_in)), torch.ones(len(score_out))]).long()
    fpr, tpr, _ = binary_roc(scores, is_out)
    return {"auroc": float(binary_auroc(scores, is_out)),
            "aupr_out": float(binary_average_precision(scores, is_out)),
            "aupr_in": float(binary_average_precision(-scores, 1 - is_out)),
            "fpr95": float(fpr[tpr >= 0.95].min())}


def detection_auroc(negatives: Tensor, positives: Tensor) -> float:
    """AUROC of telling ``positives`` from ``negatives`` by their score (higher: more likely positive; ties count
    half), torchmetrics' ``binary_auroc``: the probability that a random positive outscores a random negative."""
    scores = torch.cat([negatives, positives]).double()
    labels = torch.cat([torch.zeros(len(negatives)), torch.ones(len(positives))]).long()
    return float(binary_auroc(scores, labels))


# the diagnosis columns of a shift report (docs/eval.md): member-based ones are None for a single member
DIAGNOSIS_KEYS = ("member_mean/nll", "member_mean/ece", "disagreement", "mutual_information", "mi_auroc")


def diagnosis(values: dict[str, float], num_members: int, clean_mi: Tensor | None = None,
              shifted_mi: Tensor | None = None) -> dict[str, float | None]:
    """Why an ensemble's uncertainty moves under shift, from one pass's :meth:`SampleMetrics.compute` ``values``: the
    mean member NLL and ECE (beside the ensemble's), member disagreement, mutual information and, given the
    per-sample mutual information of the clean pass (negatives) and of this corrupted pass (positives), the AUROC of
    telling corrupted from clean inputs by it. With one member there is nothing to disagree: disagreement, mutual
    information and its AUROC are undefined, None (not the 0 and 0.5 a single network scores by construction)."""
    ensemble = num_members > 1
    out: dict[str, float | None] = {"member_mean/nll": values["member_mean/nll"],
                                    "member_mean/ece": values["member_mean/ece"],
                                    "disagreement": values["disagreement"] if ensemble else None,
                                    "mutual_information": values["mutual_information"] if ensemble else None}
    if clean_mi is not None and shifted_mi is not None:
        out["mi_auroc"] = detection_auroc(clean_mi, shifted_mi) if ensemble else None
    return out


def _sum() -> SumMetric:
    # NaN losses must show in the result, not be dropped; float64 makes the sums independent of batching.
    return SumMetric(nan_strategy="disable").set_dtype(torch.float64)


class EnsembleMetrics(nn.Module):
    """Accuracy, NLL, ECE, Brier, disagreement and entropy of the ensemble, plus accuracy, NLL and ECE per member.

    An ``nn.Module`` so that ``.to(device)`` moves every state. ``update`` takes member logits ``(M, B, K)``.
    """

    def __init__(self, num_classes: int, num_members: int, n_bins: int = 15) -> None:
        super().__init__()
        if num_classes < 2:
            raise UsageError(f"num_classes={num_classes} must be at least 2")
        if num_members < 1:
            raise UsageError(f"num_members={num_members} must be at least 1")
        if n_bins < 1:
            raise UsageError(f"n_bins={n_bins} must be at least 1")
        self.num_classes, self.num_members, self.n_bins = num_classes, num_members, n_bins

        def acc() -> MulticlassAccuracy:
            return MulticlassAccuracy(num_classes, average="micro", validate_args=False)

        def ece() -> MulticlassCalibrationError:
            return MulticlassCalibrationError(num_classes, n_bins=n_bins, norm="l1", validate_args=False)

        self.acc, self.ece = acc(), ece()
        self.count, self.nll, self.brier, self.entropy, self.disagreement = (_sum() for _ in range(5))
        self.member_acc = nn.ModuleList(acc() for _ in range(num_members))
        self.member_ece = nn.ModuleList(ece() for _ in range(num_members))
        self.member_nll = nn.ModuleList(_sum() for _ in range(num_members))

    @torch.no_grad()
    def update(self, member_logits: Tensor, target: Tensor) -> None:
        """Add a batch: ``member_logits`` ``(M, B, K)``, ``target`` ``(B,)`` class indices."""
        self._check(member_logits, target)
        m, b, _ = member_logits.shape
        log_probs = member_logits.float().log_softmax(-1)  # (M, B, K)
        probs = log_probs.exp()
        log_mean = ensemble_log_probs(member_logits)  # (B, K)
        mean = probs.mean(0)
        rows = torch.arange(b, device=target.device)

        self.count.update(float(b))
        self.acc.update(mean, target)
        self.ece.update(mean, target)
        self.nll.update(-log_mean[rows, target])
        onehot = nn.functional.one_hot(target, self.num_classes).to(mean.dtype)
        self.brier.update((mean - onehot).square().sum(-1))
        self.entropy.update(entropy(log_mean))
        if m > 1:
            preds = probs.argmax(-1)  # (M, B)
            # Each unordered pair is counted twice by the full M×M comparison; the diagonal never differs.
            self.disagreement.update((preds[:, None] != preds[None]).sum() / 2)
        for i in range(m):
            self.member_acc[i].update(probs[i], target)
            self.member_ece[i].update(probs[i], target)
            self.member_nll[i].update(-log_probs[i, rows, target])

    def compute(self) -> dict[str, float]:
        """All metrics as floats, synced across ranks; ``member{m}/…`` per member and ``member_mean/…`` averages."""
        n = float(self.count.compute())
        if n == 0:  # an invariant: every pass feeds at least one batch before it is scored (a bug if hit)
            raise RuntimeError("EnsembleMetrics.compute() called before any update(): there are no samples to score")
        m = self.num_members
        pairs = m * (m - 1) / 2
        out = {
            "acc": float(self.acc.compute()),
            "nll": float(self.nll.compute()) / n,
            "ece": float(self.ece.compute()),
            "brier": float(self.brier.compute()) / n,
            "disagreement": float(self.disagreement.compute()) / (pairs * n) if m > 1 else 0.0,
            "entropy": float(self.entropy.compute()) / n,
        }
        for i in range(m):
            out[f"member{i}/acc"] = float(self.member_acc[i].compute())
            out[f"member{i}/nll"] = float(self.member_nll[i].compute()) / n
            out[f"member{i}/ece"] = float(self.member_ece[i].compute())
        for key in ("acc", "nll", "ece"):
            out[f"member_mean/{key}"] = sum(out[f"member{i}/{key}"] for i in range(m)) / m
        return out

    def reset(self) -> None:
        """Forget every sample seen so far."""
        for module in self.modules():
            if isinstance(module, Metric):
                module.reset()

    def _check(self, member_logits: Tensor, target: Tensor) -> None:
        m, k = self.num_members, self.num_classes
        # an invariant of the pass: the model's (M, B, K) logits (a bug if hit)
        if member_logits.ndim != 3 or member_logits.shape[0] != m or member_logits.shape[2] != k:
            raise ValueError(f"member_logits must have shape (M={m}, B, K={k}), got {tuple(member_logits.shape)}")
        b = member_logits.shape[1]
        if target.ndim != 1 or target.shape[0] != b:  # an invariant of the pass: the loader's labels (a bug if hit)
            raise ValueError(f"target must have shape (B={b},) to match member_logits {tuple(member_logits.shape)}, "
                             f"got {tuple(target.shape)}")
        # an invariant of the pass: the loader's labels (a bug if hit)
        if target.is_floating_point() or target.dtype == torch.bool:
            raise ValueError(f"target must hold integer class indices, got dtype {target.dtype}")
        lo, hi = torch.stack(torch.aminmax(target)).tolist()  # one device sync, not two
        if lo < 0 or hi >= k:  # an invariant: labels were checked when read (data.on_bad_sample)
            raise ValueError(f"target values must lie in 0..{k - 1}, got min {lo}, max {hi}")


class SampleMetrics(Metric):
    """Everything ``sigmanens eval`` reports for one pass, from a few numbers kept per sample.

    ``update(member_logits (M, B, K), target (B,))``; :meth:`compute` gives, for the ensemble and for each member,
    accuracy, NLL, ECE, adaptive ECE, Brier and AURC, plus the ensemble's entropy, mutual information and member
    disagreement; :meth:`scores` gives the per-sample OOD scores (max-softmax, entropy, mutual information) and the
    ensemble's confidence and correctness (reliability diagrams). ``sync_on_compute=False`` for a single rank scoring
    alone inside a distributed job.
    """

    full_state_update = False
    _FIELDS = ("conf", "correct", "nll", "brier", "pred")  # each (B, M + 1): column 0 the ensemble, then members
    _SCORES = ("entropy", "mutual_information")  # each (B,)

    def __init__(self, num_classes: int, num_members: int, n_bins: int = 15, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.num_classes, self.num_members, self.n_bins = num_classes, num_members, n_bins
        for name in (*self._FIELDS, *self._SCORES):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(self, member_logits: Tensor, target: Tensor) -> None:
        m, _, k = member_logits.shape
        # an invariant of the pass (a bug if hit)
        if m != self.num_members or k != self.num_classes or target.shape != member_logits.shape[1:2]:
            raise ValueError(f"expected member_logits (M={self.num_members}, B, K={self.num_classes}) and target "
                             f"(B,), got {tuple(member_logits.shape)} and {tuple(target.shape)}")
        log_probs = torch.cat([ensemble_log_probs(member_logits)[None], member_logits.float().log_softmax(-1)])
        probs = log_probs.exp()  # (M + 1, B, K)
        conf, pred = probs.max(-1)
        index = target.view(1, -1, 1).expand(m + 1, -1, 1)
        onehot = nn.functional.one_hot(target, k).to(probs.dtype)
        values = {"conf": conf, "correct": (pred == target).float(), "nll": -log_probs.gather(-1, index)[..., 0],
                  "brier": (probs - onehot).square().sum(-1), "pred": pred.float()}
        for name, value in values.items():
            getattr(self, name).append(value.T)
        self.entropy.append(entropy(log_probs[0]))
        self.mutual_information.append(mutual_information(member_logits))

    def _cat(self, name: str) -> Tensor:
        value = getattr(self, name)
        return dim_zero_cat(value) if isinstance(value, list) else value

    def compute(self) -> dict[str, float]:
        if isinstance(self.conf, list) and not self.conf:  # an invariant, as EnsembleMetrics.compute's
            raise RuntimeError("SampleMetrics.compute() called before any update(): there are no samples to score")
        cols = {name: self._cat(name) for name in self._FIELDS}
        out: dict[str, float] = {}
        for j, prefix in enumerate(["", *(f"member{i}/" for i in range(self.num_members))]):
            conf, correct = cols["conf"][:, j], cols["correct"][:, j]
            out |= {f"{prefix}acc": float(correct.double().mean()), f"{prefix}nll": float(cols["nll"][:, j].double()
                    .mean()), f"{prefix}ece": calibration_error(conf, correct, self.n_bins),
                    f"{prefix}aece": adaptive_calibration_error(conf, correct, self.n_bins),
                    f"{prefix}brier": float(cols["brier"][:, j].double().mean()), f"{prefix}aurc": aurc(conf, correct)}
        m = self.num_members
        for key in ("acc", "nll", "ece", "aece", "brier", "aurc"):
            out[f"member_mean/{key}"] = sum(out[f"member{i}/{key}"] for i in range(m)) / m
        preds = cols["pred"][:, 1:]
        pairs = m * (m - 1) / 2
        differ = (preds[:, :, None] != preds[:, None, :]).sum((1, 2)).double() / 2
        out["disagreement"] = float(differ.mean() / pairs) if m > 1 else 0.0
        out["entropy"] = float(self._cat("entropy").double().mean())
        out["mutual_information"] = float(self._cat("mutual_information").double().mean())
        out["num_samples"] = float(len(preds))
        return out

    def scores(self) -> dict[str, Tensor]:
        """Per-sample OOD scores, higher meaning more likely OOD (``msp`` is minus the max softmax), and the
        ensemble's confidence and correctness; gathered from every rank like :meth:`compute`."""
        with self.sync_context(should_sync=self.sync_on_compute):
            conf, correct = self._cat("conf")[:, 0], self._cat("correct")[:, 0]
            return {"msp": -conf, "entropy": self._cat("entropy"),
                    "mutual_information": self._cat("mutual_information"), "confidence": conf, "correct": correct}

