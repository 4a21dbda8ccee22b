"""``sigmanens eval --checkpoint CKPT [options]``: score a checkpoint on its held-out test set (see docs/eval.md).

    sigmanens eval --checkpoint runs/x/checkpoints/best.pt
    sigmanens eval --checkpoint best.pt --corruptions all --severities 1-5 --ood digits --members 2
    sigmanens eval --checkpoint best.pt --data root=/data/cifar10 --ood svhn --ood-root /data/svhn
    sigmanens eval --checkpoint best.pt --calibration temperature --conformal 0.1 --corruptions all
    sigmanens eval --checkpoint best.pt --shift-split val --corruptions all --severities 3,5   # for choices
    sigmanens eval --checkpoint best.pt --shift-split val --corruptions all --calibration temperature  # calib_split
    sigmanens eval --checkpoint best.pt --norm-stats batch --calibration member-temperature --corruptions all
    sigmanens eval --checkpoint best.pt --corruptions all --shift-batches mixed --batch-size 8 --norm-stats batch \
        --norm-stats-prior 16     # the shift as a deployment's batches mix it

Writes eval.json, eval.md and PNG plots into --out (default: eval_<checkpoint name>/ beside the checkpoint) and logs
them to the MLflow run that wrote the checkpoint. Under torchrun every rank scores its share of each pass (every
sample exactly once) and rank 0 writes the report:

    torchrun --nproc_per_node 8 -m sigmanens_dist.cli eval --checkpoint best.pt --corruptions all
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sigmanens_dist.catalog.corruption_table import CORRUPTIONS, SEVERITIES, SHIFT_SPLITS, unknown
from sigmanens_dist.cli.options import add_norm_stats_options, parse_alphas, parse_prior
from sigmanens_dist.config import Config, EvalConfig, choices, from_options
from sigmanens_dist.errors import EXIT_UNAVAILABLE, EXIT_USAGE, UnavailableError, UsageError

__all__ = ["main", "parse_corruptions", "parse_severities"]


def parse_severities(text: str) -> list[int]:
    """``1-5``, ``3`` or ``1,3,5``; an error naming the allowed values otherwise."""
    try:
        if "-" in text:
            lo, hi = (int(v) for v in text.split("-", 1))
            values = list(range(lo, hi + 1))
        else:
            values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v not in SEVERITIES for v in values):
        raise UsageError(f"--severities {text!r}: give severities in 1..5 as a range (1-5) or a list (1,3,5)")
    return values


def parse_corruptions(text: str | None) -> list[str]:
    """``all`` or comma-separated names from :data:`CORRUPTIONS`."""
    if text is None:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in (*CORRUPTIONS, "all")]
    if bad or not names:
        raise UsageError(f"--corruptions {text!r}: {unknown(bad)}")
    return ["all"] if "all" in names else names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sigmanens eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True,
                    help="step_N.pt / best.pt or a step folder of a training run, or its run directory (its best "
                         "checkpoint, else its newest)")
    ap.add_argument("--data", nargs="+", default=[], metavar="KEY=VALUE",
                    help="overrides of the checkpoint's data config, e.g. root=/data/cifar10 test_subset=1000")
    ap.add_argument("--split", choices=choices(EvalConfig, "split"),
                    help="the split scored clean and corrupted (default: --shift-split's, else test)")
    ap.add_argument("--shift-split", choices=choices(EvalConfig, "shift_split"),
                    help="test: the test corruptions on the test split (default); val: the validation corruptions on "
                         "the validation split, for choices; the test split is then never read")
    ap.add_argument("--corruptions", help=f"all, or a comma-separated subset of the shift split's: test "
                                          f"{', '.join(SHIFT_SPLITS['test'])}; val {', '.join(SHIFT_SPLITS['val'])}")
    ap.add_argument("--severities", default="1-5", help="1-5, or a list such as 1,3,5 (default 1-5)")
    ap.add_argument("--imagenet-c", type=Path, help="a pre-generated ImageNet-C folder (corruption/severity/class)")
    ap.add_argument("--ood", help="OOD set: digits (Fashion-MNIST models), svhn (CIFAR models)")
    ap.add_argument("--ood-root", type=Path, help="folder of the OOD set's files (svhn: test_32x32.mat)")
    ap.add_argument("--members", type=int, help="score the first K members (default: all M)")
    ap.add_argument("--no-sub-ensembles", action="store_true",
                    help="score only the K-member ensemble, not k = 1..K-1 (each is one more pass of the eval set)")
    ap.add_argument("--calibration", choices=choices(EvalConfig, "calibration"), default="none",
                    help="temperature: fit one temperature on the calibration split (a run trained with "
                         "data.calib_split), else the validation split, report every metric before and after (the "
                         "scored split and shift); member-temperature: also one temperature per member (each on "
                         "its own NLL there, applied before averaging), reported beside the one")
    add_norm_stats_options(ap)
    ap.add_argument("--shift-batches", choices=choices(EvalConfig, "shift_batches"), default="per-corruption",
                    help="per-corruption: each corruption × severity scored in its own batches (default); mixed: "
                         "every corruption × severity and the clean images in one stream shuffled under the run's "
                         "seed, scored in batches of --batch-size, as a service or a batch job meets them (with "
                         "--norm-stats batch this is what the batch statistics see)")
    ap.add_argument("--conformal", metavar="ALPHA",
                    help="split conformal sets (thr, aps, raps) calibrated where --calibration fits, at miscoverage "
                         "ALPHA in (0, 1), e.g. 0.1, or several (0.1,0.05): coverage and mean set size, clean, under "
                         "shift and per class")
    ap.add_argument("--stream-images", type=Path, metavar="DIR",
                    help="with --shift-batches mixed: also write the stream's images into DIR (new or empty) as PNG "
                         "files whose sorted order is the stream's, with stream.csv (label, corruption, severity), "
                         "to replay it through a deployment (sigmanens predict DIR --batch-size B)")
    ap.add_argument("--batch-size", type=int, help="default: the run's train.batch_size")
    ap.add_argument("--out", type=Path, help="output folder (default: eval_<checkpoint name>/ beside it)")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log to the run's MLflow run")
    ap.add_argument("--device", help="default: cuda if available, else cpu; one process only (under torchrun each "
                                      "rank uses its own: cuda:LOCAL_RANK or cpu)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        return _run(args)
    except (UsageError, UnavailableError) as err:  # anything else is not the user's: it keeps its traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"sigmanens eval: error: {err}", file=sys.stderr)
        return EXIT_USAGE if isinstance(err, UsageError) else EXIT_UNAVAILABLE


#: the data keys that choose which pool samples the calibration split holds (data/raw.py: split_indices)
_CALIB_SPLIT_KEYS = ("train_subset", "val_split", "split_seed", "calib_split")


def _check_split_overrides(given: list[str], trained: Config, cfg: Config) -> None:
    """The calibration split is carved when the run trains: set at eval, or moved by changing the keys that carve
    it, it would hold samples the model was trained on, and the post-hoc fit would read them. ``given``: the --data
    texts; ``trained``, ``cfg``: the run's config without and with them. A key given its trained value moves
    nothing."""
    last = {text.split("=", 1)[0].strip().removeprefix("data."): text for text in given}  # the one that counts
    calib_split = trained.data.calib_split
    for key in _CALIB_SPLIT_KEYS:
        before = getattr(trained.data, key)
        if key in last and getattr(cfg.data, key) != before and (key == "calib_split" or calib_split):
            this_run = f"data.calib_split={calib_split}" + ("" if key == "calib_split" else f", data.{key}={before}")
            raise UsageError(f"--data {last[key]}: the calibration split is carved from the training pool when the "
                             f"run trains (this run: {this_run}); data.{key} cannot change at eval, or the fit would "
                             "read training samples: train with data.calib_split=N to fit on one")


def _run(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `sigmanens eval --help` answers without it

    from sigmanens_dist.atomic import check_writable_folder
    from sigmanens_dist.checkpoint import resolve_checkpoint
    from sigmanens_dist.evaluation.run import check_options, run_eval
    from sigmanens_dist.models import load_trained
    from sigmanens_dist.training.run_lock import own_run_containing

    # Everything that can be checked without the checkpoint first, then the checkpoint, then the rest: all before
    # the first forward pass.
    # the options are checked by EvalConfig's own validators, as a config's eval section is; --split defaults to
    # --shift-split's, and --shift-split to --split's (EvalConfig.shift)
    options = from_options(
        EvalConfig, split=args.split or args.shift_split or "test", shift_split=args.shift_split,
        corruptions=parse_corruptions(args.corruptions), severities=parse_severities(args.severities),
        ood=args.ood, ood_root=args.ood_root, members=args.members, sub_ensembles=not args.no_sub_ensembles,
        batch_size=args.batch_size, imagenet_c=args.imagenet_c, calibration=args.calibration,
        conformal=parse_alphas(args.conformal), norm_stats=args.norm_stats,
        norm_stats_prior=parse_prior(args.norm_stats_prior, args.norm_stats), shift_batches=args.shift_batches)
    overrides = [kv if kv.startswith("data.") else f"data.{kv}" for kv in args.data]
    checkpoint, which = resolve_checkpoint(args.checkpoint, "--checkpoint")
    out = args.out or checkpoint.parent / f"eval_{checkpoint.stem}"
    check_writable_folder(out, "--out ")  # before the model is built
    if args.stream_images is not None:
        from sigmanens_dist.evaluation.mixed import check_stream_folder

        if args.shift_batches != "mixed":
            raise UsageError(f"--stream-images {args.stream_images}: writes the stream of --shift-batches mixed "
                             f"(this run: {args.shift_batches})")
        check_stream_folder(args.stream_images)
    logging.getLogger("sigmanens").info("evaluating %s", which)
    loaded = load_trained(checkpoint, overrides,
                           check_overrides=lambda trained, cfg: _check_split_overrides(args.data, trained, cfg))
    cfg = loaded.cfg
    if args.no_mlflow:
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"enabled": False})})
    check_options(cfg, loaded.model, options)
    env = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: shard every pass over the ranks
        from sigmanens_dist.distributed.env import init_distributed

        env = init_distributed()
    device = env.device if env is not None else torch.device(
        args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = loaded.model.to(device)
    ema = loaded.ema.to(device) if loaded.ema is not None else None
    lock = own_run_containing(out / "eval.json", "eval", env)  # the default --out is beside the checkpoint
    stream_lock = None
    try:
        if args.stream_images is not None and (env is None or env.world_size == 1):  # run_eval refuses it on ranks
            from sigmanens_dist.evaluation.mixed import claim_stream_folder  # here: only --stream-images needs it

            stream_lock = claim_stream_folder(args.stream_images)
        report = run_eval(cfg, model, ema, options, out_dir=out, run_id=loaded.run_id, step=loaded.step,
                          checkpoint=checkpoint.resolve(), env=env, stream_images=args.stream_images)
    finally:
        for held in (stream_lock, lock):
            if held is not None:
                held.release()
    if env is None or env.is_main:
        from sigmanens_dist.evaluation.summary import summary, written  # eval.md keeps every table

        print(summary(report))
        print()
        print(written(out))
    return 0

