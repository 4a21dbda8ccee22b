"""Parameters of every ``model.method`` against the single model, built exactly as the trainer builds them.

    python bench/bench_methods.py                                  # resnet18, resnet50, vit_tiny; M=4
    python bench/bench_methods.py --models resnet18 --members 4 8 --alpha 2 --gamma 2

Packed-Ensembles only applies to the timm ResNet family; it is skipped for other models.
"""

from __future__ import annotations

import argparse
import logging

import torch

from sigmanens_dist.config import load_config
from sigmanens_dist.methods import METHOD_NAMES
from sigmanens_dist.models import build_model


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "vit_tiny_patch16_224"])
    parser.add_argument("--members", nargs="+", type=int, default=[4])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--alpha", type=float, default=2.0, help="Packed-Ensembles width factor α")
    parser.add_argument("--gamma", type=int, default=1, help="Packed-Ensembles sub-groups γ")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    print(f"{'model':24s} {'M':>3s} {'method':8s} {'params':>14s} {'/ single':>9s}")
    for name in args.models:
        for m in args.members:
            single = None
            for method in sorted(METHOD_NAMES, key=lambda x: x != "single"):
                extra = [f"model.packed_alpha={args.alpha}", f"model.packed_gamma={args.gamma}"]
                try:
                    cfg = load_config(None, [f"model.name={name}", f"model.method={method}",
                                             f"model.num_members={m}", *(extra if method == "packed" else [])])
                except ValueError as err:  # packed outside the ResNet family
                    print(f"{name:24s} {m:3d} {method:8s} {'-':>14s} {'':>9s}  ({str(err).splitlines()[-1][4:60]}…)")
                    continue
                torch.manual_seed(0)
                n = count(build_model(cfg, args.classes, 3))
                single = n if method == "single" else single
                ratio = f"{n / single:.4f}x" if single else ""
                print(f"{name:24s} {m:3d} {method:8s} {n:14,d} {ratio:>9s}")


if __name__ == "__main__":
    main()
