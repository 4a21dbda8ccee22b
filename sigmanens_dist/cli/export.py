"""``sigmanens export CKPT OUT [--member K]``: a checkpoint of any strategy → one plain state dict, on one CPU process
without a process group.

CKPT is a ``step_N.pt`` file (DDP), a DCP folder (FSDP2) or a DeepSpeed folder (ZeRO-1/2/3), e.g.
``runs/x/checkpoints/step_00001000`` or ``.../best``. OUT receives either the whole σN-Ens state dict (what
``convert_to_sigma_ensemble`` + ``load_state_dict`` accept) or, with ``--member K``, member K as a plain state dict of
the source architecture (``SigmaEnsemble.member(K)``) that ``timm.create_model(name, **kwargs)`` loads directly.

``sigmanens export RUN --program OUT [--format torch|onnx] [--members LIST] [--calibration temperature|none]
[--conformal ALPHA [--conformal-score thr|aps|raps]] [--norm-stats train|batch [--norm-stats-prior N]]`` writes
instead one program of the ensemble, its normalisation, temperature and conformal threshold: a ``torch.export``
program (.pt2) that a process with torch alone loads and calls, or an ONNX model (.onnx; the format OUT's suffix
implies unless --format says) that onnxruntime alone runs (docs/deploy.md). With ``--norm-stats batch`` its BatchNorms
normalise each input batch with that batch's statistics.

OUT is written atomically and never over the checkpoint being exported; a file already there is replaced only with
``--force``.

``--register NAME [--alias ALIAS] [--tracking-uri URI]`` then logs the program as an MLflow Model into the run's own
MLflow run (the store in the run's mlflow_run.txt, unless --tracking-uri says) and registers it as a new version of
NAME in MLflow's Model Registry, ALIAS (e.g. champion) pointing at it (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.atomic import check_writable_folder
from sigmanens_dist.cli.options import (
    add_norm_stats_options,
    parse_alphas,
    parse_members,
    parse_prior,
    parse_score,
    program_format,
)
from sigmanens_dist.config import EvalConfig, choices
from sigmanens_dist.errors import EXIT_UNAVAILABLE, EXIT_USAGE, UnavailableError, UsageError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sigmanens export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="step_N.pt file, a DCP / DeepSpeed step folder, or a run directory "
                                                  "(its best checkpoint, else its newest)")
    ap.add_argument("out", type=Path, nargs="?", help="where to write the state dict (torch.save)")
    ap.add_argument("--member", type=int, help="write only member K as a plain model of the source architecture")
    ap.add_argument("--program", type=Path, metavar="OUT", help="write a program (.pt2 or .onnx) instead")
    ap.add_argument("--format", help="with --program: torch (a torch.export .pt2) or onnx; default: onnx for an OUT "
                                     "ending in .onnx, else torch")
    ap.add_argument("--members", metavar="LIST", help="with --program: only these members, e.g. 0,1 (a sub-ensemble)")
    ap.add_argument("--calibration", default="none",
                    choices=[c for c in choices(EvalConfig, "calibration") if c != "member-temperature"],
                    help="with --program: divide member logits by a temperature fitted where eval fits it (the "
                         "calibration split of a run trained with data.calib_split, else the validation split; one "
                         "T: eval's member-temperature is a comparison, not exported)")
    add_norm_stats_options(ap, "with --program: ")
    ap.add_argument("--conformal", metavar="ALPHA", help="with --program: also output the conformal set at "
                                                         "miscoverage ALPHA in (0, 1), fitted where --calibration is")
    ap.add_argument("--conformal-score", metavar="SCORE", help="with --conformal: thr (default), aps or raps")
    ap.add_argument("--weights", choices=("raw", "ema"), default="raw",
                    help="with --program: the trained weights (default) or their EMA (train.ema_decay), as eval "
                         "scores them")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists (never the checkpoint itself)")
    ap.add_argument("--register", metavar="NAME", help="with --program: log it as an MLflow Model into the run's "
                                                       "MLflow run and register a version of NAME")
    ap.add_argument("--alias", help="with --register: point this alias of NAME at the new version (e.g. champion)")
    ap.add_argument("--tracking-uri", metavar="URI", help="with --register: the MLflow store (default: the one the "
                                                          "run was tracked in, from its mlflow_run.txt)")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_flags(args)
        return _program(args) if args.program is not None else _state_dict(args)
    except UsageError as err:
        return _usage(str(err))
    except UnavailableError as err:  # a tracking server that does not answer: one line, exit 1 (errors.py)
        print(f"sigmanens export: error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE


def _check_flags(args: argparse.Namespace) -> None:
    """Which flags go together: a state dict (OUT, optionally --member) or a program (--program and its flags,
    --register and its)."""
    if (args.out is None) == (args.program is None) or (args.program is not None and args.member is not None):
        raise UsageError("give OUT (a state dict, optionally --member K) or --program OUT, one of the two")
    program_only = (args.members, args.format, args.conformal, args.conformal_score, args.norm_stats_prior)
    if args.program is None and (any(v is not None for v in program_only) or args.calibration != "none"
                                 or args.weights != "raw" or args.norm_stats != "train"):
        raise UsageError("--members, --calibration, --format, --conformal(-score), --weights and "
                         "--norm-stats(-prior) go with --program OUT")
    registry_flags = args.alias is not None or args.tracking_uri is not None
    if (args.register is None and registry_flags) or (args.register is not None and args.program is None):
        raise UsageError("--register NAME goes with --program OUT, and --alias and --tracking-uri with --register")


def _program(args: argparse.Namespace) -> int:
    """``--program OUT [--register NAME]``: every flag checked before the checkpoint is read, then the checkpoint
    read once, the registration checked once (before the program is written: a refused one leaves nothing behind),
    the program written and registered."""
    from sigmanens_dist.checkpoint import resolve_checkpoint  # here, not at the top: `--help` answers without torch
    from sigmanens_dist.export.program import export_program
    from sigmanens_dist.models import load_trained
    from sigmanens_dist.training.run_lock import own_run_containing

    out = args.program
    fmt = program_format(args.format, out)
    alpha = next(iter(parse_alphas(args.conformal, single=True)), None)
    score = parse_score(args.conformal_score, alpha)
    prior = parse_prior(args.norm_stats_prior, args.norm_stats)
    uri = None
    if args.register is not None:
        # here, not at the top: `--help` answers without torch
        from sigmanens_dist.registry import check_alias, check_name, recorded_tracking_uri

        check_name(args.register, "--register")
        check_alias(args.alias)
    checkpoint, which = resolve_checkpoint(args.checkpoint, "checkpoint")
    if args.register is not None:
        uri = args.tracking_uri or recorded_tracking_uri(checkpoint)
        if uri is None:
            raise UsageError(f"--register: {args.checkpoint} has no mlflow_run.txt (a run trained with tracking on "
                             "has one); give the store with --tracking-uri")
    _check_out(out, checkpoint, args.force)
    loaded = load_trained(checkpoint)
    run = None
    if args.register is not None:
        from sigmanens_dist.registry import check_registration  # here, not at the top: `--help` answers without torch

        run = check_registration(uri, loaded.run_id, args.register, args.alias)
    lock = own_run_containing(out, "export")
    try:
        print(f"exporting {which}")
        meta = export_program(loaded, out, parse_members(args.members, loaded.model.num_members),
                              args.calibration, fmt, alpha, score, args.weights, args.norm_stats, prior)
        extra, sets = "", meta.conformal
        if sets is not None:
            extra = f", {score} sets at α={alpha}, q̂={'inf' if sets.qhat is None else f'{sets.qhat:.4g}'}"
        print(f"wrote a program ({fmt}) of {len(meta.members)} members (T={meta.temperature:.4g}{extra}) to {out}")
        if run is not None:
            from sigmanens_dist.registry import register_program  # here, not at the top: `--help` answers without torch

            version = register_program(out, args.register, uri=uri, run=run, alias=args.alias)
            print(f"registered it as models:/{args.register}/{version.version}"
                  f"{f' (models:/{args.register}@{args.alias})' if args.alias else ''} in {uri}")
    finally:
        if lock is not None:
            lock.release()
    return 0


def _state_dict(args: argparse.Namespace) -> int:
    """``OUT [--member K]``: the whole ensemble's state dict, or member K as a plain model's."""
    from sigmanens_dist.atomic import torch_save  # here, not at the top: `--help` answers without torch
    from sigmanens_dist.checkpoint import consolidated_state_dict, resolve_checkpoint
    from sigmanens_dist.export import load_model
    from sigmanens_dist.training.run_lock import own_run_containing

    checkpoint, which = resolve_checkpoint(args.checkpoint, "checkpoint")
    _check_out(args.out, checkpoint, args.force)
    lock = own_run_containing(args.out, "export")
    try:
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
        torch_save(weights, args.out)
    finally:
        if lock is not None:
            lock.release()
    print(f"wrote {len(weights)} tensors to {args.out}")
    return 0


def _usage(message: str) -> int:
    """A user's mistake: one line, exit 2."""
    print(f"sigmanens export: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _check_out(out: Path, checkpoint: Path, force: bool) -> None:
    """Refuse, before anything is loaded, an ``out`` whose writing would lose something: the checkpoint being
    exported (a file, or anything inside a checkpoint folder; ``--force`` cannot ask for that), a folder, a file
    already there without ``--force``; and one whose folder is missing (a typo, not a folder to create), is (or is
    under) a file or cannot be written."""
    if checkpoint.is_dir() and out.resolve().is_relative_to(checkpoint.resolve()):
        raise UsageError(f"OUT {out} is inside the checkpoint folder being exported ({checkpoint}); write it elsewhere")
    if out.exists() and os.path.samefile(out, checkpoint):
        raise UsageError(f"OUT {out} is the checkpoint being exported; write it elsewhere")
    if out.is_dir():
        raise UsageError(f"OUT {out} is a folder; give the file to write, e.g. {out / 'model.pt'}")
    check_writable_folder(out.parent, f"OUT {out}: its folder ")
    if not out.parent.is_dir():
        raise UsageError(f"OUT {out}: its folder {out.parent} does not exist")
    if out.exists() and not force:
        raise UsageError(f"OUT {out} already exists; pass --force to replace it")
