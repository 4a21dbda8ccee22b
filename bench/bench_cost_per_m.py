"""What each ensemble size costs, per method, beside the M-scaling table's quality (docs/results.md "M-scaling at
convergence"): every number from the trainer and `sigmanens eval` themselves, as the study measured them, but in one
run on a quiet machine, each a ratio to the single model measured in the same run.

    OMP_NUM_THREADS=1 python bench/bench_cost_per_m.py                          # the M-scaling grid, ~7 min on a CPU
    OMP_NUM_THREADS=1 python bench/bench_cost_per_m.py --methods sigma packed2 --members 4 16 --steps 40

Per configuration: the recipe (``--config``, default the M-scaling study's configs/fmnist_small.yaml) trained
``--steps`` steps by ``python -m sigmanens_dist.train`` with the study's knobs (method, M, Packed's α), then its final
checkpoint scored on the test set by the trainer's end-of-run `sigmanens eval` (no shift, no OOD):
- train images/s: the median of the trainer's logged windows after the first two (warm-up excluded);
- ms / image: the full ensemble's forward time over the test set (eval.json's ``ms_per_image``, the table's column);
- parameters: the trainer's count.
The single model is measured first and again last; the spread of the two is the run's noise floor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench_trainer import median_rate

REPO = Path(__file__).resolve().parent.parent
# the M-scaling study's lanes (research/long_m_scaling.sh): method and its knobs, the sizes it is measured at
LANES = {"sigma": ("sigma", [], [1, 2, 4, 8, 16]), "packed2": ("packed", ["model.packed_alpha=2"], [2, 4, 8, 16]),
         "packed3": ("packed", ["model.packed_alpha=3"], [2, 4, 8, 16]), "batch": ("batch", [], [2, 4, 8]),
         "deep": ("deep", [], [2, 4, 8])}


@dataclass
class Cost:
    name: str
    members: int
    img_per_s: float
    ms_per_image: float
    params: float


def measure(args: argparse.Namespace, method: str, members: int, knobs: list[str], out: Path) -> Cost:
    """One short trainer run of the recipe and its end-of-run evaluation; raises with the trainer's stderr."""
    run = out / f"{method}-M{members}-{'-'.join(k.rpartition('=')[2] for k in knobs) or 'x'}"
    steps = args.steps
    cmd = [sys.executable, "-m", "sigmanens_dist.train", "--config", str(args.config), f"run_dir={run}",
           "tracking.enabled=false", f"model.method={method}", f"model.num_members={members}", *knobs,
           f"train.max_steps={steps}", f"train.log_every_steps={args.window}", f"train.eval_every_steps={steps}",
           f"checkpoint.every_steps={steps}", "eval.at_end=true", "eval.corruptions=[]", "eval.ood=null",
           f"data.test_subset={args.test_images}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"trainer run failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    final = json.loads((run / "final_metrics.json").read_text())
    report = json.loads((run / "eval" / "eval.json").read_text())
    ms = report["weights"]["raw"]["sub_ensembles"][-1]["ms_per_image"]
    return Cost(method, members, median_rate(run, steps, args.window), ms, final["params"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "fmnist_small.yaml")
    ap.add_argument("--methods", nargs="+", default=list(LANES), choices=list(LANES))
    ap.add_argument("--members", nargs="+", type=int, default=None,
                    help="keep only these sizes of each method's grid (default: all of them)")
    ap.add_argument("--steps", type=int, default=60, help="training steps per configuration")
    ap.add_argument("--window", type=int, default=10, help="steps per logged (timed) window")
    ap.add_argument("--test-images", type=int, default=2000, help="test images the forward time is taken over")
    args = ap.parse_args()
    if args.steps < 3 * args.window:
        ap.error(f"--steps {args.steps} with --window {args.window} leaves no timed window after the first two "
                 f"(at least {3 * args.window})")
    grid = [(lane, m) for lane in args.methods for m in LANES[lane][2] if args.members is None or m in args.members]
    if not grid:
        ap.error(f"--members {args.members} keeps no size of {args.methods}'s grids "
                 f"({', '.join(f'{lane}: {LANES[lane][2]}' for lane in args.methods)})")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        first = measure(args, "single", 1, [], out / "first")
        rows: list[tuple[str, Cost]] = []
        for i, (lane, m) in enumerate(grid, 1):
            method, knobs, _ = LANES[lane]
            print(f"[{i}/{len(grid)}] {lane} M={m}", file=sys.stderr, flush=True)
            rows.append((lane, measure(args, method, m, knobs, out)))
        last = measure(args, "single", 1, [], out / "last")
    base = Cost("single", 1, (first.img_per_s + last.img_per_s) / 2, (first.ms_per_image + last.ms_per_image) / 2,
                first.params)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"\n{args.config.name}, {args.steps} steps per run, OMP_NUM_THREADS={threads}; ratios to the single model "
          f"of this run (first/last: {first.img_per_s:.0f}/{last.img_per_s:.0f} img/s, "
          f"{first.ms_per_image:.3f}/{last.ms_per_image:.3f} ms/image)")
    print(f"{'method':8s} {'M':>3s} {'train img/s':>12s} {'/ single':>9s} {'ms/image':>9s} {'/ single':>9s} "
          f"{'params':>9s} {'/ single':>9s}")
    for lane, c in [("single", base), *rows]:
        print(f"{lane:8s} {c.members:3d} {c.img_per_s:12.0f} {c.img_per_s / base.img_per_s:8.2f}x "
              f"{c.ms_per_image:9.3f} {c.ms_per_image / base.ms_per_image:8.2f}x {c.params / 1e3:8.0f}k "
              f"{c.params / base.params:8.2f}x")


if __name__ == "__main__":
    main()
