"""``sigmanens study``: a grid of training runs (M-scaling, τ or λ sweep, methods) as one MLflow parent run with one
child run per grid point, resumable, and defined by one file that a Slurm job array can submit unchanged.

    sigmanens study m-scaling --config configs/demo.yaml --members 1,2,4,8 --seeds 0,1,2 --out runs/m_scaling
    sigmanens study run-one --definition runs/m_scaling/study.yaml --index 3     (one child: a Slurm array element)
    sigmanens study resume runs/m_scaling          (continue it as defined, even after its recipe file was edited)

Every grid point is checked with the trainer's own config validation before anything is written or launched. Each
child runs through the normal trainer (``python -m sigmanens_dist.train``, under torchrun with ``--nproc`` > 1) in
``<out>/<child name>``; running the same command again skips finished children and resumes interrupted ones from
their newest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sigmanens_dist.errors import EXIT_USAGE, UsageError
from sigmanens_dist.experiments.study.bookkeeping import ensure_parent, write_definition
from sigmanens_dist.experiments.study.definition import read_definition
from sigmanens_dist.experiments.study.grid import (
    AXES,
    DEFINITION,
    KINDS,
    LAMBDA_POLICIES,
    METHOD_NAMES,
    build_definition,
)
from sigmanens_dist.experiments.study.running import run_one, run_study
from sigmanens_dist.progress import wrap

__all__ = ["main"]

def _list(kind_of: type) -> Any:
    def parse(text: str) -> list[Any]:
        values = []
        for part in text.split(","):
            part = part.strip()
            if kind_of is str:
                values.append(part)
                continue
            try:
                values.append(float(part) if kind_of is float else int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"{part!r} is not {'a number' if kind_of is float else 'an integer'}"
                                                 ) from None
        return values

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s study] %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if argv and argv[0] == "resume":
        ap = argparse.ArgumentParser(prog="sigmanens study resume", description="continue a study from its saved "
                                     "definition (the base config copied beside it, not the recipe as it is now): "
                                     "finished children are skipped, interrupted ones resume")
        ap.add_argument("study", type=Path, help=f"the study folder, or its {DEFINITION}")
        args = ap.parse_args(argv[1:])
        path = args.study / DEFINITION if args.study.is_dir() else args.study
        try:
            definition = read_definition(path)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE
        print(f"study {definition.name}: resuming {len(definition.children)} children from {path}", flush=True)
        return run_study(definition, path)
    if argv and argv[0] == "run-one":
        ap = argparse.ArgumentParser(prog="sigmanens study run-one", description="run one child of a study "
                                     "(a Slurm array element): skip it if finished, resume it if interrupted")
        ap.add_argument("--definition", type=Path, required=True, help=f"the study's {DEFINITION}")
        ap.add_argument("--index", type=int, required=True, help="the child's index (0-based)")
        ap.add_argument("--print-args", action="store_true",
                        help="print the trainer's arguments (one per line) instead of running it")
        args = ap.parse_args(argv[1:])
        try:
            return run_one(args.definition, args.index, print_args=args.print_args)
        except UsageError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_USAGE
    ap = argparse.ArgumentParser(prog="sigmanens study", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=list(KINDS), help="what the study sweeps by default")
    ap.add_argument("--config", type=Path, help="the base YAML recipe every child starts from")
    ap.add_argument("--members", type=_list(int), help="M values, e.g. 1,2,4,8,16")
    ap.add_argument("--taus", type=_list(float), help="τ values, e.g. 0.1,0.25,0.5,1")
    ap.add_argument("--lambdas", type=_list(float), help="λ values (nominal; see --lambda-policy)")
    ap.add_argument("--methods", type=_list(str), help=f"methods, of {', '.join(METHOD_NAMES)}")
    ap.add_argument("--budgets", type=_list(int),
                    help="training-step multipliers (train.max_steps × b), e.g. 1,2,4,8: a single model at b=M has "
                         "the training compute of an M-member ensemble at b=1 (default 1)")
    ap.add_argument("--seeds", type=_list(int), help="seeds (default 0,1,2); the same seeds pair runs across methods")
    ap.add_argument("--nproc", type=int, default=1, help="processes per child (torchrun when > 1)")
    ap.add_argument("--lambda-policy", default="fixed", choices=list(LAMBDA_POLICIES),
                    help="; ".join(f"{k}: {v}" for k, v in LAMBDA_POLICIES.items()))
    ap.add_argument("--max-backbone-batch", type=int,
                    help="most images (batch × M) in one backbone pass; larger ones use more accumulation steps")
    ap.add_argument("--out", type=Path, help="the study folder (default runs/study-<kind>)")
    ap.add_argument("--prepare", action="store_true",
                    help="write the definition and the parent run only (for a Slurm array to run the children)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every child, e.g. train.max_steps=500")
    args = ap.parse_intermixed_args(argv)
    out = args.out or Path("runs") / f"study-{args.kind}"
    try:
        definition = build_definition(args.kind, args.config, {a: getattr(args, a) for a in AXES}, args.overrides,
                                      out, nproc=args.nproc, lambda_policy=args.lambda_policy,
                                      max_backbone_batch=args.max_backbone_batch)
        path = write_definition(definition, args.config)
        definition = read_definition(path)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(wrap(f"study {definition.name}: {len(definition.children)} children, definition {path}") + "\n"
          + wrap(f"λ policy: {definition.lambda_policy_text}; global batch {definition.global_batch} at every M"),
          flush=True)
    if args.prepare:
        ensure_parent(definition, path)
        print(f"prepared; a Slurm array of {len(definition.children)} elements runs it with\n"
              f"  sigmanens study run-one --definition {path} --index $SLURM_ARRAY_TASK_ID")
        return 0
    return run_study(definition, path)
