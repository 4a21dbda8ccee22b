"""``sigmanens`` — the command users type.

    sigmanens train --config configs/demo.yaml model.num_members=8     (one process; use torchrun for several)
    sigmanens demo                                                      (the embedded Fashion-MNIST demo)
    sigmanens params resnet50 --members 1 4 16                          (σN-Ens vs single-model parameter count)
    sigmanens data convert --dataset cifar10 --root /data/cifar10 --format ffcv --out /data/cifar10_ffcv
    sigmanens study m-scaling --config configs/demo.yaml --members 1,2,4,8 --seeds 0,1,2   (a grid of child runs)
    sigmanens study run-one --definition runs/study-m-scaling/study.yaml --index 3       (one child: Slurm array)
    sigmanens compare --parent RUN_ID --uri sqlite:///runs/study-m-scaling/mlflow.db    (table + plots from MLflow)
    sigmanens eval --checkpoint runs/x/checkpoints/best.pt --corruptions all --ood digits   (test-set evaluation)
    sigmanens export runs/x/checkpoints/step_00001000 model.pt [--member K]   (any strategy's checkpoint)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _params(argv: Sequence[str]) -> int:
    import timm

    from sigmanens_dist import convert_to_sigma_ensemble

    ap = argparse.ArgumentParser(prog="sigmanens params", description="parameters of σN-Ens(M) vs the single model")
    ap.add_argument("model", help="timm model name")
    ap.add_argument("--members", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args(argv)
    src = timm.create_model(args.model)
    n = sum(p.numel() for p in src.parameters())
    print(f"{args.model}: {n:,} parameters")
    for m in args.members:
        k = sum(p.numel() for p in convert_to_sigma_ensemble(src, m).parameters())
        print(f"  σN-Ens M={m:<3d} {k:>14,d}  = {k / n:.4f}x   (deep ensemble {m}x)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("train", "demo", "params", "data", "eval", "export", "study", "compare")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}; choose one of: {', '.join(commands)}", file=sys.stderr)
            return 2
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "params":
        return _params(rest)
    if cmd == "data":
        if not rest or rest[0] != "convert":
            print("usage: sigmanens data convert --help", file=sys.stderr)
            return 2
        from sigmanens_dist.data.convert import main as convert_main

        return convert_main(rest[1:])
    if cmd == "study":
        from sigmanens_dist.experiments.study import main as study_main

        return study_main(rest)
    if cmd == "compare":
        from sigmanens_dist.experiments.compare import main as compare_main

        return compare_main(rest)
    if cmd == "eval":
        from sigmanens_dist.evaluation.cli import main as eval_main

        return eval_main(rest)
    if cmd == "export":
        from sigmanens_dist.export import main as export_main

        return export_main(rest)
    if cmd == "train":
        from sigmanens_dist.train import main as train_main

        return train_main(rest)
    from sigmanens_dist.experiments.demo import main as demo_main

    return demo_main(rest)


if __name__ == "__main__":
    sys.exit(main())
