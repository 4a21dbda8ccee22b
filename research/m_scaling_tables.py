"""Print docs/results.md's M-scaling tables (issue 27) from the comparison's CSVs, so the page is rebuilt from the
files rather than copied by hand:

    R=results/m_scaling_long
    sigmanens compare --records $R/records/*.jsonl --reference sigma --out $R/all
    sigmanens compare --records $R/records/*.jsonl --pair members --out $R/steps
    OMP_NUM_THREADS=1 python bench/bench_cost_per_m.py > $R/cost_per_m.txt   # optional: the cost columns
    python research/m_scaling_tables.py [--bench $R/cost_per_m.txt]

Four markdown tables: test NLL per method and M (seeds in brackets); Δ NLL against σN-Ens at the same M; Δ NLL
against the same method at M/2; σN-Ens in detail (accuracy, ECE, members on, disagreement, parameters, and with
--bench the train images/s and ms / image ratios to the single model). A Δ is bold where its 95 % interval excludes 0.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from sigmanens_dist.experiments.compare.report import difference_text

ROOT = Path(__file__).resolve().parent.parent / "results" / "m_scaling_long"
SIZES = ["1", "2", "4", "8", "16"]
NAMES = {"sigma": "σN-Ens, τ=0.5", "packed": "Packed-Ensembles, α=2", "packed (α=3)": "Packed-Ensembles, α=3",
         "batch": "BatchEnsemble", "deep": "Deep Ensemble"}

Row = dict[str, str]


def find(rows: list[Row], method: str, members: str) -> Row | None:
    return next((r for r in rows if r["method"] == method and r["M"] == members), None)


def delta(row: Row | None, key: str) -> str:
    """The table.csv difference `key` as compare writes it, in bold where its interval excludes 0."""
    if row is None or not row.get(f"{key}_mean"):
        return ""
    pairs = int(row[f"{key}_pairs"])
    mean, lo, hi = (float(row[f"{key}_{end}"] or "nan") for end in ("mean", "lo", "hi"))
    text = difference_text(mean, lo, hi, pairs)
    return f"**{text}**" if pairs > 1 and lo * hi > 0 else text


def table(head: str, sizes: list[str], lines: list[list[str]]) -> str:
    out = [f"| {head} | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(sizes)]
    return "\n".join(out + ["| " + " | ".join(cells) + " |" for cells in lines])


def bench_ratios(path: Path) -> dict[str, tuple[str, str]]:
    """σN-Ens rows of bench_cost_per_m.py's printed table: M → (train images/s, ms / image) ratios."""
    ratios = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 8 and parts[0] == "sigma":
            ratios[parts[1]] = (parts[3].replace("x", "×"), parts[5].replace("x", "×"))
    if not ratios:
        raise SystemExit(f"--bench {path}: no σN-Ens row of bench/bench_cost_per_m.py's table in it")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=ROOT, help="holds all/table.csv and steps/table.csv")
    ap.add_argument("--bench", type=Path, help="bench/bench_cost_per_m.py's output, for the cost columns")
    args = ap.parse_args()
    rows = list(csv.DictReader((args.dir / "all" / "table.csv").open()))
    steps = list(csv.DictReader((args.dir / "steps" / "table.csv").open()))
    methods = [m for m in NAMES if find(rows, m, "2") or find(rows, m, "1")]
    step_key = next(c for c in steps[0] if c.startswith("diff_nll_vs"))[: -len("_mean")]

    def nll(m: str, size: str) -> str:
        r = find(rows, m, size)
        return f"{float(r['nll_mean']):.4f} ({r['seeds']})" if r else ""

    print(table("test NLL (seeds) at M =", SIZES, [[NAMES[m], *(nll(m, s) for s in SIZES)] for m in methods]))
    print()
    print(table("Δ test NLL against σN-Ens at the same M [95 %]", SIZES[1:],
                [[NAMES[m], *(delta(find(rows, m, s), "diff_nll_vs_sigma") for s in SIZES[1:])]
                 for m in methods if m != "sigma"]))
    print()
    print(table("Δ test NLL against the same method at M/2 [95 %]", SIZES[1:],
                [[NAMES[m], *(delta(find(steps, m, s), step_key) for s in SIZES[1:])] for m in methods]))
    print()
    cost = bench_ratios(args.bench) if args.bench else {}
    head = ["M", "accuracy σN-Ens", "ECE σN-Ens", "members on", "disagreement", "params σN-Ens"]
    head += ["train images/s", "ms / image"] if cost else []
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size in SIZES:
        r = find(rows, "sigma", size)
        if r is None:
            continue
        cells = [size, f"{float(r['acc_mean']):.4f}", f"{float(r['ece_mean']):.4f}", f"{float(r['sharing_mean']):.2f}",
                 f"{float(r['disagreement_mean']):.3f}", f"{float(r['params_mean']) / 1e3:.0f}k"]
        cells += list(cost.get(size, ("", ""))) if cost else []
        out.append("| " + " | ".join(cells) + " |")
    print("\n".join(out))


if __name__ == "__main__":
    main()
