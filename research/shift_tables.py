"""The validation-shift tables of docs/results.md "Under shift" (issue 45), from the evaluations
`research/long_shift.sh choose` kept: every choice under shift is made here, on the validation split under the
validation corruptions, before the test set is read.

    python research/shift_tables.py choose [--evals results/shift_long/val]

Per run family (single, σN-Ens at each τ) and normalization statistics (each member's training statistics, or the
prediction batch's): clean accuracy, NLL and ECE (temperature scaled where the evaluation fitted a temperature: at the
long budget, on the calibration split), then under shift (the mean over the validation corruptions at the
evaluated severities) accuracy, NLL, ECE, member disagreement, mutual information and the AUROC of telling corrupted
from clean inputs by mutual information; mean ± std over seeds. Then the paired differences with 95 % t intervals:
batch − training statistics for each family, and σN-Ens − single model at each kind of statistics.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from posthoc_tables import mean_std
from scipy import stats

from sigmanens_dist.experiments.compare.report import difference_text

ROOT = Path(__file__).resolve().parent.parent / "results" / "shift_long" / "val"
FAMILIES = {"single": "single model", "sigma_t025": "σN-Ens M=4, τ=0.25", "sigma": "σN-Ens M=4, τ=0.5",
            "sigma_t1": "σN-Ens M=4, τ=1"}
NORMS = {"train": "training statistics", "batch": "batch statistics"}
CLEAN = {"acc": "accuracy", "nll": "NLL", "ece": "ECE"}
SHIFT = {"acc": "acc shift", "nll": "NLL shift", "ece": "ECE shift", "disagreement": "disagreement shift",
         "mutual_information": "MI shift", "mi_auroc": "MI AUROC"}

Scores = dict[str, float | None]
Runs = dict[tuple[str, str], dict[int, Scores]]  # (family, norm) → seed → scores


def scores(report: dict[str, Any]) -> Scores:
    """Clean scores and the shift means (over the evaluated severities) of one eval.json's raw weights: accuracy, NLL
    and ECE temperature scaled where the evaluation fitted a temperature, the member diagnosis as the members give
    it."""
    part = report["weights"]["raw"]
    scaled = part.get("calibration", part)
    out: Scores = {k: float(scaled["metrics"][k]) for k in CLEAN}
    for key in SHIFT:
        source = scaled if key in CLEAN else part
        values = [m.get(key) for m in source["shift"]["mean"].values()]
        out[f"shift/{key}"] = None if any(v is None for v in values) else float(np.mean(values))
    return out


def load(folder: Path) -> Runs:
    runs: Runs = {}
    for path in sorted(folder.glob("*_s*_*/eval.json")):
        study, norm = path.parent.name.rsplit("_", 1)
        family, seed = study.rsplit("_s", 1)
        report = json.loads(path.read_text())
        if report.get("shift_split") != "val" or report.get("split") != "val":
            raise SystemExit(f"{path}: split {report.get('split')}, shift split {report.get('shift_split')}; the "
                             "choices are made on the validation split under the validation shift only")
        runs.setdefault((family, norm), {})[int(seed)] = scores(report)
    if not runs:
        raise SystemExit(f"{folder}: no <family>_s<seed>_<norm>/eval.json (bash research/long_shift.sh choose)")
    return runs


def cell(values: list[float | None]) -> str:
    return "—" if any(v is None for v in values) else mean_std(values, 4)  # type: ignore[arg-type]


def choose_table(runs: Runs) -> str:
    heads = list(CLEAN.values()) + list(SHIFT.values())
    lines = ["| run | statistics | " + " | ".join(heads) + " |", "|---|---|" + "---:|" * len(heads)]
    for family, label in FAMILIES.items():
        for norm, norm_label in NORMS.items():
            seeds = runs.get((family, norm))
            if not seeds:
                continue
            keys = list(CLEAN) + [f"shift/{k}" for k in SHIFT]
            cells = [cell([s[k] for s in seeds.values()]) for k in keys]
            lines.append(f"| {label} ({len(seeds)}) | {norm_label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired(a: dict[int, Scores], b: dict[int, Scores], key: str) -> str:
    seeds = sorted(a.keys() & b.keys())
    d = np.array([a[s][key] - b[s][key] for s in seeds])  # type: ignore[operator]
    if len(d) < 2:
        return "—"
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    lo, hi = float(d.mean()) - half, float(d.mean()) + half
    text = difference_text(float(d.mean()), lo, hi, len(d))
    return f"**{text}**" if lo * hi > 0 else text


def difference_table(runs: Runs) -> str:
    keys = {"nll": "NLL", "ece": "ECE", "shift/nll": "NLL shift", "shift/ece": "ECE shift"}
    lines = ["| paired | " + " | ".join(keys.values()) + " |", "|---|" + "---:|" * len(keys)]
    for family, label in FAMILIES.items():
        a, b = runs.get((family, "batch")), runs.get((family, "train"))
        if a and b:
            lines.append(f"| {label}: batch − training statistics | "
                         + " | ".join(paired(a, b, k) for k in keys) + " |")
    for family, label in FAMILIES.items():
        for norm, norm_label in NORMS.items():
            a, b = runs.get((family, norm)), runs.get(("single", norm))
            if family != "single" and a and b:
                lines.append(f"| {label} − single model, {norm_label} | "
                             + " | ".join(paired(a, b, k) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["choose"])
    ap.add_argument("--evals", type=Path, default=ROOT)
    runs = load(ap.parse_args().evals)
    print(choose_table(runs), difference_table(runs), sep="\n\n")


if __name__ == "__main__":
    main()
