"""Calibration under shift over every corruption, for the long-budget runs (issue 18, docs/results.md "Long budget").

    python research/shift_all_corruptions.py                    # runs/repro_long, 2,000 test images, severities 3, 5
    python research/shift_all_corruptions.py --root runs/repro_long --test-subset 2000 \
        --out results/repro_long/shift_all

The long budget scores shift on two corruptions (Gaussian noise and contrast, the recipe's ``eval.corruptions``), and
contrast alone fails every model (accuracy ~0.2 at severity 3 on Fashion-MNIST), so "ECE under shift" there is
mostly one corruption's ECE and varies by ±0.05 across seeds. This re-scores each finished run's best checkpoint with
``sigmanens eval --corruptions all`` at severities 3 and 5 (the first ``--test-subset`` test images; the run's
MLflow record is left alone: ``--no-mlflow``, output in ``<run>/eval_shift_all/``; runs already scored are skipped,
so the script resumes) and writes a table of ECE / NLL / accuracy under shift (mean over the corruptions and both
severities) per grid point, with the paired difference against the single model (same seed) and its 95 % t
interval — the same statistics as ``sigmanens compare``. The kept results (results/repro_long/shift_all) used the
16 corruptions ``all`` meant at the time; ``--corruptions all`` now means the 14 test corruptions (the validation ones,
``SHIFT_SPLITS["val"]``, are never scored on the test split), so a re-run's means are over 14 and not comparable to
the digit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from sigmanens_dist.experiments.compare import Group, RunRecord, method_variant, paired_difference
from sigmanens_dist.methods import METHODS

REPO = Path(__file__).resolve().parents[1]
SEVERITIES = ("3", "5")
SCORES = ("ece", "nll", "acc")
_SEED = re.compile(r"^(?P<point>.+)-s(?P<seed>\d+)$")


def finished_runs(root: Path, experiment: str) -> list[Path]:
    """Run folders under ``root/<study>/`` that finished (``final_metrics.json``) in ``experiment``."""
    runs = []
    for final in sorted(root.glob("*/*/final_metrics.json")):
        cfg = yaml.safe_load((final.parent / "config.yaml").read_text())
        if cfg["tracking"]["experiment"] == experiment:
            runs.append(final.parent)
    return runs


def score(run: Path, test_subset: int) -> Path:
    """``sigmanens eval`` of the run's best checkpoint on every corruption; returns its eval.json."""
    out = run / "eval_shift_all"
    if (out / "eval.json").is_file():
        return out / "eval.json"
    cmd = ["nice", "-n", os.environ.get("SIGMANENS_REPRO_NICE", "19"), sys.executable, "-m",
           "sigmanens_dist.cli", "eval", "--checkpoint", str(run), "--data", f"test_subset={test_subset}",
           "--corruptions", "all", "--severities", ",".join(SEVERITIES), "--no-sub-ensembles", "--no-mlflow",
           "--out", str(out)]
    begin = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{run}: sigmanens eval failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  scored {run.parent.name}/{run.name} in {time.time() - begin:.0f} s", flush=True)
    return out / "eval.json"


def shift_scores(eval_json: Path) -> dict[str, float]:
    """Mean over corruptions and ``SEVERITIES`` of each score, plus how many (corruption, severity) pairs."""
    shift = json.loads(eval_json.read_text())["weights"]["raw"]["shift"]
    cells = [by_sev[s] for name, by_sev in shift.items() if name != "mean"  # eval's own mean over corruptions
             for s in SEVERITIES if s in by_sev]
    out = {f"{k}_shift": float(np.mean([c[k] for c in cells])) for k in SCORES}
    out["cells"] = len(cells)
    return out


def point_of(run: Path, point: str) -> str:
    """The run's grid point (its folder name without the seed), with its method's knobs away from their defaults
    (``compare``'s variants), so that two studies of one point under different recipes stay apart."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    method = cfg["model"]["method"]
    params = {}
    for key in METHODS[method].knobs if method in METHODS else {}:
        section, _, name = key.partition(".")
        if name in cfg.get(section, {}):  # a run older than the knob ran at its default
            params[key] = str(cfg[section][name])
    variant = method_variant(method, params)
    return f"{point} ({variant})" if variant else point


def table(runs: list[Path], test_subset: int) -> str:
    groups: dict[str, Group] = {}
    for run in runs:
        m = _SEED.match(run.name)
        if m is None:
            continue
        values = shift_scores(score(run, test_subset))
        point = point_of(run, m["point"])
        group = groups.setdefault(point, Group(point, 0, None, None, 1, {}))
        group.runs[int(m["seed"])] = RunRecord("", run.name, "FINISHED", m["point"], 0, None, None, int(m["seed"]),
                                               values=values)
    single = groups.get("single")
    cells = {int(r.values["cells"]) for g in groups.values() for r in g.runs.values()}
    lines = [f"Shift over all {len(cells) and max(cells) // len(SEVERITIES)} corruptions at severities "
             f"{' and '.join(SEVERITIES)}, first {test_subset:,} test images; mean ± std over seeds; Δ: paired "
             "against the single model of the same seed, 95 % t interval.", "",
             "| run | seeds | ECE shift | NLL shift | acc shift | ΔECE shift [95 % CI] | ΔNLL shift [95 % CI] |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in sorted(groups):
        g = groups[name]
        row = [name, str(len(g.runs))]
        row += [f"{g.mean(c):.4f} ± {g.std(c):.4f}" if len(g.runs) > 1 else f"{g.mean(c):.4f}"
                for c in ("ece_shift", "nll_shift", "acc_shift")]
        for c in ("ece_shift", "nll_shift"):
            if single is None or g is single:
                row.append("")
                continue
            mean, lo, hi, n = paired_difference(g, single, c)
            row.append(f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]" if n > 1 else f"{mean:+.4f} ({n} pair)")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=REPO / "runs" / "repro_long")
    ap.add_argument("--experiment", default="sigmanens-fmnist-small", help="the runs' tracking.experiment")
    ap.add_argument("--test-subset", type=int, default=2000)
    ap.add_argument("--only", default="", help="comma-separated name prefixes to score (default: every run)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "repro_long" / "shift_all")
    args = ap.parse_args()
    runs = finished_runs(args.root, args.experiment)
    if args.only:
        runs = [r for r in runs if r.name.startswith(tuple(args.only.split(",")))]
    if not runs:
        print(f"no finished runs of experiment {args.experiment!r} under {args.root}", file=sys.stderr)
        return 2
    print(f"{len(runs)} runs; scoring the ones not yet scored", flush=True)
    text = table(runs, args.test_subset)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    print(text + f"\nwrote {args.out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
