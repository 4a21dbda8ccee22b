"""BatchNorm statistics re-estimated from the prediction batch (Schneider et al. 2020, "Improving robustness against
common corruptions by covariate shift adaptation"): under shift the training statistics no longer standardise the
activations, the batch's own do. With a prior strength N the two are mixed, ``(N·train + n·batch) / (N + n)`` for
mean and variance alike, n the samples the batch statistic is estimated from; N = 0 is the batch's alone.

The one formula both the σ BatchNorm (:mod:`.batchnorm`) and a plain one at prediction time
(:mod:`sigmanens_dist.inference.norm_stats`) use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["prediction_moments"]


def prediction_moments(x: Tensor, dims: Sequence[int], running_mean: Tensor | None, running_var: Tensor | None,
                       prior: float, samples: int) -> tuple[Tensor, Tensor]:
    """Mean and biased variance of ``x`` over ``dims`` (what a BatchNorm in training normalises with), mixed with
    the running statistics by the prior strength ``prior`` against ``samples`` batch samples; the batch's own when
    ``prior`` is 0 or there are no running statistics."""
    dims = list(dims)
    if dims:
        var, mean = torch.var_mean(x, dim=dims, correction=0)
    else:  # one value per statistic (a (B, C) input, each image alone): itself, no spread; var_mean(dim=[]) would
        mean, var = x, torch.zeros_like(x)  # reduce over every dimension instead
    if prior == 0 or running_mean is None or running_var is None:
        return mean, var
    # n as a tensor: in an exported program the batch size is a symbol, and arithmetic on it would put an
    # expression into the file that loading it has to evaluate (safe_load refuses those)
    n = mean.new_ones(samples).sum()
    return ((prior * running_mean + n * mean) / (prior + n), (prior * running_var + n * var) / (prior + n))
