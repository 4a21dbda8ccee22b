"""The package's layout (docs/architecture.md "Layout"): each floor imports only the floors below it, no import
circle, no private name imported across packages, and nothing under evaluation/ or experiments/ reaches into σN-Ens
internals except through the methods interface.

The import graph is the real one: every import of a module, at its top, inside functions, under ``TYPE_CHECKING``,
in ``__main__.py`` files and in ``if __name__ == "__main__":`` blocks, and the modules imported by name at run time
(``importlib.import_module``, as the lazy ``__init__``s do). No import runs up a floor: the command a
launcher runs (``torchrun -m sigmanens_dist.train``) is a module of the command line's floor, apart from the trainer
(``sigmanens_dist.trainer``), which imports nothing from ``cli/``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import parse_source

PACKAGE = Path(__file__).resolve().parent.parent / "sigmanens_dist"

# bottom first; modules on one floor may import each other (no circle: checked below)
FLOORS = [
    ("errors", "progress", "timm_names", "program_check", "program_meta"),
    ("atomic", "safe_load"),
    ("storage",),  # torch-free, what the config reads: local or remote paths, and the traffic count
    ("catalog",),  # torch-free, what the config reads: every dataset and corruption named once
    ("config",),  # the typed sections every floor above takes
    ("sigma",),
    ("distributed",),
    ("data",),
    ("checkpoint",),
    ("methods",),
    ("inference",),  # what a program computes: scores, temperature, conformal sets, prediction-time statistics
    ("training",),
    ("models",),
    ("evaluation",),
    ("export",),  # compiles inference/ and the rebuild (models); never imports evaluation/
    ("trainer", "experiments", "predict", "registry"),
    ("cli", "train"),  # train: `python -m sigmanens_dist.train`, the command for launchers (torchrun, Slurm)
]
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def _modules() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package (a package is its ``__init__.py``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _package(name: str, path: Path) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imported(name: str, path: Path, nodes: list[ast.stmt]) -> Iterator[str]:
    """Each dotted name ``nodes`` import from sigmanens_dist: the module, and for ``from m import x`` also ``m.x``."""
    package = _package(name, path)
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("sigmanens_dist."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.startswith("sigmanens_dist"):
                yield base
                yield from (f"{base}.{a.name}" for a in node.names)


def _imported_lazily(tree: ast.Module, modules: set[str]) -> Iterator[str]:
    """The package's modules a file imports by name at run time (``importlib.import_module``: the lazy ``__init__``s'
    ``_LAZY`` tables, the strategies' ``_CLASSES``): every string of the file that names one, in a file that calls
    ``import_module``."""
    calls = any(isinstance(node, ast.Call) and (ast.unparse(node.func).split(".")[-1] == "import_module")
                for node in ast.walk(tree))
    if calls:
        yield from (node.value for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules)


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its file, by an import statement or by name."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = parse_source(path)
        targets = {*_imported(name, path, tree.body), *_imported_lazily(tree, set(modules))}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _floor(module: str) -> int | None:
    """The floor of a module: its top package's (or top module's) in :data:`FLOORS`."""
    parts = module.split(".")
    return FLOOR.get(parts[1]) if len(parts) > 1 else None


def test_the_graph_holds_the_lazy_imports() -> None:
    """The edges ``import_module`` makes at run time are in the graph the floors are checked on, and one that ran up
    a floor would be seen."""
    graph = _graph()
    assert "sigmanens_dist.evaluation.run" in graph["sigmanens_dist.evaluation"]
    assert "sigmanens_dist.export.program" in graph["sigmanens_dist.export"]
    assert "sigmanens_dist.methods.sigma" in graph["sigmanens_dist"]
    assert "sigmanens_dist.distributed.strategies.deepspeed" in graph["sigmanens_dist.distributed.strategies"]
    upward = ast.parse('import importlib\n_LAZY = {"main": "sigmanens_dist.cli.train"}\n'
                       'def f():\n    return importlib.import_module(_LAZY["main"])\n')
    assert list(_imported_lazily(upward, set(_modules()))) == ["sigmanens_dist.cli.train"]


def test_every_module_is_on_a_floor() -> None:
    assert [m for m in _modules() if m != "sigmanens_dist" and _floor(m) is None] == []


def test_no_import_runs_back_up_a_floor() -> None:
    upward = [f"{name} -> {target}" for name, targets in _graph().items() if name != "sigmanens_dist"
              for target in targets if _floor(target) is not None and _floor(target) > _floor(name)]
    assert sorted(upward) == []


def test_what_a_program_computes_needs_no_evaluator() -> None:
    """Issue 54: export/ compiles inference/ (below evaluation/, and importing none of it): nothing under export/ or
    inference/ imports evaluation/, and inference/ imports no torchmetrics (what a program computes is torch only)."""
    graph = _graph()
    leaks = [f"{name} -> {target}" for name, targets in graph.items()
             if name.split(".")[1:2] in (["export"], ["inference"]) for target in targets
             if target.startswith("sigmanens_dist.evaluation")]
    assert leaks == []
    assert [path.name for path in (PACKAGE / "inference").glob("*.py")
            if re.search(r"^\s*(from|import) torchmetrics", path.read_text(), re.MULTILINE)] == []


def test_no_import_circle() -> None:
    graph = _graph()
    # a package's __init__ that re-exports its parts is imported by them only through the package prefix, which
    # Python resolves first; leave out edges into one's own package to see the circles between modules
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], node, nxt] if nxt in stack else [node, nxt]
                circles.append(" -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert circles == []


def test_no_module_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500}
    assert long == {}


def test_sigma_internals_only_through_the_methods_interface() -> None:
    reaching = []
    for name, path in _modules().items():
        if name.split(".")[1:2] in (["evaluation"], ["experiments"]):
            text = path.read_text(encoding="utf-8")
            reaching += [f"{name}: {word}" for word in ("SigmaStore", "SigmaEnsemble") if word in text]
    assert reaching == []


def test_every_parser_lives_in_cli() -> None:
    """One place for command lines: argparse is used under cli/ only."""
    outside = [name for name, path in _modules().items()
               if ".cli" not in name and "ArgumentParser(" in path.read_text(encoding="utf-8")]
    assert outside == []


def test_no_private_name_is_imported_across_packages() -> None:
    """A name (or module) starting with one ``_`` belongs to the package it is defined in: only that package's
    modules import it."""
    modules = _modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    crossing = []
    for name, path in modules.items():
        package = _package(name, path)
        for dotted in set(_imported(name, path, parse_source(path).body)):
            parts = dotted.split(".")
            for i, part in enumerate(parts):
                prefix = ".".join(parts[:i])
                owner = prefix if prefix in packages else prefix.rpartition(".")[0]
                if part.startswith("_") and not part.startswith("__") and owner != package:
                    crossing.append(f"{name} imports {dotted}")
    assert sorted(crossing) == []


def test_every_import_inside_a_function_says_why() -> None:
    """Imports inside functions are how the package keeps ``--help`` fast, the optional extras optional and the
    standalone files standalone; one that does not say which (a ``#`` comment on its lines or on the 2 lines above)
    is usually a leftover that belongs at the top. Consecutive imports (gaps of up to 3 lines) are one group."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for fn in ast.walk(parse_source(path)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            starts = sorted({n.lineno for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)})
            groups: list[list[int]] = []
            for start in starts:
                if groups and start - groups[-1][-1] <= 3:
                    groups[-1].append(start)
                else:
                    groups.append([start])
            for group in groups:
                text = " ".join(lines[i - 1] for i in range(max(1, group[0] - 2), group[-1] + 1))
                if "#" not in text:
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{group[0]} {fn.name}: "
                                     f"{lines[group[0] - 1].strip()}")
    assert sorted(set(offenders)) == []


def test_no_test_module_imports_another_test_module() -> None:
    """What several test modules share lives in tests/helpers.py, tests/sigma_cases.py or conftest fixtures: a test
    module imported by another would run its collection-time code twice and couple unrelated files."""
    tests = PACKAGE.parent / "tests"
    offenders = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(parse_source(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(tests)} imports {n}" for n in names
                          if n.split(".")[0] == "tests" and n.split(".")[-1].startswith("test_")]
    assert offenders == []


def test_tests_mirror_the_package() -> None:
    """A test module sits in the folder of the package it tests (tests/sigma/, tests/training/, …); only the
    project-wide checks (layout, docs, packaging, benchmarks, registries, the error model, CI's skips, the mutation
    script's records) sit at the top of tests/."""
    tests = PACKAGE.parent / "tests"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.parent.relative_to(tests).as_posix() for p in tests.rglob("test_*.py")}
    assert folders - {"."} <= packages, f"test folders that name no package: {sorted(folders - {'.'} - packages)}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_bench.py", "test_ci_skips.py", "test_docs.py", "test_error_model.py", "test_layout.py",
                   "test_mutation_records.py", "test_packaging.py", "test_registries.py"]
