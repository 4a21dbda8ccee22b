"""The tables of docs/results.md "Under mixed batches" (issue 52), from the evaluations `research/long_shift.sh
mixed_choose` and `mixed_test` kept in results/shift_mixed: the shift scored as one stream mixing every corruption ×
severity with the clean images (`sigmanens eval --shift-batches mixed`), as a deployment meets it.

    python research/mixed_tables.py choose [--evals results/shift_mixed/val] [--write]
    python research/mixed_tables.py test [--evals results/shift_mixed/test]

The choice (``--write`` keeps it as choice.json beside the evaluations' folder, which `long_shift.sh mixed_test`
reads): for each model and each batch size a deployment has (1, 8, 32: the batch size is the deployment's, not a
choice), the statistics of lowest mean validation-shift NLL (temperature scaled on the calibration split, with the
same statistics and batch size) over the seeds every candidate shares: the training statistics, or each batch's mixed
with them by a prior N. "Shift" is the mean over the corruption × severity cells, as in the per-corruption tables, so
that only the batches differ; "stream" is every image of the stream, the clean ones included.

The test tables, at batch 32 and at one image per prediction: each model at its choice, beside the training
statistics and the per-corruption protocol's batch statistics (the earlier round's choice, docs/results.md "Under
shift"); paired differences with 95 % t intervals, σN-Ens − each other model; conformal coverage; the diagnosis.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from posthoc_tables import conformal_table
from shift_tables import CLEAN, FAMILIES, SHIFT, Scores, cell, paired, reports, scores, write_choice

RESULTS = Path(__file__).resolve().parent.parent / "results" / "shift_mixed"
BATCHES = (32, 8, 1)
STREAM = {"acc": "acc stream", "nll": "NLL stream", "ece": "ECE stream"}
Runs = dict[tuple[str, str], dict[int, Scores]]  # (family, configuration) → seed → scores
# lever c: σN-Ens at another τ or λ than the recipe's (τ = 0.5, λ = 0.01), compared with it by recipe_table, not chosen
# for the test set
RECIPE_VARIANTS = ("sigma_t025", "sigma_t1", "sigma_l0001", "sigma_l01")


def parse(config: str) -> tuple[str, int | None, float | None]:
    """``train`` → ("train", None, None); ``b32p16`` → ("mixed", 32, 16.0); ``h32p0`` → ("per-corruption", 32, 0.0)."""
    if config == "train":
        return "train", None, None
    found = re.fullmatch(r"([bh])(\d+)p(\d+(?:\.\d+)?)", config)
    if found is None:
        raise SystemExit(f"unknown configuration {config!r} (train, b<B>p<N>, h<B>p<N>)")
    return ("mixed" if found[1] == "b" else "per-corruption"), int(found[2]), float(found[3])


def label(config: str) -> str:
    kind, batch, prior = parse(config)
    if kind == "train":
        return "training statistics (any batch)"
    if kind == "mixed" and batch == 1:
        return f"one image at a time, its statistics, prior {prior:g}"
    where = "mixed batches" if kind == "mixed" else "per-corruption batches"
    return f"{where} of {batch}, batch statistics, prior {prior:g}"


def stream_scores(report: dict[str, Any]) -> Scores:
    """:func:`shift_tables.scores` and the stream's overall accuracy, NLL and ECE (temperature scaled)."""
    out = scores(report)
    part = report["weights"]["raw"]
    stream = part["calibration"].get("stream") if "calibration" in part else part.get("shift_stream")
    for key in STREAM:  # none for the per-corruption protocol
        out[f"stream/{key}"] = float(stream["overall"][key]) if stream else None
    return out


def load(folder: Path, split: str) -> tuple[Runs, dict[tuple[str, str], dict[int, dict[str, Any]]]]:
    found = reports(folder, split)
    for (family, config), seeds in found.items():
        kind, batch, prior = parse(config)
        for seed, report in seeds.items():
            protocol = report.get("shift_batches", {})
            stats = report["norm_stats"]
            want = "per-corruption" if kind == "per-corruption" else "mixed"
            if protocol.get("composition") != want or (batch and protocol.get("batch_size") != batch) or (
                    stats["mode"] != ("train" if kind == "train" else "batch")) or stats.get("prior", prior) != prior:
                raise SystemExit(f"{family}_s{seed}_{config}: its eval.json says {protocol}, {stats}")
    return {key: {seed: stream_scores(r) for seed, r in seeds.items()} for key, seeds in found.items()}, found


def choose(runs: Runs) -> dict[str, dict[str, Any]]:
    """Per family and batch size, the configuration of lowest mean validation-shift NLL (the module's docstring); the
    recipe's variants (lever c) are not candidates for the test set."""
    choice: dict[str, dict[str, Any]] = {}
    for family in sorted({f for f, _ in runs if f not in RECIPE_VARIANTS}, key=list(FAMILIES).index):
        for batch in BATCHES:
            candidates = [(f, c) for f, c in runs if f == family and (c == "train" or parse(c)[:2] == ("mixed", batch))]
            if len(candidates) < 2:
                continue
            seeds = sorted(set.intersection(*(set(runs[c]) for c in candidates)))
            if not seeds:
                raise SystemExit(f"{family} at batch {batch}: no seed shared by {candidates}")
            nll = {c: float(np.mean([runs[(family, c)][s]["shift/nll"] for s in seeds])) for _, c in candidates}
            best = min(nll, key=nll.__getitem__)
            choice.setdefault(family, {})[str(batch)] = {"config": best, "seeds": seeds,
                                                         "val_shift_nll": {c: round(v, 6) for c, v in nll.items()}}
    return choice


def score_table(runs: Runs, keys: list[tuple[str, str]]) -> str:
    heads = {**{k: v for k, v in CLEAN.items()}, **{f"shift/{k}": v for k, v in SHIFT.items()},
             **{f"stream/{k}": v for k, v in STREAM.items()}}
    lines = ["| model | statistics | " + " | ".join(heads.values()) + " |", "|---|---|" + "---:|" * len(heads)]
    for family, config in keys:
        seeds = runs.get((family, config))
        if seeds:
            cells = [cell([s[k] for s in seeds.values()]) for k in heads]
            lines.append(f"| {FAMILIES[family]} ({len(seeds)}) | {label(config)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def difference_table(runs: Runs, pairs: list[tuple[str, tuple[str, str], tuple[str, str]]]) -> str:
    keys = {"nll": "NLL", "ece": "ECE", "shift/nll": "NLL shift", "shift/ece": "ECE shift", "stream/nll": "NLL stream"}
    lines = ["| paired | " + " | ".join(keys.values()) + " |", "|---|" + "---:|" * len(keys)]
    for text, a, b in pairs:
        if runs.get(a) and runs.get(b) and runs[a].keys() & runs[b].keys():
            shared = sorted(runs[a].keys() & runs[b].keys())
            lines.append(f"| {text} ({len(shared)}) | " + " | ".join(_paired(runs[a], runs[b], k) for k in keys)
                         + " |")
    return "\n".join(lines)


def _paired(a: dict[int, Scores], b: dict[int, Scores], key: str) -> str:
    """:func:`shift_tables.paired` over the seeds both sides share (their number is in the row's label); one shared
    seed is its difference alone, no interval; "—" where a side has no such score (the per-corruption protocol has
    no stream)."""
    shared = a.keys() & b.keys()
    if any(runs[s][key] is None for runs in (a, b) for s in shared):
        return "—"
    if len(shared) == 1:
        (seed,) = shared
        return f"{a[seed][key] - b[seed][key]:+.4f} (seed {seed} only)"  # type: ignore[operator]
    return paired(a, b, key)


def _ordered(runs: Runs) -> list[tuple[str, str]]:
    return sorted(runs, key=lambda k: (list(FAMILIES).index(k[0]), parse(k[1])[0] != "train",
                                       -(parse(k[1])[1] or 0), parse(k[1])[2] or 0, k[1]))


def choose_text(choice: dict[str, dict[str, Any]]) -> str:
    return "\n".join(f"{FAMILIES[family]}, batch {batch}: {label(c['config'])} (validation-shift NLL over seeds "
                     f"{c['seeds']}: " + ", ".join(f"{k} {v:.4f}" for k, v in c["val_shift_nll"].items()) + ")"
                     for family, by_batch in choice.items() for batch, c in by_batch.items())


def recipe_table(runs: Runs) -> str:
    """Lever c: σN-Ens at another τ or λ against the recipe, each at the same configuration, paired by seed (on the
    validation split and shift, where the choice is made); empty when no variant was scored."""
    pairs = [(f"{label(c)}: {FAMILIES[f]} − {FAMILIES['sigma']}", (f, c), ("sigma", c))
             for f, c in _ordered(runs) if f in RECIPE_VARIANTS]
    return difference_table(runs, pairs) if pairs else ""


def test_tables(runs: Runs, found: dict[tuple[str, str], dict[int, dict[str, Any]]], choice: dict[str, Any]) -> str:
    tables = [score_table(runs, _ordered(runs))]
    others = [f for f in FAMILIES if f != "sigma" and f in choice]
    pairs = []
    for batch in ("32", "1"):
        if "sigma" in choice and batch in choice["sigma"]:
            mine = ("sigma", choice["sigma"][batch]["config"])
            pairs += [(f"batch {batch}, chosen: σN-Ens − {FAMILIES[f]}", mine, (f, choice[f][batch]["config"]))
                      for f in others if batch in choice[f]]
    pairs += [(f"{label(c)}: σN-Ens − {FAMILIES[f]}", ("sigma", c), (f, c)) for c in ("train", "h32p0") for f in others]
    pairs += [(f"{FAMILIES[f]}: {label(c)} − training statistics", (f, c), (f, "train"))
              for f, c in _ordered(runs) if c != "train"]
    tables.append(difference_table(runs, pairs))
    parts = {f"{f}:{c}": {seed: r["weights"]["raw"] for seed, r in seeds.items()} for (f, c), seeds in found.items()}
    if all("conformal" in part for seeds in parts.values() for part in seeds.values()):
        tables.append(conformal_table(parts, {f"{f}:{c}": f"{FAMILIES[f]}, {label(c)}" for f, c in _ordered(runs)}))
    return "\n\n".join(tables)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["choose", "test"])
    ap.add_argument("--evals", type=Path, help="default: results/shift_mixed/ val (choose), test (test)")
    ap.add_argument("--write", action="store_true", help="choose: keep the choice as choice.json beside --evals")
    args = ap.parse_args()
    split = "val" if args.phase == "choose" else "test"
    evals = args.evals or RESULTS / split
    runs, found = load(evals, split)
    if args.phase == "test":
        choice_file = evals.resolve().parent / "choice.json"
        print(test_tables(runs, found, json.loads(choice_file.read_text()) if choice_file.exists() else {}))
        return
    choice = choose(runs)
    print(score_table(runs, _ordered(runs)), choose_text(choice), recipe_table(runs), sep="\n\n")
    if args.write:
        write_choice(evals, choice)


if __name__ == "__main__":
    main()
