"""``sigmanens export RUN --program OUT``: a trained ensemble as one ``torch.export`` program (a ``.pt2`` file) that
a process with torch alone loads and calls: no sigmanens_dist, no timm (docs/deploy.md).

The program maps a batch of raw images, float32 ``(B, C, H, W)`` in [0, 1] (what the recipe's loader has before it
normalises), to the ensemble's prediction; the recipe's mean/std, the chosen members (a real sub-ensemble, not a
mask) and the temperature fitted on the validation split are inside it, and its metadata (JSON) is in the file.
On the evaluation floor because it reuses eval's sub-ensembles, validation pass and temperature fit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from sigmanens_dist.errors import UsageError
from sigmanens_dist.evaluation.metrics import ensemble_log_probs, entropy, mutual_information

__all__ = ["METADATA_FILE", "OUTPUTS", "ProgramHead", "export_program", "parse_members"]

METADATA_FILE = "sigmanens.json"  # the name of the metadata in the program's extra_files
OUTPUTS = ("probabilities", "prediction", "confidence", "entropy", "mutual_information", "disagreement")


class ProgramHead(nn.Module):
    """Raw pixels → normalised → member logits / T → the per-input outputs; what gets exported, kept an
    ``nn.Module`` so that the eager ensemble and the program are the same code."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float], temperature: float) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.temperature = temperature

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        logits = self.model((x.float() - self.mean) / self.std).float() / self.temperature  # (M, B, K)
        log_mean = ensemble_log_probs(logits)  # the metrics' own definitions, so eval and the program agree
        probs = log_mean.exp()
        m = logits.shape[0]
        preds = logits.argmax(-1)  # (M, B)
        pairs = max(m * (m - 1) // 2, 1)
        disagreement = (preds[:, None] != preds[None]).sum((0, 1)).float() / (2 * pairs)
        confidence, prediction = probs.max(-1)
        return {"probabilities": probs, "prediction": prediction, "confidence": confidence,
                "entropy": entropy(log_mean), "mutual_information": mutual_information(logits),
                "disagreement": disagreement}


def parse_members(text: str | None, num_members: int) -> list[int] | None:
    """``--members 0,2,3`` → ``[0, 2, 3]`` (distinct indices in 0..M-1); None for all members."""
    if text is None:
        return None
    try:
        members = [int(part) for part in text.split(",")] if text.strip() else []
    except ValueError:
        raise UsageError(f"--members {text!r}: give member indices separated by commas, e.g. 0,1") from None
    if not members or len(set(members)) != len(members) or not all(0 <= i < num_members for i in members):
        raise UsageError(f"--members {text!r}: give distinct member indices in 0..{num_members - 1}")
    return members


def _normalisation(cfg: Any, in_chans: int) -> tuple[list[float], list[float]]:
    """The mean/std the recipe's loaders normalise with (none for the synthetic recipe, already model inputs)."""
    from sigmanens_dist.data.datasets import DATASETS

    spec = DATASETS[cfg.data.dataset]
    if spec.kind == "text":
        raise UsageError(f"--program: data.dataset={cfg.data.dataset!r} is a text recipe; programs take images")
    if spec.kind == "synthetic":
        return [0.0] * in_chans, [1.0] * in_chans
    repeat = in_chans // len(spec.mean)  # FFCV stores grayscale as 3 equal channels
    return list(spec.mean) * repeat, list(spec.std) * repeat


def _temperature(cfg: Any, model: nn.Module) -> dict[str, Any]:
    """T fitted on the validation split by eval's own fit (:func:`fit_posthoc`: never the test set)."""
    from sigmanens_dist.config import EvalConfig
    from sigmanens_dist.data.loaders import build_data
    from sigmanens_dist.distributed.env import DistEnv
    from sigmanens_dist.evaluation.posthoc import fit_posthoc

    if cfg.data.val_from_test:
        raise UsageError("--calibration temperature: this run validates on the test set (data.val_from_test); give "
                         "it a validation split (data.val_split)")
    device = torch.device("cpu")
    data = build_data(cfg.data, cfg.eval.batch_size or cfg.train.batch_size, cfg.seed, DistEnv(0, 1, 0, device))
    fitted = fit_posthoc(model, data.val, EvalConfig(calibration="temperature"), device, "program")
    return {k: v for k, v in fitted.parts["calibration"].items() if k not in ("method", "shift")}


def export_program(checkpoint: Path, out: Path, members: str | None = None,
                   calibration: Literal["temperature", "none"] = "none") -> dict[str, Any]:
    """Write ``checkpoint``'s ensemble (or the sub-ensemble ``members``) as a program at ``out``; returns its
    metadata. Bad ``members`` is refused before anything is computed."""
    import sigmanens_dist
    from sigmanens_dist.atomic import atomic_write
    from sigmanens_dist.evaluation.load import load_for_eval, method_of
    from sigmanens_dist.evaluation.run import sub_ensemble

    loaded = load_for_eval(checkpoint)
    cfg, full = loaded.cfg, loaded.model
    chosen = parse_members(members, full.num_members)
    if chosen is not None and not full.supports_sub_ensembles:
        raise UsageError(f"--members: model.method={method_of(cfg)!r} cannot run a sub-ensemble; export all members")
    chosen = chosen or list(range(full.num_members))
    model = sub_ensemble(full, chosen).eval()
    in_chans = int(cfg.model.in_chans or loaded.model_args["in_chans"])  # what build_model gave the backbone
    mean, std = _normalisation(cfg, in_chans)
    fit = _temperature(cfg, model) if calibration == "temperature" else {"temperature": 1.0}
    size = cfg.data.img_size or _default_size(cfg)
    head = ProgramHead(model, mean, std, fit["temperature"]).eval()
    example = torch.rand(2, in_chans, size, size)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(head, (example,), dynamic_shapes={"x": {0: batch}})
    meta = {"format": "sigmanens-program/1", "num_classes": int(head(example[:1])["probabilities"].shape[-1]),
            "input": {"shape": ["B", in_chans, size, size], "dtype": "float32", "range": [0.0, 1.0]},
            "normalisation": {"mean": mean, "std": std}, "members": chosen, "trained_members": full.num_members,
            "method": method_of(cfg), "tau": cfg.reg.tau, "run_id": loaded.run_id, "step": loaded.step,
            "dataset": cfg.data.dataset, "package_version": sigmanens_dist.__version__, "calibration": calibration,
            **fit, "outputs": list(OUTPUTS)}
    atomic_write(out, lambda f: torch.export.save(program, f, extra_files={METADATA_FILE: json.dumps(meta)}))
    return meta


def _default_size(cfg: Any) -> int:
    """The side the loaders use when ``data.img_size`` is unset."""
    from sigmanens_dist.data.datasets import DATASETS

    return DATASETS[cfg.data.dataset].size or 16  # the synthetic recipe's default side
