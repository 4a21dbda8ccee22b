"""``--norm-stats train|batch`` and ``--norm-stats-prior N`` of ``sigmanens eval`` and ``sigmanens export --program``:
which statistics a model's BatchNorm layers normalise with at prediction time (docs/eval.md).

``train`` (the default) is the running statistics training left. ``batch`` re-estimates them from each prediction
batch, mixed with the running ones by a prior strength N (Schneider et al. 2020;
:mod:`sigmanens_dist.sigma.layers.prediction_stats`): every member its own, since a σ BatchNorm computes member m's
statistics from member m's rows and a Deep Ensemble's or Packed-Ensemble's channels belong to one member each
(BatchEnsemble's norms are shared by its members in training too, so they pool every member's rows). The model is
never changed: :func:`with_norm_stats` returns a prediction copy, timm-style, by walking its modules (a σ BatchNorm
gets its ``prediction_prior``; a plain ``_BatchNorm`` is wrapped in :class:`PredictionBatchNorm`). The statistics
of a batch are those of the batch on this process: under torchrun every rank its own, nothing synced.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from sigmanens_dist.sigma.layers import SigmaBatchNorm
from sigmanens_dist.sigma.layers.prediction_stats import prediction_moments

__all__ = ["PredictionBatchNorm", "batch_norm_layers", "norm_stats_problem", "with_norm_stats"]


class PredictionBatchNorm(nn.Module):
    """A plain BatchNorm (``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``, timm's ``BatchNormAct2d``) that, in eval,
    normalises with the batch's statistics mixed with its running ones by ``prior``; in training it is ``source``."""

    def __init__(self, source: _BatchNorm, prior: float, per_sample: bool = False) -> None:
        super().__init__()
        self.source = source
        self.prior = prior
        self.per_sample = per_sample  # each image's statistics alone, as if it were a batch of its own
        self.train(source.training)

    def forward(self, x: Tensor) -> Tensor:
        bn = self.source
        if self.training:
            return bn(x)
        if self.per_sample:  # (B, C) statistics over the spatial positions, against (1, C) running ones
            running = [None if t is None else t.view(1, -1) for t in (bn.running_mean, bn.running_var)]
            mean, var = prediction_moments(x, range(2, x.ndim), *running, self.prior, 1)
            shape: tuple[int, ...] = (*mean.shape, *[1] * (x.ndim - 2))
        else:
            mean, var = prediction_moments(x, [0, *range(2, x.ndim)], bn.running_mean, bn.running_var, self.prior,
                                           x.shape[0])
            shape = (-1, *[1] * (x.ndim - 2))  # per channel, dim 1
        scale = torch.rsqrt(var + bn.eps) if bn.weight is None else bn.weight * torch.rsqrt(var + bn.eps)
        shift = -mean * scale if bn.bias is None else bn.bias - mean * scale
        y = x * scale.view(shape) + shift.view(shape)  # not F.batch_norm: eval mode takes no differentiable stats
        for after in (getattr(bn, "drop", None), getattr(bn, "act", None)):  # timm's *Act: drop, then act
            if isinstance(after, nn.Module):
                y = after(y)
        return y

    def extra_repr(self) -> str:
        return f"prior={self.prior:g}" + (", per_sample=True" if self.per_sample else "")


def _keeps_running_stats(module: nn.Module) -> bool:
    if isinstance(module, SigmaBatchNorm):
        return module.keeps_running_stats()
    return isinstance(module, _BatchNorm) and module.running_mean is not None


def batch_norm_layers(model: nn.Module) -> list[str]:
    """Names of the layers that keep running statistics: what ``--norm-stats batch`` re-estimates."""
    return [name for name, module in model.named_modules() if _keeps_running_stats(module)]


def norm_stats_problem(model: nn.Module, mode: str, what: str) -> str | None:
    """Why ``--norm-stats mode`` cannot apply to ``model`` (``what`` names it), or None."""
    if mode == "batch" and not batch_norm_layers(model):
        return (f"--norm-stats batch: {what} has no BatchNorm layer with running statistics (LayerNorm, GroupNorm "
                "and RMSNorm normalise each sample by its own statistics), so there is nothing to re-estimate; use "
                "--norm-stats train")
    return None


def with_norm_stats(model: nn.Module, mode: str, prior: float = 0.0, per_sample: bool = False) -> nn.Module:
    """``model`` itself for ``train``; for ``batch`` a copy whose BatchNorm layers normalise, in eval, with the
    prediction batch's statistics mixed with their running ones by ``prior`` (the running ones stay untouched).
    ``per_sample``: with each image's statistics alone, as if every image were a batch of one (a prior > 0 only:
    one image alone has no statistics worth the name): a batch predicted so is one image at a time, in one pass."""
    if per_sample and prior <= 0:  # an invariant: eval refuses batches of one with the batch's statistics alone
        raise ValueError(f"per-sample statistics need a prior > 0, got {prior}")
    if per_sample and getattr(model, "pools_member_rows", False):  # an invariant: eval predicts these one by one
        raise ValueError(f"{type(model).__name__}'s norms pool its members' rows of an image: per-sample statistics "
                         "would take one row's")
    if mode == "train":
        return model
    adapted = copy.deepcopy(model)
    for name, module in list(adapted.named_modules()):
        if not _keeps_running_stats(module):
            continue
        if isinstance(module, SigmaBatchNorm):
            module.prediction_prior = float(prior)
            module.prediction_per_sample = per_sample
        else:
            parent, _, attr = name.rpartition(".")
            setattr(adapted.get_submodule(parent) if parent else adapted, attr,
                    PredictionBatchNorm(module, float(prior), per_sample))
    return adapted
