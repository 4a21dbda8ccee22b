"""``sigmanens params MODEL [--members M …]``: the parameters of σN-Ens(M) against the single model's, for any timm
model, without training anything."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens params", description="parameters of σN-Ens(M) vs the single model")
    ap.add_argument("model", help="timm model name")
    ap.add_argument("--members", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args(argv)
    import timm  # after parsing: `sigmanens params --help` answers without torch

    from sigmanens_dist import convert_to_sigma_ensemble

    src = timm.create_model(args.model)
    n = sum(p.numel() for p in src.parameters())
    print(f"{args.model}: {n:,} parameters")
    for m in args.members:
        k = sum(p.numel() for p in convert_to_sigma_ensemble(src, m).parameters())
        print(f"  σN-Ens M={m:<3d} {k:>14,d}  = {k / n:.4f}x   (deep ensemble {m}x)")
    return 0
