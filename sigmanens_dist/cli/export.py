"""``sigmanens export CKPT OUT [--member K]``: a checkpoint of any strategy → one plain state dict, on one CPU process
without a process group.

CKPT is a ``step_N.pt`` file (DDP), a DCP folder (FSDP2) or a DeepSpeed folder (ZeRO-1/2/3), e.g.
``runs/x/checkpoints/step_00001000`` or ``.../best``. OUT receives either the whole σN-Ens state dict (what
``convert_to_sigma_ensemble`` + ``load_state_dict`` accept) or, with ``--member K``, member K as a plain state dict of
the source architecture (``SigmaEnsemble.member(K)``) that ``timm.create_model(name, **kwargs)`` loads directly.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.errors import EXIT_USAGE, UsageError

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="step_N.pt file, a DCP / DeepSpeed step folder, or a run directory "
                                                  "(its best checkpoint, else its newest)")
    ap.add_argument("out", type=Path, help="where to write the state dict (torch.save)")
    ap.add_argument("--member", type=int, help="write only member K as a plain model of the source architecture")
    args = ap.parse_args(argv)
    import torch  # after parsing: `sigmanens export --help` answers without it

    from sigmanens_dist.export import load_model
    from sigmanens_dist.training.checkpoint import consolidated_state_dict, resolve_checkpoint

    try:
        checkpoint, which = resolve_checkpoint(args.checkpoint, "checkpoint")
        print(f"exporting {which}")
        if args.member is None:
            weights, _ = consolidated_state_dict(checkpoint)
        else:
            model = load_model(checkpoint)
            if model.num_members == 1:
                raise UsageError(f"{checkpoint} is a single-model run: it has no members; export it without --member")
            if not 0 <= args.member < model.num_members:
                raise UsageError(f"--member {args.member}: the model has members 0..{model.num_members - 1}")
            weights = model.member(args.member).state_dict()
    except UsageError as err:
        print(f"sigmanens export: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, args.out)
    print(f"wrote {len(weights)} tensors to {args.out}")
    return 0
