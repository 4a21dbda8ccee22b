"""The tables of docs/results.md "Under shift" (issue 45), from the evaluations `research/long_shift.sh` kept: every
choice under shift is made here, on the validation split under the validation corruptions, before the test set is
read; the test phase then scores only what was chosen.

    python research/shift_tables.py choose [--evals results/shift_long/val] [--write]
    python research/shift_tables.py test [--evals results/shift_long/test] [--plot results/shift_long/severity.png]
    python research/shift_tables.py member-t [--evals results/shift_long/val_member_t]

The choice (``--write`` keeps it as choice.json beside the evaluations' folder, which `long_shift.sh test` reads): for
each model, the configuration with the lowest mean validation-shift NLL (temperature scaled; NLL because it is the
proper score of the whole predictive distribution, ECE is reported beside it). The single model chooses its
statistics (and so do one network at σN-Ens's compute, 2× width, the Deep Ensemble and Packed-Ensembles); σN-Ens
chooses its τ and statistics together, compared over the seeds every τ was trained with.

Per run family and normalization statistics (each member's training statistics, or the prediction batch's): clean
accuracy, NLL and ECE (temperature scaled where the evaluation fitted a temperature: at the long budget, on the
calibration split), then under shift (the mean over the shift split's corruptions at the evaluated severities)
accuracy, NLL, ECE, member disagreement, mutual information and the AUROC of telling corrupted from clean inputs by
mutual information; mean ± std over seeds. Then the paired differences with 95 % t intervals: batch − training
statistics for each family, σN-Ens − single model (and − the wider network, − each ensemble) at each kind of
statistics, and on the test set the chosen σN-Ens − each chosen baseline, conformal coverage (calibrated on the
calibration split), the diagnosis by severity and the per-corruption scores.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from posthoc_tables import conformal_table, mean_std
from scipy import stats

from sigmanens_dist.experiments.compare.report import difference_text

RESULTS = Path(__file__).resolve().parent.parent / "results" / "shift_long"
FAMILIES = {"single": "single model", "wide": "one network at M=4's compute (2× width)", "deep": "Deep Ensemble M=4",
            "packed3": "Packed-Ensembles M=4, α=3",
            "sigma_t025": "σN-Ens M=4, τ=0.25", "sigma": "σN-Ens M=4, τ=0.5", "sigma_t1": "σN-Ens M=4, τ=1",
            "sigma_l0001": "σN-Ens M=4, τ=0.5, λ=0.001", "sigma_l01": "σN-Ens M=4, τ=0.5, λ=0.1",
            "single_augmix": "single model, AugMix", "sigma_augmix": "σN-Ens M=4, τ=0.5, AugMix",
            "sigma_augmix_spread": "σN-Ens M=4, τ=0.5, AugMix severities 1, 3, 5, 7"}
NORMS = {"train": "training statistics", "batch": "batch statistics"}
CLEAN = {"acc": "accuracy", "nll": "NLL", "ece": "ECE"}
SHIFT = {"acc": "acc shift", "nll": "NLL shift", "ece": "ECE shift", "disagreement": "disagreement shift",
         "mutual_information": "MI shift", "mi_auroc": "MI AUROC"}

Scores = dict[str, float | None]
Runs = dict[tuple[str, str], dict[int, Scores]]  # (family, norm) → seed → scores


def scores(report: dict[str, Any], calibration: str = "calibration") -> Scores:
    """Clean scores and the shift means (over the evaluated severities) of one eval.json's raw weights: accuracy, NLL
    and ECE temperature scaled where the evaluation fitted a temperature (``calibration``: the ensemble's one T, or
    ``member_calibration``, each member's own), the member diagnosis as the members give it."""
    part = report["weights"]["raw"]
    scaled = part.get(calibration, part)
    out: Scores = {k: float(scaled["metrics"][k]) for k in CLEAN}
    for key in SHIFT:
        source = scaled if key in CLEAN else part
        values = [m.get(key) for m in source["shift"]["mean"].values()]
        out[f"shift/{key}"] = None if any(v is None for v in values) else float(np.mean(values))
    return out


def reports(folder: Path, split: str) -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    """(family, norm) → seed → eval.json of every <family>_s<seed>_<norm>/eval.json in folder, each checked to be of
    the phase's split: the validation split under the validation shift, or the test split under the test shift."""
    found: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*_s*_*/eval.json")):
        study, norm = path.parent.name.rsplit("_", 1)
        family, seed = study.rsplit("_s", 1)
        report = json.loads(path.read_text())
        if report.get("shift_split") != split or report.get("split") != split:
            raise SystemExit(f"{path}: split {report.get('split')}, shift split {report.get('shift_split')}; this "
                             f"phase reads the {split} split under the {split} shift only")
        found.setdefault((family, norm), {})[int(seed)] = report
    if not found:
        raise SystemExit(f"{folder}: no <family>_s<seed>_<norm>/eval.json (bash research/long_shift.sh)")
    return found


def load(folder: Path, split: str = "val") -> Runs:
    return {key: {seed: scores(r) for seed, r in seeds.items()} for key, seeds in reports(folder, split).items()}


def choose(runs: Runs) -> dict[str, Any]:
    """The configuration each model takes to the test set: lowest mean validation-shift NLL, σN-Ens's temperatures
    compared over the seeds they share (the module's docstring)."""
    choice: dict[str, Any] = {}
    sigma = [f for f in FAMILIES if f.startswith("sigma")]
    models = (("single", ["single", "single_augmix"]), ("wide", ["wide"]), ("deep", ["deep"]), ("packed3", ["packed3"]),
              ("sigma", sigma))
    for model, families in models:
        candidates = [(f, n) for f in families for n in NORMS if runs.get((f, n))]
        if not candidates:
            continue
        seeds = sorted(set.intersection(*(set(runs[c]) for c in candidates)))
        if not seeds:
            raise SystemExit(f"{model}: no seed shared by {candidates}; train the same seeds of every candidate")
        nll = {c: float(np.mean([runs[c][s]["shift/nll"] for s in seeds])) for c in candidates}
        family, norm = min(nll, key=nll.__getitem__)
        choice[model] = {"family": family, "norm": norm, "seeds": seeds,
                         "val_shift_nll": {f"{f}:{n}": round(v, 6) for (f, n), v in nll.items()}}
    return choice


def chosen_text(choice: dict[str, Any]) -> str:
    return "\n".join(
        f"{model}: {FAMILIES[c['family']]} with {NORMS[c['norm']]} (validation-shift NLL over seeds {c['seeds']}: "
        + ", ".join(f"{k} {v:.4f}" for k, v in c["val_shift_nll"].items()) + ")" for model, c in choice.items())


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


def difference_table(runs: Runs, chosen_pairs: tuple[tuple[tuple[str, str], tuple[str, str]], ...] = ()) -> str:
    """Paired differences, each a row where the two configurations share at least 2 seeds."""
    keys = {"nll": "NLL", "ece": "ECE", "shift/nll": "NLL shift", "shift/ece": "ECE shift"}
    lines = ["| paired | " + " | ".join(keys.values()) + " |", "|---|" + "---:|" * len(keys)]

    def row(label: str, a: dict[int, Scores] | None, b: dict[int, Scores] | None) -> None:
        if a and b and len(a.keys() & b.keys()) >= 2:
            lines.append(f"| {label} | " + " | ".join(paired(a, b, k) for k in keys) + " |")

    for family, label in FAMILIES.items():
        row(f"{label}: batch − training statistics", runs.get((family, "batch")), runs.get((family, "train")))
    for reference in ("single", "wide", "deep", "packed3"):
        for family, label in FAMILIES.items():
            # against one network: every other family; against the wider one and the ensembles: σN-Ens's
            if family != reference and (reference == "single" or family.startswith("sigma")):
                for norm, norm_label in NORMS.items():
                    row(f"{label} − {FAMILIES[reference]}, {norm_label}", runs.get((family, norm)),
                        runs.get((reference, norm)))
    for family, base in (("sigma_augmix", "sigma"), ("sigma_augmix_spread", "sigma_augmix")):  # a lever's own effect
        for norm, norm_label in NORMS.items():
            row(f"{FAMILIES[family]} − {FAMILIES[base]}, {norm_label}", runs.get((family, norm)),
                runs.get((base, norm)))
    for a_key, b_key in chosen_pairs:  # marked where the same pair is a row above, else a row of its own
        same = f"| {FAMILIES[a_key[0]]} − {FAMILIES[b_key[0]]}, {NORMS[a_key[1]]} |"
        at = [i for i, line in enumerate(lines) if a_key[1] == b_key[1] and line.startswith(same)]
        if at:
            lines[at[0]] = "| chosen: " + lines[at[0]][2:]
        else:
            row(f"chosen: {FAMILIES[a_key[0]]}, {NORMS[a_key[1]]} − {FAMILIES[b_key[0]]}, {NORMS[b_key[1]]}",
                runs.get(a_key), runs.get(b_key))
    return "\n".join(lines)


def diagnosis_table(found: dict[tuple[str, str], dict[int, dict[str, Any]]]) -> str:
    """Does the ensemble's disagreement rise as the data moves? Per ensemble configuration, before temperature
    scaling (the members as trained): member disagreement and mutual information clean and at each severity (mean
    over the corruptions), the AUROC of telling corrupted from clean inputs by mutual information, and the ensemble's
    NLL gain over its mean member."""
    severities = sorted(next(iter(next(iter(found.values())).values()))["weights"]["raw"]["shift"]["mean"])
    heads = (["disagreement clean"] + [f"disagreement s{s}" for s in severities] + ["MI clean"]
             + [f"MI s{s}" for s in severities] + [f"MI AUROC s{s}" for s in severities]
             + ["NLL gain clean"] + [f"NLL gain s{s}" for s in severities])
    lines = ["| run | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    getters: list[Any] = [lambda p: p["metrics"]["disagreement"]]
    getters += [lambda p, s=s: p["shift"]["mean"][s]["disagreement"] for s in severities]
    getters += [lambda p: p["metrics"]["mutual_information"]]
    getters += [lambda p, s=s: p["shift"]["mean"][s]["mutual_information"] for s in severities]
    getters += [lambda p, s=s: p["shift"]["mean"][s]["mi_auroc"] for s in severities]
    getters += [lambda p: p["metrics"]["member_mean/nll"] - p["metrics"]["nll"]]
    getters += [lambda p, s=s: p["shift"]["mean"][s]["member_mean/nll"] - p["shift"]["mean"][s]["nll"]
                for s in severities]
    for (family, norm), seeds in found.items():
        parts = [r["weights"]["raw"] for r in seeds.values()]
        if any(p["shift"]["mean"][s].get("disagreement") is None for p in parts for s in severities):
            continue  # one network: nothing to disagree
        cells = [mean_std([float(get(p)) for p in parts], 4) for get in getters]
        lines.append(f"| {FAMILIES[family]}, {NORMS[norm]} ({len(parts)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def corruption_table(found: dict[tuple[str, str], dict[int, dict[str, Any]]]) -> str:
    """Where the shift means come from: per corruption (severities averaged, seeds averaged), each configuration's
    accuracy and temperature-scaled NLL."""
    configs = list(found)
    first = next(iter(found[configs[0]].values()))["weights"]["raw"]
    names = [c for c in first["shift"] if c != "mean"]

    def cell(config: tuple[str, str], name: str, key: str) -> float:
        values = []
        for report in found[config].values():
            part = report["weights"]["raw"]
            by_severity = part.get("calibration", part)["shift"][name]
            values += [by_severity[sev][key] for sev in by_severity]
        return float(np.mean(values))

    heads = [f"{FAMILIES[f]}, {NORMS[n]} ({len(found[(f, n)])})" for f, n in configs]
    lines = ["| corruption: accuracy / NLL | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{cell(c, name, 'acc'):.3f} / {cell(c, name, 'nll'):.3f}"
                                                 for c in configs) + " |")
    return "\n".join(lines)


def member_temperature_table(found: dict[tuple[str, str], dict[int, dict[str, Any]]]) -> str:
    """One temperature fitted on the averaged ensemble against one per member (each on its own NLL, applied before the
    softmaxes are averaged), both fitted on the calibration split of the same evaluation: scores and paired Δ."""
    keys = {"nll": "NLL", "ece": "ECE", "shift/nll": "NLL shift", "shift/ece": "ECE shift"}
    heads = [f"{h}: one T / member T" for h in keys.values()] + [f"Δ {h}, member − one" for h in keys.values()]
    lines = ["| run | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for (family, norm), seeds in found.items():
        one = {seed: scores(r) for seed, r in seeds.items()}
        member = {seed: scores(r, "member_calibration") for seed, r in seeds.items()}
        pairs = [f"{np.mean([v[k] for v in one.values()]):.4f} / {np.mean([v[k] for v in member.values()]):.4f}"
                 for k in keys]
        lines.append(f"| {FAMILIES[family]}, {NORMS[norm]} ({len(seeds)}) | " + " | ".join(pairs) + " | "
                     + " | ".join(paired(member, one, k) for k in keys) + " |")
    return "\n".join(lines)


def severity_plot(found: dict[tuple[str, str], dict[int, dict[str, Any]]], path: Path) -> None:
    """Each configuration's temperature-scaled NLL and ECE, and its members' disagreement, clean and at each evaluated
    severity (mean over the shift split's corruptions; mean ± std over seeds): the diagnosis as a picture."""
    from matplotlib.figure import Figure

    panels = (("nll", "NLL (temperature scaled)", True), ("ece", "ECE (temperature scaled)", True),
              ("disagreement", "member disagreement", False))
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    axes = fig.subplots(1, len(panels))
    for (family, norm), seeds in found.items():
        parts = [r["weights"]["raw"] for r in seeds.values()]
        severities = sorted(parts[0]["shift"]["mean"], key=int)
        xs = [0] + [int(s) for s in severities]
        for ax, (key, title, scaled) in zip(axes, panels, strict=True):
            rows = []
            for part in parts:
                source = part.get("calibration", part) if scaled else part
                row = [source["metrics"].get(key)] + [source["shift"]["mean"][s].get(key) for s in severities]
                rows.append(row)
            if any(v is None for row in rows for v in row):
                continue  # one network has no disagreement
            values = np.array(rows, dtype=float)
            ax.errorbar(xs, values.mean(0), yerr=values.std(0, ddof=1) if len(values) > 1 else None, marker="o",
                        capsize=3, label=f"{FAMILIES[family]}, {NORMS[norm]} ({len(parts)})")
            ax.set_title(title)
            ax.set_xticks(xs, ["clean"] + [f"severity {s}" for s in severities])
    axes[0].legend(fontsize=7)
    fig.suptitle("Test set under the test corruptions (mean over corruptions, ± std over seeds)")
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def test_tables(folder: Path, found: dict[tuple[str, str], dict[int, dict[str, Any]]]) -> str:
    """The test set, read once for the chosen configurations (and any other `long_shift.sh test` was given): the same
    score table and paired differences as the choice's, then conformal coverage on the test set (calibrated on the
    calibration split) with every seed's lowest and highest. ``found``: :func:`reports` of ``folder``, read once for the
    tables and the plot."""
    runs = {key: {seed: scores(r) for seed, r in seeds.items()} for key, seeds in found.items()}
    parts = {f"{f}:{n}": {seed: r["weights"]["raw"] for seed, r in seeds.items()} for (f, n), seeds in found.items()}
    labels = {f"{f}:{n}": f"{FAMILIES[f]}, {NORMS[n]}" for f, n in found}
    choice_file = folder.resolve().parent / "choice.json"
    choice = json.loads(choice_file.read_text()) if choice_file.exists() else {}
    picked = {model: (c["family"], c["norm"]) for model, c in choice.items()}
    pairs = tuple((picked["sigma"], picked[ref]) for ref in ("single", "wide", "deep", "packed3")
                  if "sigma" in picked and ref in picked)
    tables = [choose_table(runs), difference_table(runs, pairs)]
    if all("conformal" in part for seeds in parts.values() for part in seeds.values()):  # the long budget's
        tables.append(conformal_table(parts, labels))
    tables += [diagnosis_table(found), corruption_table(found)]
    return "\n\n".join(tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["choose", "test", "member-t"])
    ap.add_argument("--evals", type=Path,
                    help="default: results/shift_long/ val (choose), test, val_member_t (member-t)")
    ap.add_argument("--write", action="store_true", help="choose: keep the choice as choice.json beside --evals")
    ap.add_argument("--plot", type=Path, help="test: also draw NLL, ECE and disagreement against severity there (PNG)")
    args = ap.parse_args()
    if args.plot and args.phase != "test":
        ap.error(f"--plot {args.plot}: the test phase draws the plot; choose prints tables only")
    evals = args.evals or RESULTS / {"choose": "val", "test": "test", "member-t": "val_member_t"}[args.phase]
    if args.phase == "member-t":
        print(member_temperature_table(reports(evals, "val")))
        return
    if args.phase == "test":
        found = reports(evals, "test")
        print(test_tables(evals, found))
        if args.plot:
            severity_plot(found, args.plot)
            print(f"plot: {args.plot}")
        return
    runs = load(evals)
    choice = choose(runs)
    print(choose_table(runs), difference_table(runs), chosen_text(choice), sep="\n\n")
    if args.write:
        write_choice(evals, choice)


def write_choice(evals: Path, choice: dict[str, Any]) -> None:
    """Keep ``choice`` as choice.json beside the evaluations' folder, whole or not at all."""
    path = evals.resolve().parent / "choice.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(choice, indent=1) + "\n")
    tmp.replace(path)
    print(f"kept in {path}")


if __name__ == "__main__":
    main()
