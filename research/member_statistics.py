"""How far apart σN-Ens's members' running BatchNorm statistics are, layer by layer (docs/results.md "Under mixed
batches", lever d of issue 52): what a per-image mixture of the members' statistics (UnMix-TNS, ICLR 2024: each image
weighs K sets of statistics by how well they fit it) would have to choose between.

    python research/member_statistics.py runs/shift_mixed/sigma_s[5-9]/sigma-*

For each σ BatchNorm layer, over its channels: how far the members' running means sit from their average, in units
of the channel's pooled standard deviation (median and maximum over channels of the largest member's distance), and
the ratio of the largest member variance to the smallest (median over channels); each the mean over the checkpoints
given (a run directory gives its best checkpoint). Nothing here is trained or evaluated: it reads the checkpoints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from sigmanens_dist.checkpoint import resolve_checkpoint
from sigmanens_dist.errors import UsageError
from sigmanens_dist.models import load_trained
from sigmanens_dist.sigma.layers import SigmaBatchNorm

HEADS = ("mean distance, median channel", "mean distance, largest", "variance ratio, median channel")


def spread(mean: torch.Tensor, var: torch.Tensor, eps: float) -> tuple[float, float, float]:
    """Members' (M, C) running statistics → the three columns of :data:`HEADS` for one layer. ``eps``: the layer's,
    added to every variance as its normalisation does, so that a dead channel (variance 0) gives finite numbers."""
    var = var + eps
    pooled_sd = var.mean(0).sqrt()
    distance = ((mean - mean.mean(0)).abs().max(0).values / pooled_sd).numpy()
    ratio = (var.max(0).values / var.min(0).values).numpy()
    return float(np.median(distance)), float(distance.max()), float(np.median(ratio))


def layer_spreads(checkpoint: Path) -> dict[str, tuple[float, float, float]]:
    """Every σ BatchNorm layer of one σN-Ens checkpoint (in the order of the network) → its :func:`spread`."""
    path, _ = resolve_checkpoint(checkpoint, "checkpoint")
    model = load_trained(path, check_data=False, with_ema=False).model
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, SigmaBatchNorm) and module.keeps_running_stats()}
    if not layers:
        raise SystemExit(f"{checkpoint}: no σ BatchNorm layer with running statistics (not a σN-Ens BatchNorm model)")
    return {name: spread(m.running_mean.detach(), m.running_var.detach(), m.eps) for name, m in layers.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="σN-Ens checkpoints or run directories")
    args = ap.parse_args()
    try:
        found = [layer_spreads(c) for c in args.checkpoints]
    except UsageError as err:  # a missing, foreign or unreadable checkpoint: its one line, no traceback
        raise SystemExit(f"member_statistics: {err}") from None
    names = list(found[0])
    if any(list(f) != names for f in found):
        raise SystemExit("the checkpoints are not of one architecture (their σ BatchNorm layers differ)")
    print(f"Members' running statistics, mean over {len(found)} checkpoint(s):\n")
    print("| layer | " + " | ".join(HEADS) + " |\n|---|" + "---:|" * len(HEADS))
    for name in names:
        cells = np.mean([f[name] for f in found], axis=0)
        print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
