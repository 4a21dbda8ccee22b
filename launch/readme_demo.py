"""The README's demo excerpt, made by the demo itself: run ``sigmanens demo`` in a fresh folder, then check that the
README's excerpt is the table the demo printed, line for line (``--check``), or write the demo's table into the
README (``--write``). The timing row (``ms / image``) is the one line that differs from run to run; it is compared
by its label only. The scores are the same to the digit only on the kind of CPU that wrote them (the README names
it): another CPU's kernels round differently, and training carries that into the scores (measured: accuracy
0.7955 → 0.7975, the single model's NLL under shift 2.96 → 2.44, same packages and code). On another CPU the check
compares every row and the cost lines, and the scores by their place only.

    python launch/readme_demo.py --check     # exit 1 with the differing lines when the README is stale
    python launch/readme_demo.py --write     # after a change that moves the demo's scores
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
# the excerpt's fence follows this sentence; its date is rewritten with the block
INTRO = re.compile(r"\(written by `python launch/readme_demo\.py --write`, (\d{4}-\d{2}-\d{2}), on ([^;]+);")
TIMING = "ms / image"
# rows that do not depend on floating point: the same on every CPU
EXACT_ROWS = ("parameters", "train compute", "passes / image")
SCORE = re.compile(r"[+-]?\d+\.\d+")


def cpu() -> str:
    """The kind of CPU the scores were computed on: its model name and the vector instructions torch uses."""
    import torch  # here: the README's excerpt is read without it

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    return f"{name or platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()})"


def excerpt(readme: str) -> tuple[int, int, str]:
    """The [start, end) character span of the excerpt's lines inside the README (between its fences), and the CPU
    it was written on."""
    intro = INTRO.search(readme)
    if intro is None:
        raise SystemExit(f"{README}: no '(written by `python launch/readme_demo.py --write`, DATE, on CPU;' before "
                         "the demo's table")
    start = readme.index("```\n", intro.end()) + 4
    return start, readme.index("```", start), intro.group(2)


def demo_table(output: str) -> list[str]:
    """The comparison table the demo printed: from its header (the line naming both methods) to the timing row."""
    lines = output.splitlines()
    head = next((i for i, line in enumerate(lines) if "σN-Ens" in line and "single model" in line), None)
    end = next((i for i, line in enumerate(lines) if TIMING in line and head is not None and i > head), None)
    if head is None or end is None:
        raise SystemExit("the demo printed no comparison table (a header naming σN-Ens and the single model, then "
                         f"a '{TIMING}' row):\n{output[-3000:]}")
    return lines[head:end + 1]


def stale_lines(readme_lines: list[str], table: list[str], scores: bool = True) -> list[str]:
    """Where the README's excerpt and the demo's table differ, both ways: 'README: …' for a line the demo did not
    print, 'demo: …' for a printed line the excerpt lacks (an emptied or cut excerpt is stale too); the timing row by
    its label only, and without ``scores`` every score by its place only (the :data:`EXACT_ROWS` stay exact). Empty
    when they are the same lines in the same order."""
    def key(line: str) -> str:
        if TIMING in line:
            return TIMING
        return line.rstrip() if scores or any(row in line for row in EXACT_ROWS) else SCORE.sub("#", line.rstrip())

    ours, printed = [key(line) for line in readme_lines], [key(line) for line in table]
    stale = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ours, printed, autojunk=False).get_opcodes():
        if op != "equal":
            stale += [f"README: {line}" for line in readme_lines[i1:i2]] + [f"demo: {line}" for line in table[j1:j2]]
    return stale


def run_demo() -> str:
    with tempfile.TemporaryDirectory(prefix="readme_demo_") as tmp:
        proc = subprocess.run([sys.executable, "-m", "sigmanens_dist.cli", "demo", "--out", f"{tmp}/demo"],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sigmanens demo failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when the README's excerpt is not the demo's")
    mode.add_argument("--write", action="store_true", help="write the demo's table into the README")
    args = ap.parse_args()
    readme = README.read_text()
    start, end, written_on = excerpt(readme)
    here = cpu()
    table = demo_table(run_demo())
    if args.write:
        intro = INTRO.search(readme)
        assert intro is not None  # excerpt() found it
        dated = (readme[:intro.start(1)] + datetime.date.today().isoformat() + readme[intro.end(1):intro.start(2)]
                 + here + readme[intro.end(2):])
        start, end, _ = excerpt(dated)
        README.write_text(dated[:start] + "\n".join(table) + "\n" + dated[end:])
        print(f"{README}: the demo's table written ({len(table)} lines, on {here})")
        return 0
    same_cpu = written_on == here
    stale = stale_lines(readme[start:end].splitlines(), table, scores=same_cpu)
    what = "" if same_cpu else (f" (written on {written_on}, run on {here}: the rows and cost lines compared, the "
                                "scores by their place only)")
    if stale:
        print(f"the README's demo excerpt is not what the demo prints on this build{what}; the demo printed:\n"
              + "\n".join(table) + "\n\n" + "\n".join(stale) + "\n\n(python launch/readme_demo.py --write)")
        return 1
    print(f"the README's demo excerpt is the demo's table{what}" + ("" if same_cpu else "; the demo printed:\n"
                                                                      + "\n".join(table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
