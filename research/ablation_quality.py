"""Issue 10's ablation: which σN-Ens recipe knob closes the gap to a single model, with paired seeds.

Every run goes through the normal trainer (``python -m sigmanens_dist.train --config configs/demo.yaml …``, one
process, ``tracking.enabled=false``) with the budget overrides below plus the arm's overrides, in
``<runs>/<arm>/seed<k>``. Runs are resumable at two levels: a finished run (``final_metrics.json``) is skipped, an
interrupted one continues from its last checkpoint (``checkpoint.resume=auto``). Each finished run becomes one row of
the CSV (``results/quality_ablation.csv``); the summary pairs arms with the single model by seed (same ``seed``, so
the same init and data order for the shared weights) and prints the mean and 95 % t-interval of the paired difference.

    python research/ablation_quality.py                 # run what is missing, then summarise
    python research/ablation_quality.py --summary-only  # only the table, from the CSV
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from scipy import stats  # installed with scikit-learn, a dependency

ROOT = Path(__file__).resolve().parents[1]

# The budgets (docs/quality.md says why). "small": timm's test_resnet (0.37M parameters, BatchNorm, residual blocks),
# 120 steps of 32 images from the first 12k training images (a third of an epoch), scored on the first 2000 test
# images. "resnet10t": ResNet-10t, 1500 steps of 64 (8 epochs of the 12k), scored on the 10k test images. "vit": a
# LayerNorm backbone (timm's test_vit at 28 px, 4 px patches: 49 tokens, 6 blocks) with AdamW, 1000 steps of 32,
# scored on the 10k test images, so the conclusion is not a BatchNorm artefact.
COMMON = ["train.eval_every_steps=null", "tracking.enabled=false", "data.num_workers=0", "eval.at_end=false",
          # scored on the test set, as the first grid in results/ was (it ran before the loop had a validation split)
          "data.val_split=0", "data.val_from_test=true"]
BUDGETS: dict[str, list[str]] = {
    "small": ["model.name=test_resnet", "train.max_steps=120", "train.batch_size=32", "data.train_subset=12000",
              "data.val_subset=2000", "schedule.warmup_steps=10", "checkpoint.every_steps=40", *COMMON],
    "resnet10t": ["model.name=resnet10t", "train.max_steps=1500", "train.batch_size=64",
                  "data.train_subset=12000", "data.val_subset=10000", "schedule.warmup_steps=50",
                  "checkpoint.every_steps=250", *COMMON],
    "vit": ["model.name=test_vit", "model.kwargs.img_size=28", "model.kwargs.patch_size=4", "optim.name=adamw",
            "optim.lr=0.001", "optim.weight_decay=0.05", "train.max_steps=1000", "train.batch_size=32",
            "data.train_subset=12000", "data.val_subset=10000", "schedule.warmup_steps=50",
            "checkpoint.every_steps=250", *COMMON],
}
LAM0 = ["reg.lambda=0"]
INIT_ON = ["model.gamma_init_mean=3", "model.gamma_init_std=0.1", "model.affine_init=plain"]
# Before the knobs existed the demo recipe was τ=0.25, λ=0.01 with these defaults; spelt out so the arm keeps
# meaning "yesterday's recipe" whatever the defaults become.
TODAY = ["reg.tau=0.25", "reg.lambda=0.01", "reg.normalize=none", "train.member_loss=mean", "optim.sigma_lr_scale=1",
         "model.gamma_init_mean=0", "model.gamma_init_std=1", "model.affine_init=divide",
         "model.member_batches=shared"]
ARMS: dict[str, list[str]] = {
    "single": ["model.method=single"],
    "sigma_today": TODAY,
    "sigma_lam0": TODAY + LAM0,
    "lam0+sum": TODAY + LAM0 + ["train.member_loss=sum"],
    "lam0+sigma_lr_x4": TODAY + LAM0 + ["optim.sigma_lr_scale=4"],
    "lam0+init_on": TODAY + LAM0 + INIT_ON,
    "lam0+independent": TODAY + LAM0 + ["model.member_batches=independent"],
    "lam0+combo": TODAY + LAM0 + ["optim.sigma_lr_scale=4", "model.member_batches=independent"] + INIT_ON,
}
# Run after the equal-epoch grid: the single model given M=4 times the steps (equal training compute).
# Then the best σ arm with the regulariser back on: today's τ=0.25 and the pull on each γ of today's λ=0.01 at M=4
# (λ=0.04 with reg.normalize=members, whose L_div is the sum / M).
def late_arms(budget: list[str]) -> dict[str, list[str]]:
    """The arms run after the equal-epoch grid; the equal-compute arm's steps follow the budget's."""
    steps = next(int(o.split("=", 1)[1]) for o in budget if o.startswith("train.max_steps="))
    return {"single_x4_steps": ["model.method=single", f"train.max_steps={4 * steps}"],
            "combo+reg": ARMS["lam0+combo"] + ["reg.tau=0.25", "reg.lambda=0.04", "reg.normalize=members"]}

BASELINE = "single"
METRICS = ["acc", "nll", "ece", "brier", "disagreement", "sharing/members_on", "member_mean_acc"]


def run_one(arm: str, overrides: list[str], seed: int, runs: Path, python: str,
            budget: list[str]) -> dict[str, str] | None:
    """Train one (arm, seed) unless it already finished; its CSV row, or None if the trainer failed."""
    run_dir = runs / arm / f"seed{seed}"
    final = run_dir / "final_metrics.json"
    wall = run_dir / "wall_seconds.txt"
    if not final.is_file():
        cmd = [python, "-m", "sigmanens_dist.train", "--config", "configs/demo.yaml", *budget, *overrides,
               f"seed={seed}", f"run_dir={run_dir}", "checkpoint.resume=auto"]
        print(f"[{time.strftime('%H:%M:%S')}] {arm} seed {seed}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        log = run_dir.with_suffix(".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:
            rc = subprocess.call(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        if rc != 0:
            print(f"  failed with status {rc}; see {log}", flush=True)
            return None
        previous = float(wall.read_text()) if wall.is_file() else 0.0  # a resumed run adds to its earlier time
        wall.write_text(f"{previous + time.perf_counter() - start:.1f}")
    metrics = json.loads(final.read_text())
    members = [metrics[f"member{i}/acc"] for i in range(16) if f"member{i}/acc" in metrics]
    metrics["member_mean_acc"] = sum(members) / len(members) if members else metrics["acc"]
    row = {"arm": arm, "seed": str(seed), "overrides": " ".join(overrides),
           "wall_s": wall.read_text() if wall.is_file() else ""}
    row.update({k: f"{metrics[k]:.6g}" for k in METRICS if k in metrics})
    row["train_img_per_s"] = f"{metrics['train_img_per_s']:.1f}"
    return row


def write_csv(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ["arm", "seed", *METRICS, "train_img_per_s", "wall_s", "overrides"]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def paired(diffs: list[float]) -> str:
    """Mean ± half-width of the 95 % t-interval of paired differences (n−1 degrees of freedom)."""
    n = len(diffs)
    mean = sum(diffs) / n
    if n < 2:
        return f"{mean:+.4f} (n=1)"
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    return f"{mean:+.4f} ± {stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n):.4f}"


def _mean(rows: list[dict[str, str]], key: str) -> str:
    vals = [float(r[key]) for r in rows if r.get(key)]
    return f"{sum(vals) / len(vals):.4f}" if vals else "—"


def _delta(by: dict[tuple[str, int], dict[str, str]], arm: str, seeds: list[int], key: str) -> str:
    common = [s for s in seeds if (BASELINE, s) in by]
    if arm == BASELINE or not common:
        return "—"
    return paired([float(by[(arm, s)][key]) - float(by[(BASELINE, s)][key]) for s in common])


def summary(rows: list[dict[str, str]]) -> str:
    """Markdown table: per arm, mean of each metric and the paired difference vs the single model."""
    by = {(r["arm"], int(r["seed"])): r for r in rows}
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    lines = ["| arm | n | acc | Δacc vs single | NLL | ΔNLL vs single | ECE | ΔECE vs single | disagreement | "
             "member acc | members on | wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        seeds = sorted(s for a, s in by if a == arm)
        mine = [by[(arm, s)] for s in seeds]
        cells = [arm, str(len(seeds))]
        for key in ("acc", "nll", "ece"):
            cells += [_mean(mine, key), _delta(by, arm, seeds, key)]
        cells += [_mean(mine, k) for k in ("disagreement", "member_mean_acc", "sharing/members_on", "wall_s")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds 0..N-1 per arm")
    parser.add_argument("--arms", nargs="*", help="only these arms (default: all, then the equal-compute arms)")
    parser.add_argument("--budget", choices=list(BUDGETS), default="small",
                        help="the training budget every arm runs at (see BUDGETS)")
    parser.add_argument("--runs", type=Path, help="default: runs/quality_ablation[_<budget>]")
    parser.add_argument("--csv", type=Path, help="default: results/quality_ablation[_<budget>].csv")
    parser.add_argument("--summary-only", action="store_true")
    args = parser.parse_args()
    suffix = "" if args.budget == "small" else f"_{args.budget}"
    args.runs = args.runs or ROOT / "runs" / f"quality_ablation{suffix}"
    args.csv = args.csv or ROOT / "results" / f"quality_ablation{suffix}.csv"
    budget = BUDGETS[args.budget]
    late = late_arms(budget)
    every = {**ARMS, **late}
    unknown = sorted(set(args.arms or []) - every.keys())
    if unknown:
        parser.error(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(every)}")
    if args.summary_only:
        with args.csv.open() as f:
            print(summary(list(csv.DictReader(f))))
        return 0
    chosen = args.arms or list(every)
    # Seed-major order: every arm gets seed 0 before any gets seed 1, so a partial grid is still paired.
    plan = [(arm, seed) for group in (ARMS, late) for seed in range(args.seeds)
            for arm in group if arm in chosen]
    # Rows of runs outside this plan (other arms or seeds, run earlier) stay in the CSV.
    rows: dict[tuple[str, str], dict[str, str]] = {}
    if args.csv.is_file():
        with args.csv.open() as f:
            rows = {(r["arm"], r["seed"]): r for r in csv.DictReader(f)}
    done = 0
    for arm, seed in plan:
        row = run_one(arm, every[arm], seed, args.runs, sys.executable, budget)
        if row is not None:
            rows[(arm, str(seed))] = row
            write_csv(list(rows.values()), args.csv)
            done += 1
    print(summary(list(rows.values())))
    return 0 if done == len(plan) else 1


if __name__ == "__main__":
    sys.exit(main())
