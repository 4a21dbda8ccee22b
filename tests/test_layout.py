"""The package's layout (docs/architecture.md "Layout"): each floor imports only the floors below it, and nothing
under evaluation/ or experiments/ reaches into σN-Ens internals except through the methods interface.

Entry points are not dependencies: a ``__main__.py`` and an ``if __name__ == "__main__":`` block (``python -m
sigmanens_dist.train`` runs the parser in cli/) may import from any floor; so may the modules kept one release under an
old path (:data:`DEPRECATED_ALIASES`). A name that moved is served from its old module by ``deprecation.moved``.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sigmanens_dist"

# bottom first; modules on one floor may import each other (no circle: checked below)
FLOORS = [
    ("errors", "progress", "timm_names", "deprecation"),
    ("atomic", "safe_load"),
    ("sigma",),
    ("distributed",),
    ("data",),
    ("config",),
    ("methods",),
    ("training",),
    ("models", "export"),
    ("evaluation",),
    ("train", "experiments", "train_cli"),
    ("cli",),
]
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}
KNOWN_UPWARD: set[str] = set()  # none left: an entry here is a debt, named
# old module paths kept for one release: each warns on import and re-exports its new home
DEPRECATED_ALIASES = {"sigmanens_dist.train_cli": "sigmanens_dist.cli.train",
                      "sigmanens_dist.evaluation.cli": "sigmanens_dist.cli.eval",
                      "sigmanens_dist.experiments.demo": "sigmanens_dist.cli.demo",
                      "sigmanens_dist.data.registry": "sigmanens_dist.data.raw"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, *, top_level_only: bool) -> set[str]:
    """The sigmanens_dist modules ``name`` imports (every import, or only those run when it is imported)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    body = [n for n in tree.body if not _entry_point(n)]
    nodes = body if top_level_only else [n for top in body for n in ast.walk(top)]
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("sigmanens_dist.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.startswith("sigmanens_dist"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _entry_point(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":``: what ``python -m`` runs, never what an import runs."""
    return isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"'


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOOR.get(parts[1]) if len(parts) > 1 else None


def test_every_module_is_on_a_floor() -> None:
    assert [m for m in _modules() if m != "sigmanens_dist" and _floor(m) is None] == []


def test_no_import_runs_back_up_a_floor() -> None:
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name == "sigmanens_dist" or name.endswith(".__main__") or name in DEPRECATED_ALIASES:
            continue
        for target in _imports(name, path, top_level_only=False):
            if target in modules and _floor(target) is not None and _floor(target) > _floor(name):
                upward.append(f"{name} -> {target}")
    assert sorted(set(upward) - KNOWN_UPWARD) == []


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: {t for t in _imports(name, path, top_level_only=True) if t in modules and t != name}
             for name, path in modules.items()}
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


@pytest.mark.parametrize("old", sorted(DEPRECATED_ALIASES))
def test_deprecated_aliases_warn_and_re_export(old: str) -> None:
    new = importlib.import_module(DEPRECATED_ALIASES[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new.__name__}"):
        alias = importlib.import_module(old)
    assert alias.__all__ and all(getattr(alias, n) is getattr(new, n) for n in alias.__all__)


MOVED_NAMES = [("sigmanens_dist.train", "main", "sigmanens_dist.cli.train"),
               ("sigmanens_dist.export", "main", "sigmanens_dist.cli.export"),
               ("sigmanens_dist.experiments.study", "main", "sigmanens_dist.cli.study"),
               ("sigmanens_dist.experiments.compare", "main", "sigmanens_dist.cli.compare"),
               ("sigmanens_dist.models", "param_groups", "sigmanens_dist.training.optim"),
               ("sigmanens_dist.training.objective", "sigma_lr", "sigmanens_dist.training.optim"),
               ("sigmanens_dist.evaluation.metrics", "reliability_diagram", "sigmanens_dist.evaluation.plots"),
               ("sigmanens_dist.methods", "member_major", "sigmanens_dist.data.member_streams")]


@pytest.mark.parametrize(("old", "name", "new"), MOVED_NAMES)
def test_moved_names_warn_and_are_the_new_ones(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=f"^{old}.{name} moved to {new}.{name}$"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        module.nothing_here  # noqa: B018
