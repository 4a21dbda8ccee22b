"""Where σN-Ens's shift NLL comes from (docs/results.md "Under shift", issue 45): per corruption, per method and seed,
from the evaluations the long runs kept, so the diagnosis is rebuilt from files rather than copied by hand:

    python research/shift_diagnosis.py [--evals results/posthoc_long/evals] [--collapse 0.4]

Prints, on the temperature-scaled probabilities (severities 3 and 5 averaged, as the shift columns of the post-hoc
tables): the test NLL of every corruption for every method and seed; the mean over all corruptions, over the
corruptions that collapse accuracy (the accuracy averaged over every method and seed under --collapse: there
predictions are near chance and NLL measures mostly overconfidence) and over the rest; and the paired
σN-Ens − single and σN-Ens − Deep differences of those three means with 95 % t intervals. The collapsing set is
found from the data, not named by hand.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import numpy as np
from posthoc_tables import METHODS, ROOT, SEVERITIES, load
from scipy import stats

from sigmanens_dist.experiments.compare.report import difference_text

Runs = dict[str, dict[int, dict[str, Any]]]


def per_corruption(part: dict[str, Any], key: str) -> dict[str, float]:
    """corruption → ``key`` averaged over the severities, after temperature scaling."""
    shift = part["calibration"]["shift"]
    return {c: float(np.mean([shift[c][s][key] for s in SEVERITIES])) for c in shift if c != "mean"}


def collapsing(runs: Runs, threshold: float) -> list[str]:
    """The corruptions whose accuracy, averaged over every method and seed, is below ``threshold``."""
    accs = [per_corruption(p, "acc") for seeds in runs.values() for p in seeds.values()]
    return [c for c in accs[0] if np.mean([a[c] for a in accs]) < threshold]


def nll_table(runs: Runs, hard: list[str]) -> str:
    methods = [m for m in METHODS if m in runs]
    head = [f"{m} s{s}" for m in methods for s in sorted(runs[m])]
    lines = ["| corruption | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    nll = {m: {s: per_corruption(runs[m][s], "nll") for s in runs[m]} for m in methods}
    names = list(next(iter(next(iter(nll.values())).values())))
    for c in names:
        mark = " (collapses)" if c in hard else ""
        lines.append(f"| {c}{mark} | " + " | ".join(f"{nll[m][s][c]:.3f}" for m in methods for s in sorted(nll[m]))
                     + " |")
    easy = [c for c in names if c not in hard]
    for label, subset in (("mean, all", names), ("mean, collapsing", hard), ("mean, the rest", easy)):
        if subset:
            lines.append(f"| **{label}** | " + " | ".join(
                f"{np.mean([nll[m][s][c] for c in subset]):.3f}" for m in methods for s in sorted(nll[m])) + " |")
    return "\n".join(lines)


def paired_means(runs: Runs, method: str, reference: str, hard: list[str]) -> str:
    seeds = sorted(runs.get(method, {}).keys() & runs.get(reference, {}).keys())
    names = list(per_corruption(runs[method][seeds[0]], "nll"))
    subsets = {"all": names, "collapsing": hard, "the rest": [c for c in names if c not in hard]}
    lines = [f"| {METHODS[method]} − {METHODS[reference]}, NLL | " + " | ".join(subsets) + " |",
             "|---|" + "---:|" * len(subsets)]
    cells = []
    for subset in subsets.values():
        d = np.array([np.mean([per_corruption(runs[method][s], "nll")[c] - per_corruption(runs[reference][s], "nll")[c]
                               for c in subset]) for s in seeds]) if subset else np.array([])
        if len(d) < 2:
            cells.append("—")
            continue
        half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
        cells.append(difference_text(float(d.mean()), float(d.mean()) - half, float(d.mean()) + half, len(d)))
    lines.append(f"| {len(seeds)} paired seeds | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--evals", type=Path, default=ROOT)
    ap.add_argument("--collapse", type=float, default=0.4,
                    help="mean accuracy under which a corruption counts as collapsing (default 0.4)")
    args = ap.parse_args()
    runs = load(args.evals)
    hard = collapsing(runs, args.collapse)
    print(f"collapsing corruptions (mean accuracy over methods and seeds < {args.collapse}): "
          f"{', '.join(hard) or 'none'}\n")
    print(nll_table(runs, hard))
    for reference in ("single", "deep"):
        if "sigma" in runs and reference in runs:
            print()
            print(paired_means(runs, "sigma", reference, hard))


if __name__ == "__main__":
    main()
