"""``sigmanens`` — the command users type. Every command-line parser of the package lives in this folder, one
module per command; each is imported only when its command runs, so that ``--help`` answers without torch.

    sigmanens train --config configs/demo.yaml model.num_members=8     (one process; use torchrun for several)
    sigmanens demo                                                      (the embedded Fashion-MNIST demo)
    sigmanens params resnet50 --members 1 4 16                          (σN-Ens vs single-model parameter count)
    sigmanens data convert --dataset cifar10 --root /data/cifar10 --format ffcv --out /data/cifar10_ffcv
    sigmanens study m-scaling --config configs/demo.yaml --members 1,2,4,8 --seeds 0,1,2   (a grid of child runs)
    sigmanens study run-one --definition runs/study-m-scaling/study.yaml --index 3       (one child: Slurm array)
    sigmanens compare --parent RUN_ID --uri sqlite:///runs/study-m-scaling/mlflow.db    (table + plots from MLflow)
    sigmanens eval --checkpoint runs/x/checkpoints/best.pt --corruptions all --ood digits   (test-set evaluation)
    sigmanens export runs/x/checkpoints/step_00001000 model.pt [--member K]   (any strategy's checkpoint)
    sigmanens predict model.pt2 photos/ shards/test-000000.tar --out preds   (an exported program over many inputs)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

# each command is the module of that name under sigmanens_dist.cli, run as main(argv); tracking.py is not one (the
# Slurm scripts run it as python -m sigmanens_dist.cli.tracking)
COMMANDS = ("train", "demo", "params", "data", "eval", "export", "study", "compare", "predict")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    command = importlib.import_module(f"{__name__}.{argv[0]}")
    return command.main(argv[1:])
