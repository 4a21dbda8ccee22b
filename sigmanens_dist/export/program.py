"""``sigmanens export RUN --program OUT``: a trained ensemble as one program file that a process loads and calls
without sigmanens_dist or timm (docs/deploy.md): a ``torch.export`` program (``.pt2``, run with torch alone) or an
ONNX model (``.onnx``, run with onnxruntime alone); written by :mod:`.program_file`.

The program maps a batch of raw images, float32 ``(B, C, H, W)`` in [0, 1] (what the recipe's loader has before it
normalises), to the ensemble's prediction; the recipe's mean/std, the chosen members (a real sub-ensemble, not a
mask), the temperature and the conformal threshold fitted on the calibration split (``data.calib_split``) when
the run has one, else on the validation split (:mod:`.fit`), are inside it, and its metadata
(:class:`~sigmanens_dist.program_meta.ProgramMeta`, as JSON) is in the file. It compiles what eval scores with —
the one checkpoint rebuild (:func:`~sigmanens_dist.models.load_trained`), the method's own sub-ensemble, and
:mod:`sigmanens_dist.inference`'s scores, post-hoc fit, conformal sets and prediction-time statistics — so a program
predicts what eval scores.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

import sigmanens_dist
from sigmanens_dist.catalog.datasets import DATASETS, resolve_root
from sigmanens_dist.config import Config
from sigmanens_dist.data.ffcv_io import EVAL_CROP_RATIO
from sigmanens_dist.data.loaders import CLASSES_FILE
from sigmanens_dist.errors import UsageError
from sigmanens_dist.export.fit import NO_FIT, fit_program
from sigmanens_dist.export.program_file import write_program
from sigmanens_dist.inference.conformal import in_sets
from sigmanens_dist.inference.norm_stats import norm_stats_problem, with_norm_stats
from sigmanens_dist.inference.scores import disagreement, ensemble_log_probs, entropy, mutual_information
from sigmanens_dist.models import TrainedModel
from sigmanens_dist.program_meta import (
    CONFORMAL_OUTPUT,
    METADATA_FILE,
    OUTPUTS,
    Normalisation,
    NormStats,
    ProgramInput,
    ProgramMeta,
)

__all__ = ["ProgramHead", "class_names", "export_program"]


class ProgramHead(nn.Module):
    """Raw pixels → normalised → member logits / T → the per-input outputs (and, given ``conformal`` = (score,
    q̂), the conformal set); what gets exported, kept an ``nn.Module`` so that the eager ensemble and the program
    are the same code."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float], temperature: float,
                 conformal: tuple[str, float] | None = None) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.temperature = temperature
        self.conformal = conformal

    @property
    def outputs(self) -> tuple[str, ...]:
        """The output names, in the order the program returns them."""
        return OUTPUTS + ((CONFORMAL_OUTPUT,) if self.conformal is not None else ())

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        logits = self.model((x.float() - self.mean) / self.std).float() / self.temperature  # (M, B, K)
        log_mean = ensemble_log_probs(logits)  # the metrics' own definitions, so eval and the program agree
        probs = log_mean.exp()
        confidence, prediction = probs.max(-1)
        out = {"probabilities": probs, "prediction": prediction, "confidence": confidence,
               "entropy": entropy(log_mean), "mutual_information": mutual_information(logits),
               "disagreement": disagreement(logits)}
        if self.conformal is not None:
            out[CONFORMAL_OUTPUT] = in_sets(probs, *self.conformal)  # eval's sets, same scores
        return out


def _normalisation(cfg: Config, in_chans: int) -> tuple[list[float], list[float]]:
    """The mean/std the recipe's loaders normalise with (none for the synthetic recipe, already model inputs)."""
    spec = DATASETS[cfg.data.dataset]
    if spec.kind == "text":
        raise UsageError(f"--program: data.dataset={cfg.data.dataset!r} is a text recipe; programs take images")
    if spec.kind == "synthetic":
        return [0.0] * in_chans, [1.0] * in_chans
    repeat = in_chans // len(spec.mean)  # FFCV stores grayscale as 3 equal channels
    return list(spec.mean) * repeat, list(spec.std) * repeat


def class_names(cfg: Config, num_classes: int) -> list[str] | None:
    """The names of labels 0..K-1 as the run's data builder sees them: the dataset's own, else a converted folder's
    ``classes.json``, else a raw folder's ``train/`` class folders (sorted, as ImageFolder); None when unknown or not
    K names (data on disk that is not what the run trained on). Never reads the test split."""
    names: Sequence[str] = DATASETS[cfg.data.dataset].classes
    root = resolve_root(cfg.data.dataset, cfg.data.root)
    if not names and root is not None and cfg.data.format != "raw" and (root / CLASSES_FILE).is_file():
        names = json.loads((root / CLASSES_FILE).read_text()).get("classes") or []
    elif not names and root is not None and (root / "train").is_dir():
        names = sorted(entry.name for entry in os.scandir(root / "train") if entry.is_dir())
    return [str(name) for name in names] if len(names) == num_classes else None


def export_program(loaded: TrainedModel, out: Path, members: Sequence[int] | None = None,
                   calibration: Literal["temperature", "none"] = "none", fmt: Literal["torch", "onnx"] = "torch",
                   conformal: float | None = None, score: str = "thr",
                   weights: Literal["raw", "ema"] = "raw", norm_stats: Literal["train", "batch"] = "train",
                   norm_stats_prior: float = 0.0) -> ProgramMeta:
    """Write the ensemble of a checkpoint as ``load_trained`` rebuilt it (or the sub-ensemble ``members``; its raw
    or EMA ``weights``) as a ``fmt`` program at ``out``, with the conformal set at miscoverage ``conformal`` if
    given, its BatchNorms normalising with the training statistics or each batch's (``norm_stats``, mixed by
    ``norm_stats_prior``: :mod:`sigmanens_dist.inference.norm_stats`); returns its metadata. Bad ``members``, EMA
    weights the run did not keep, batch statistics for a model without BatchNorm, a text recipe and a fit that would
    read the test set are refused before anything is computed. Everything the program needs from this module is
    worked out first, then the model, its fit and the file, each once."""
    if not isinstance(loaded, TrainedModel):  # it took a checkpoint path until 0.3.0: say what it takes now
        raise UsageError(f"export_program takes the model load_trained rebuilt (export_program(load_trained(path), "
                         f"out)), not a {type(loaded).__name__}")
    cfg, full, method = loaded.cfg, loaded.model if weights == "raw" else loaded.ema, loaded.cfg.model.method
    if full is None:
        raise UsageError(f"--weights ema: {loaded.path} holds no EMA weights (the run had no train.ema_decay); "
                         "export its raw weights")
    asked = [flag for flag, on in (("--calibration temperature", calibration == "temperature"),
                                   (f"--conformal {conformal}", conformal is not None)) if on]
    if asked and cfg.data.val_from_test and not cfg.data.calib_split:  # a calibration split is not the test set
        raise UsageError(f"{' and '.join(asked)}: this run validates on the test set (data.val_from_test); give it "
                         "a validation split (data.val_split)")
    if members is not None and not full.supports_sub_ensembles:
        raise UsageError(f"--members: model.method={method!r} cannot run a sub-ensemble; export all members")
    chosen = list(members) if members is not None else list(range(full.num_members))
    in_chans = int(cfg.model.in_chans or loaded.model_args["in_chans"])  # what build_model gave the backbone
    num_classes = int(loaded.model_args["num_classes"])
    size = cfg.data.img_size or _default_size(cfg)
    mean, std = _normalisation(cfg, in_chans)
    names = class_names(cfg, num_classes)
    problem = norm_stats_problem(full, norm_stats, f"model.method={method!r} (model.name={cfg.model.name!r})")
    if problem is not None:
        raise UsageError(problem)
    model = with_norm_stats(full.select_members(chosen), norm_stats, norm_stats_prior).eval()
    fit = fit_program(cfg, model, calibration == "temperature", conformal, score) if asked else NO_FIT
    sets = None if fit.conformal is None else (score, math.inf if fit.conformal.qhat is None else fit.conformal.qhat)
    head = ProgramHead(model, mean, std, fit.temperature, sets).eval()
    meta = ProgramMeta(
        program_format=fmt, num_classes=num_classes, class_names=names,
        input=ProgramInput(shape=["B", in_chans, size, size], channels=in_chans, size=size,
                           crop_ratio=EVAL_CROP_RATIO if cfg.data.format == "ffcv" else 1.0),
        normalisation=Normalisation(mean, std), members=chosen, trained_members=full.num_members, weights=weights,
        norm_stats=NormStats(norm_stats, norm_stats_prior), method=method, tau=cfg.reg.tau,
        run_id=loaded.run_id, step=loaded.step, dataset=cfg.data.dataset,
        package_version=sigmanens_dist.__version__, calibration=calibration, temperature=fit.temperature,
        **fit.record, conformal=fit.conformal, outputs=list(head.outputs))
    write_program(head, torch.rand(2, in_chans, size, size), (METADATA_FILE, meta.to_json()),
                  meta.norm_stats.min_batch, fmt, out)
    return meta


def _default_size(cfg: Config) -> int:
    """The side the loaders use when ``data.img_size`` is unset."""
    return DATASETS[cfg.data.dataset].size or 16  # the synthetic recipe's default side
