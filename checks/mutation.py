"""Mutation testing of the modules a wrong answer would come from: mutmut 3 over each module, against a few fast test
files per module, printing the surviving mutants per module (CONTRIBUTING.md, "Mutation testing").

    .venv/bin/python checks/mutation.py                 # every group, then the report (the five of the report: ~22 min)
    .venv/bin/python checks/mutation.py sigma scores    # some groups; --list names them
    .venv/bin/python checks/mutation.py --report-only   # re-read the last runs' results, no mutating

The report holds every group: those not run now come from their last run's record (results/mutation/groups/GROUP.json),
reported stale (to run again) when a module they mutate changed since.

Each group runs in a copy of this checkout under ``--workdir`` (default ``/tmp/sigmanens-mutation/GROUP``): mutmut
writes its mutated tree there (``mutants/``), never into this checkout, and runs the group's tests on it one mutant
at a time in one forked pytest (``--max-children``, default 1: the machine is shared). Only code inside functions is
mutated (mutmut 3's model); a decorated function (``@property``, ``@torch.no_grad()``…) is not, and the report names
those it skips. A survivor is either killed by a new test or written down in ``checks/mutation_equivalent.txt`` with
the reason it cannot change an answer; the report lists every other survivor as unexplained, and the script exits 1
while one is left (``--no-fail`` exits 0). Not part of CI (.ci/run): it takes longer than the CI budget allows.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EQUIVALENT = REPO / "checks" / "mutation_equivalent.txt"
REPORT = REPO / "results" / "mutation" / "report.txt"
# one record per group's last run (counts, survivors, the digest of each module mutated), so that the report holds
# every group whichever were run on this machine; a record whose modules changed since is reported stale
RECORDS = REPO / "results" / "mutation" / "groups"


@dataclass(frozen=True)
class Group:
    """Modules mutated together and the tests that judge them (``-m "not slow"`` always applies)."""

    modules: tuple[str, ...]
    tests: tuple[str, ...]
    pytest_args: tuple[str, ...] = ()  # more pytest options for this group's runs


# group -> (the modules, the tests run against their mutants): small and fast, chosen so each module's behaviour is
# asserted against an independent reference (a hand computation, M independent layers, a second implementation)
GROUPS: dict[str, Group] = {
    "sigma": Group(
        ("sigmanens_dist/sigma/layers/store.py", "sigmanens_dist/sigma/layers/sigma_norm.py",
         "sigmanens_dist/sigma/layers/batchnorm.py", "sigmanens_dist/sigma/layers/groupnorm.py",
         "sigmanens_dist/sigma/layers/layernorm.py", "sigmanens_dist/sigma/layers/rmsnorm.py",
         "sigmanens_dist/sigma/layers/prediction_stats.py"),
        ("tests/sigma/test_layers.py", "tests/sigma/test_interleave.py", "tests/sigma/test_mutants_store.py",
         "tests/sigma/test_mutants_layers.py",
         # a checkpoint of 0.1.0 still loads (the layout checksum), a member as a plain model (plain_member,
         # fill_plain), prediction-time batch statistics
         "tests/checkpoint/test_checkpoint_compat.py::test_old_checkpoint_predicts_what_it_predicted_when_written",
         "tests/methods/test_methods.py::test_member_is_a_plain_model_reproducing_its_logits",
         "tests/evaluation/test_norm_stats.py::test_batch_stats_equal_a_hand_written_re_estimation",
         "tests/evaluation/test_norm_stats.py::test_a_layer_alone_takes_member_major_rows"),
        # torch.compile's graph count: mutmut's trampolines are graph breaks of their own, and it checks no value
        ("-k", "not compiles_to_one_graph")),
    "regularizer": Group(
        ("sigmanens_dist/sigma/regularizer.py",),
        ("tests/sigma/test_regularizer.py", "tests/sigma/test_mutants_regularizer.py")),
    "scores": Group(
        ("sigmanens_dist/inference/scores.py", "sigmanens_dist/evaluation/metrics.py"),
        ("tests/evaluation/test_metrics.py", "tests/evaluation/test_mutants_metrics.py")),
    "posthoc": Group(
        ("sigmanens_dist/inference/temperature.py", "sigmanens_dist/inference/conformal.py",
         "sigmanens_dist/inference/posthoc.py", "sigmanens_dist/evaluation/posthoc.py"),
        ("tests/evaluation/test_posthoc.py", "tests/evaluation/test_mutants_posthoc.py")),
    "norm_stats": Group(
        ("sigmanens_dist/inference/norm_stats.py",),
        ("tests/evaluation/test_norm_stats.py", "tests/evaluation/test_mutants_norm_stats.py")),
    "program": Group(
        ("sigmanens_dist/export/program.py", "sigmanens_dist/export/fit.py", "sigmanens_dist/export/program_file.py",
         "sigmanens_dist/program_meta.py"),
        ("tests/export/test_program_meta.py", "tests/export/test_export_program.py")),
    "predict_writer": Group(
        ("sigmanens_dist/predict/writer.py",),
        # the writer's own unit tests (predict's end-to-end tests take ~10 s a mutant: 90 min for the module here)
        ("tests/predict/test_writer.py",
         "tests/predict/test_predict.py::test_a_rerun_into_the_same_out_names_what_differs")),
    "registry_best": Group(
        ("sigmanens_dist/registry/best.py",),
        # its own unit tests with fakes for MLflow and the export (test_registry.py starts a server each run)
        ("tests/registry/test_best.py",)),
}

# every group's pytest options: the quick tests, in one process, no .pytest_cache written into the copy
PYTEST_ARGS = ["-m", "not slow", "-p", "no:xdist", "-p", "no:cacheprovider"]
# what a group's copy of the checkout needs besides the package and its tests
COPIED = ("sigmanens_dist", "tests", "configs", "pyproject.toml")
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 35: "suspicious",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "caught by type check",
          -11: "segfault", -9: "segfault", None: "not checked", 2: "interrupted"}


# the reason of a survivor that changes only the arguments of a raised exception (its message), never whether it is
# raised nor its type: the tests hold each refusal's type and that it names the value, not every word of it
MESSAGE = "message only"


@dataclass
class Survivor:
    name: str  # mutmut's mutant name: module.x_function__mutmut_N (a method: module.xǁClassǁmethod__mutmut_N)
    status: str
    removed: list[str]
    added: list[str]
    diff: str
    message_only: bool = False  # changes only the arguments of a raised exception
    reason: str | None = None

    @property
    def function(self) -> str:
        return self.name.rpartition("__mutmut_")[0]


@dataclass
class Outcome:
    group: str
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # module -> status -> n
    survivors: dict[str, list[Survivor]] = field(default_factory=dict)  # module -> survivors (any status but killed)
    seconds: float = 0.0
    error: str | None = None
    matched: set[tuple[str, tuple[str, ...], tuple[str, ...]]] = field(default_factory=set)  # equivalents used


def read_equivalents(path: Path = EQUIVALENT) -> list[tuple[str, list[str], list[str], str]]:
    """The written-down equivalent mutants: (function, removed lines, added lines, reason). The file's entries::

        module.x_function            (mutmut's name of the mutant, without its __mutmut_N)
          - the original line(s), stripped
          + the mutated line(s), stripped
          why: one line saying why no input can tell them apart
    """
    entries: list[tuple[str, list[str], list[str], str]] = []
    if not path.exists():
        return entries
    function, removed, added = None, [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        if not line.startswith(" "):
            function, removed, added = line.strip(), [], []
        elif line.startswith("  - "):
            removed.append(line[4:].strip())
        elif line.startswith("  + "):
            added.append(line[4:].strip())
        elif line.startswith("  why: ") and function is not None:
            entries.append((function, removed, added, line[len("  why: "):].strip()))
            function = None
        else:
            raise SystemExit(f"{path}:{number}: not an entry line (a function, '  - ', '  + ' or '  why: '): {line!r}")
    return entries


def diff_lines(diff: str) -> tuple[list[str], list[str]]:
    removed = [line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def module_of(name: str) -> str:
    """``sigmanens_dist.sigma.regularizer.x_f__mutmut_3`` -> ``sigmanens_dist/sigma/regularizer.py``."""
    dotted = name.rpartition("__mutmut_")[0]
    parts = dotted.split(".")
    while parts and (parts[-1].startswith("x_") or parts[-1].startswith("xǁ")):
        parts.pop()
    return "/".join(parts) + ".py"


def decorated_functions(module: Path) -> list[str]:
    """Functions mutmut 3 leaves unmutated: those under a decorator other than a lone staticmethod/classmethod."""
    out = []
    tree = ast.parse(module.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _skipped(item):
                    out.append(f"{node.name}.{item.name}")
    out += [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and _skipped(node)]
    return sorted(out)


def _skipped(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    decorators = node.decorator_list
    return bool(decorators) and not (len(decorators) == 1 and isinstance(decorators[0], ast.Name)
                                     and decorators[0].id in ("staticmethod", "classmethod"))


def prepare(name: str, group: Group, work: Path) -> None:
    """A fresh copy of the checkout for ``group`` with its mutmut configuration (setup.cfg)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for item in COPIED:
        src = REPO / item
        if src.is_dir():
            shutil.copytree(src, work / item, ignore=ignore)
        else:
            shutil.copy2(src, work / item)
    missing = [p for p in (*group.modules, *group.tests) if not (work / p.partition("::")[0]).exists()]
    if missing:
        raise SystemExit(f"group {name}: no such file in this checkout: {', '.join(missing)}")

    def lines(values: list[str]) -> str:
        return "".join(f"\n    {v}" for v in values)

    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = sigmanens_dist\n"
        f"only_mutate ={lines(list(group.modules))}\n"
        f"pytest_add_cli_args_test_selection ={lines(list(group.tests))}\n"
        f"pytest_add_cli_args ={lines(PYTEST_ARGS + list(group.pytest_args))}\n"
        "also_copy =\n    configs\n"
        "use_git_change_detection = false\n")


def run_group(name: str, group: Group, work: Path, max_children: int, log: Path) -> Outcome:
    outcome = Outcome(name)
    start = time.monotonic()
    prepare(name, group, work)
    mutmut = Path(sys.executable).with_name("mutmut")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb"}
    with log.open("w") as out:
        done = subprocess.run([str(mutmut), "run", "--max-children", str(max_children)], cwd=work, env=env,
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    outcome.seconds = time.monotonic() - start
    (work / "seconds.txt").write_text(f"{outcome.seconds:.0f}\n")  # for --report-only
    if done.returncode != 0:
        outcome.error = f"mutmut run exited {done.returncode}; its output: {log}"
    collect(name, group, work, outcome)
    return outcome


def collect(name: str, group: Group, work: Path, outcome: Outcome) -> None:
    """Read the results a group's run left in its copy: counts per module and every mutant not killed."""
    equivalents = read_equivalents()
    for module in group.modules:
        outcome.counts[module] = {}
        outcome.survivors[module] = []
        meta = work / "mutants" / (module + ".meta")
        if not meta.exists():
            outcome.error = outcome.error or f"no results for {module} in {work} (run the group first)"
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = {mutant: STATUS.get(code, "suspicious") for mutant, code in codes.items()}
        # a mutant never run (the run stopped early) is counted, its diff not read: the run is what is missing
        described = describe(work, {m: module for m, status in statuses.items()
                                    if status not in ("killed", "not checked")})
        for mutant in sorted(codes, key=_natural):
            status = statuses[mutant]
            outcome.counts[module][status] = outcome.counts[module].get(status, 0) + 1
            if status == "killed":
                continue
            info = described.get(mutant, {"diff": "(not run)", "message_only": False})
            removed, added = diff_lines(info["diff"])
            survivor = Survivor(mutant, status, removed, added, info["diff"], info["message_only"])
            explain(survivor, equivalents, outcome)
            outcome.survivors[module].append(survivor)


def explain(survivor: Survivor, equivalents: list[tuple[str, list[str], list[str], str]], outcome: Outcome) -> None:
    """A surviving mutant's reason: message-only, or the written-down equivalent it matches (None: unexplained)."""
    if survivor.status == "survived" and survivor.message_only:
        survivor.reason = MESSAGE
    elif survivor.status == "survived":
        survivor.reason = next((why for function, r, a, why in equivalents if function == survivor.function
                                and r == survivor.removed and a == survivor.added), None)
        if survivor.reason is not None:
            outcome.matched.add((survivor.function, tuple(survivor.removed), tuple(survivor.added)))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def save_record(outcome: Outcome, group: Group, work: Path, records: Path = RECORDS) -> None:
    """The group's outcome as results/mutation/groups/GROUP.json, with the digest of each module as it was mutated
    (the group's copy of it in ``work``)."""
    survivors = {m: [{k: getattr(s, k) for k in ("name", "status", "removed", "added", "diff", "message_only")}
                     for s in found] for m, found in outcome.survivors.items()}
    record = {"group": outcome.group, "digests": {m: digest(work / m) for m in group.modules}, "counts": outcome.counts,
              "survivors": survivors, "seconds": round(outcome.seconds), "error": outcome.error}
    records.mkdir(parents=True, exist_ok=True)
    (records / f"{outcome.group}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def load_record(name: str, group: Group, records: Path = RECORDS) -> Outcome:
    """The group's last recorded outcome, its survivors explained against today's equivalents; an error when there
    is none or when a module changed since it was mutated (the group must run again)."""
    outcome = Outcome(name)
    path = records / f"{name}.json"
    if not path.exists():
        outcome.error = f"no run of this group on record ({path}): run it"
        return outcome
    record = json.loads(path.read_text())
    equivalents = read_equivalents()
    outcome.counts, outcome.seconds, outcome.error = record["counts"], record["seconds"], record["error"]
    for module, found in record["survivors"].items():
        outcome.survivors[module] = [Survivor(**entry) for entry in found]
        for survivor in outcome.survivors[module]:
            explain(survivor, equivalents, outcome)
    changed = [m for m in group.modules if record["digests"].get(m) != digest(REPO / m)]
    if changed:
        outcome.error = f"stale: {', '.join(changed)} changed since this group ran: run it again"
    return outcome


def _natural(mutant: str) -> tuple[str, int]:
    head, _, number = mutant.rpartition("__mutmut_")
    return head, int(number) if number.isdigit() else 0


# Run in a group's copy (mutmut reads its files relative to the working directory): for each mutant named in the JSON
# file argv[1], its diff and whether it changes only what a raised exception says (its arguments), never whether or
# what it raises. Mutmut's own reader of its mutated files (mutmut.mutation.diff_apply) gives both functions whole.
_DESCRIBE = """
import ast, json, sys, textwrap
import libcst as cst
from mutmut.mutation import diff_apply as d

def normal(function):
    tree = ast.parse(textwrap.dedent(cst.Module([function]).code))
    tree.body[0].name = "f"
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            node.exc.args, node.exc.keywords = [], []
    return ast.dump(tree)

out = {}
for name, path in json.load(open(sys.argv[1])).items():
    functions = d.read_functions_from_index(name, path)
    if functions is None:
        module = d.read_mutants_module(path)
        functions = (d.read_original_function(module, name), d.read_mutant_function(module, name))
    out[name] = {"diff": d.get_diff_for_mutant(name, path=path),
                 "message_only": normal(functions[0]) == normal(functions[1])}
print(json.dumps(out))
"""


def describe(work: Path, mutants: dict[str, str]) -> dict[str, dict]:
    """Diff and message-only flag of each mutant (name -> its module's path), read in one process."""
    if not mutants:
        return {}
    names = work / "mutants" / "describe.json"
    names.write_text(json.dumps(mutants))
    done = subprocess.run([sys.executable, "-c", _DESCRIBE, str(names)], cwd=work, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"reading the mutants of {work} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def report(outcomes: list[Outcome], command: str) -> tuple[str, int]:
    """The report's text and the number of unexplained survivors (a survivor neither message-only nor in the
    equivalent list, and any mutant not run, without tests, timed out or suspicious)."""
    rows, sections, equivalents = [], [], []
    total = dict.fromkeys(("mutants", "killed", "message", "equivalent", "unexplained"), 0)
    for outcome in outcomes:
        for module, counts in outcome.counts.items():
            survivors = outcome.survivors.get(module, [])
            row = {"mutants": sum(counts.values()), "killed": counts.get("killed", 0),
                   "message": sum(s.reason == MESSAGE for s in survivors),
                   "equivalent": sum(s.reason not in (None, MESSAGE) for s in survivors),
                   "unexplained": sum(s.reason is None for s in survivors)}
            rows.append(f"{outcome.group:<15} {module:<48} " + " ".join(f"{row[k]:>{len(k)}}" for k in row))
            for key, value in row.items():
                total[key] += value
            for s in survivors:
                if s.reason is None:
                    sections.append(f"{s.name}: {s.status}\n{_indent(s.diff)}\n  equivalent? add to "
                                    f"checks/mutation_equivalent.txt:\n{_indent(_entry(s))}")
                elif s.reason != MESSAGE:
                    equivalents.append(f"  {s.name}: {s.reason}")
        if outcome.error:
            sections.append(f"group {outcome.group}: {outcome.error}")
            total["unexplained"] += 1
    head = (f"Mutation testing: {command}\n"
            "mutmut 3, each module's mutants against its group's tests (checks/mutation.py GROUPS). 'message': a "
            "survivor that changes only the\narguments of a raised exception (its message text), never whether or "
            "what it raises; 'equivalent': a survivor written down in\nchecks/mutation_equivalent.txt with its reason; "
            "'unexplained': any other mutant not killed (survived, no tests, timeout).\n\n"
            f"{'group':<15} {'module':<48} " + " ".join(total) + "\n")
    lines = [head + "\n".join(rows), f"{'total':<15} {'':<48} " + " ".join(f"{v:>{len(k)}}" for k, v in total.items())]
    lines.append("\nno unexplained survivor" if not sections
                 else "\nunexplained survivors:\n\n" + "\n\n".join(sections))
    if equivalents:
        lines.append("\nequivalent (checks/mutation_equivalent.txt):\n" + "\n".join(equivalents))
    modules = {m.removesuffix(".py").replace("/", ".") + "." for o in outcomes for m in o.counts}
    used = set().union(*(o.matched for o in outcomes)) if outcomes else set()
    stale = [f"  {function}: - {' / '.join(r)}" for function, r, a, _ in read_equivalents()
             if any(function.startswith(m) for m in modules) and (function, tuple(r), tuple(a)) not in used]
    if stale:
        lines.append("\nentries of checks/mutation_equivalent.txt no survivor matched (killed now, or the code "
                     "changed: remove or update them):\n" + "\n".join(stale))
    timing = ", ".join(f"{o.group} {o.seconds / 60:.1f} min" for o in outcomes if o.seconds)
    if timing:
        lines.append(f"\ntime per group (2-core machine, --max-children 1): {timing}")
    skipped = []
    for outcome in outcomes:
        for module in outcome.counts:
            names = decorated_functions(REPO / module)
            if names:
                skipped.append(f"  {module}: {', '.join(names)}")
    if skipped:
        lines.append("\nnot mutated (decorated functions, outside mutmut 3's model; tested as usual):\n"
                     + "\n".join(skipped))
    return "\n".join(lines) + "\n", total["unexplained"]


def _entry(s: Survivor) -> str:
    return "\n".join([s.function, *(f"  - {r}" for r in s.removed), *(f"  + {a}" for a in s.added), "  why: ..."])


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="*", metavar="GROUP", help="groups to run (default: all; --list names them)")
    parser.add_argument("--list", action="store_true", help="print the groups, their modules and tests, and exit")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/sigmanens-mutation"),
                        help="where each group's copy of the checkout goes (default /tmp/sigmanens-mutation)")
    parser.add_argument("--max-children", type=int, default=1, help="mutants tested at once (default 1)")
    parser.add_argument("--report", type=Path, default=REPORT, help=f"the report written (default {REPORT})")
    parser.add_argument("--report-only", action="store_true",
                        help="the last runs' results (this machine's, else results/mutation/groups/); run nothing")
    parser.add_argument("--no-fail", action="store_true", help="exit 0 even with unexplained survivors")
    args = parser.parse_args(argv)
    if args.list:
        for name, group in GROUPS.items():
            print(f"{name}:\n  mutates {' '.join(group.modules)}\n  against {' '.join(group.tests)}")
        return 0
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {', '.join(unknown)}: choose from {', '.join(GROUPS)}")
    outcomes = []
    for name, group in GROUPS.items():  # every group in the report: those not run now from their records
        work, outcome = args.workdir / name, None
        if not args.report_only and (not args.groups or name in args.groups):
            log = args.workdir / f"{name}.log"
            args.workdir.mkdir(parents=True, exist_ok=True)
            print(f"[mutation] {name}: mutmut run in {work} (log {log})", flush=True)
            outcome = run_group(name, group, work, args.max_children, log)
            print(f"[mutation] {name}: {outcome.seconds / 60:.1f} min", flush=True)
        elif (work / "mutants").is_dir():  # a run on this machine: its latest results (mutants re-run by hand too)
            outcome = Outcome(name)
            collect(name, group, work, outcome)
            if (work / "seconds.txt").exists():
                outcome.seconds = float((work / "seconds.txt").read_text())
        if outcome is not None and not outcome.error:
            save_record(outcome, group, work)
        outcomes.append(load_record(name, group) if outcome is None or not outcome.error else outcome)
    command = "python checks/mutation.py" + "".join(f" {n}" for n in args.groups)
    text, unexplained = report(outcomes, command)
    print(text)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(f"[mutation] report written to {args.report}")
    return 0 if unexplained == 0 or args.no_fail else 1


if __name__ == "__main__":
    sys.exit(main())
