"""Print docs/results.md's post-hoc calibration tables from the evaluations `research/long_posthoc.sh eval` kept, so
the page is rebuilt from the files rather than copied by hand:

    bash research/long_posthoc.sh train runs/posthoc_long && bash research/long_posthoc.sh eval runs/posthoc_long
    python research/posthoc_tables.py [--evals results/posthoc_long/evals]

Three markdown tables, mean ± std over the seeds (their count in brackets): the test scores of each method before and
after temperature scaling (T with the validation NLL it was fitted to lower; accuracy, NLL, ECE; NLL and ECE under
shift, the mean over every corruption of ``--corruptions all`` at severities 3 and 5 (in the kept evaluations
the 16 of the time; re-run now, the 14 test corruptions); OOD AUROC of the mutual information and of the max
probability, before T); the paired differences σN-Ens − single model and σN-Ens − Deep Ensemble, both temperature
scaled, with 95 % t intervals (bold where the interval excludes 0); conformal coverage (with the lowest and highest
seed's) and mean set size at each α, on the calibrated probabilities.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from sigmanens_dist.experiments.compare.report import difference_text

ROOT = Path(__file__).resolve().parent.parent / "results" / "posthoc_long" / "evals"
METHODS = {"single": "single model", "sigma": "σN-Ens M=4, τ=0.5", "deep": "Deep Ensemble M=4",
           "packed3": "Packed-Ensembles M=4, α=3"}
SEVERITIES = ("3", "5")
COLUMNS = {"acc": "accuracy", "nll": "NLL", "ece": "ECE", "nll_shift": "NLL shift", "ece_shift": "ECE shift"}
PAIRS = (("sigma", "single"), ("sigma", "deep"))

Scores = dict[str, float]


def scores(part: dict[str, Any], calibrated: bool) -> Scores:
    """Test accuracy, NLL, ECE and the shift means of one report part, before or after temperature scaling."""
    source = part["calibration"] if calibrated else part
    out = {k: float(source["metrics"][k]) for k in ("acc", "nll", "ece")}
    shift = source["shift"]["mean"]
    for key in ("nll", "ece"):
        out[f"{key}_shift"] = float(np.mean([shift[s][key] for s in SEVERITIES]))
    return out


def load(folder: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """method → seed → the raw weights' part of its eval.json."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*_s*/eval.json")):
        method, seed = path.parent.name.rsplit("_s", 1)
        runs.setdefault(method, {})[int(seed)] = json.loads(path.read_text())["weights"]["raw"]
    unknown = set(runs) - set(METHODS)
    if unknown or not runs:
        raise SystemExit(f"{folder}: expected evaluations of {', '.join(METHODS)}; found {sorted(runs) or 'none'}")
    return runs


def mean_std(values: list[float], digits: int = 4) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def score_table(runs: dict[str, dict[int, dict[str, Any]]]) -> str:
    lines = ["| method | T | " + " | ".join(COLUMNS.values()) + " | OOD AUROC (MI / MSP) |",
             "|---|---|" + "---:|" * (len(COLUMNS) + 1)]
    for method, label in METHODS.items():
        seeds = runs.get(method, {})
        if not seeds:
            continue
        for calibrated in (False, True):
            per = [scores(part, calibrated) for part in seeds.values()]
            cal = [part["calibration"] for part in seeds.values()]
            before, after = (np.mean([c[k] for c in cal]) for k in ("val_nll_before", "val_nll_after"))
            t = f"{mean_std([c['temperature'] for c in cal], 3)} (val NLL {before:.4f} → {after:.4f})" if calibrated \
                else "1"
            cells = [mean_std([s[k] for s in per]) for k in COLUMNS]
            mi = ("—" if method == "single" else  # one network has no mutual information: AUROC 0.5 by construction
                  mean_std([p["ood"]["mutual_information"]["auroc"] for p in seeds.values()], 3))
            ood = "" if calibrated else f"{mi} / {mean_std([p['ood']['msp']['auroc'] for p in seeds.values()], 3)}"
            lines.append(f"| {label} ({len(seeds)}) | {t} | " + " | ".join(cells) + f" | {ood} |")
    return "\n".join(lines)


def paired(runs: dict[str, dict[int, dict[str, Any]]], method: str, reference: str, key: str) -> str:
    """Mean of method − reference over the seeds both have, both temperature scaled, with its 95 % t interval."""
    seeds = sorted(runs.get(method, {}).keys() & runs.get(reference, {}).keys())
    d = np.array([scores(runs[method][s], True)[key] - scores(runs[reference][s], True)[key] for s in seeds])
    if len(d) == 0:
        return ""
    if len(d) == 1:
        return difference_text(float(d[0]), math.nan, math.nan, 1)
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    lo, hi = float(d.mean()) - half, float(d.mean()) + half
    text = difference_text(float(d.mean()), lo, hi, len(d))
    return f"**{text}**" if lo * hi > 0 else text


def difference_table(runs: dict[str, dict[int, dict[str, Any]]]) -> str:
    lines = ["| both temperature scaled | " + " | ".join(COLUMNS.values()) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for method, reference in PAIRS:
        cells = [paired(runs, method, reference, key) for key in COLUMNS]
        lines.append(f"| {METHODS[method]} − {METHODS[reference]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def conformal_table(runs: dict[str, dict[int, dict[str, Any]]], labels: dict[str, str] = METHODS) -> str:
    alphas = [entry["alpha"] for entry in next(iter(next(iter(runs.values())).values()))["conformal"]]
    head = " | ".join(f"α={a:g}: {score} coverage / set size" for a in alphas for score in ("THR", "APS"))
    lines = [f"| method | {head} |", "|---|" + "---:|" * (2 * len(alphas))]
    for method, label in labels.items():
        seeds = runs.get(method, {})
        if not seeds:
            continue
        cells = []
        for j in range(len(alphas)):
            for score in ("thr", "aps"):
                results = [part["conformal"][j]["methods"][score] for part in seeds.values()]
                cover = [r["coverage"] for r in results]
                span = f" ({min(cover):.3f}–{max(cover):.3f})" if len(cover) > 1 else ""  # every seed's, for ±0.015
                cells.append(f"{mean_std(cover, 3)}{span} / {mean_std([r['set_size'] for r in results], 2)}")
        lines.append(f"| {label} ({len(seeds)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--evals", type=Path, default=ROOT)
    runs = load(ap.parse_args().evals)
    print(score_table(runs), difference_table(runs), conformal_table(runs), sep="\n\n")


if __name__ == "__main__":
    main()
