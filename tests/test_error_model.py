"""The error model in the code (sigmanens_dist/errors.py): a refusal of the user's input is a UsageError raised where
the bad value is found, and the plain raises left (any built-in exception: ValueError, RuntimeError, KeyError, …, and
every ``assert``) are listed invariants; no message carries a command's prefix. What the commands do with them:
tests/cli/test_crashes_and_refusals.py.
"""

from __future__ import annotations

import ast
import builtins
import json
import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO, parse_source

PACKAGE = REPO / "sigmanens_dist"
# every built-in exception: a refusal raised as RuntimeError or KeyError escapes the one-line exit 2 as surely as a
# ValueError does
PLAIN = {name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException)}
# pydantic turns what its validators raise into the one ConfigError (a UsageError) listing every problem
VALIDATORS = {"field_validator", "model_validator"}
# Python's own protocols, never a refusal: a module's __getattr__ answers AttributeError; a method a class does not
# have (an abstract one, one another strategy's format needs) raises NotImplementedError
PROTOCOL = {("__getattr__", "AttributeError")}
# The plain raises and asserts that stay (tests/fixtures/allowed_raises.json): file -> a fragment of each message (of
# an assert: its condition and message). Each is an invariant (a bug if hit: a tensor of a pass, a position or layout
# the run built itself) or is caught at once, and says so in a comment beside it (an assert: or in its message; a
# helper: or in its docstring).
ALLOWED: dict[str, list[str]] = json.loads((REPO / "tests" / "fixtures" / "allowed_raises.json").read_text())


def _scope(node: ast.AST, parent: dict[ast.AST, ast.AST]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function ``node`` is in, or None at module level."""
    scope = parent.get(node)
    while scope is not None and not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
        scope = parent.get(scope)
    return scope


def _plain_raises(path: Path) -> Iterator[tuple[int, str, str, str]]:
    """(line, exception, message source, what the code says of it besides a comment) of every raise of a built-in
    exception in ``path`` outside pydantic validators and Python's protocols, and of every ``assert`` (its condition
    and message; what it says: its message). A raise in a helper whose docstring names the exception says it there."""
    tree = parse_source(path)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            said = ast.unparse(node.msg) if node.msg is not None else ""
            yield node.lineno, "assert", ", ".join(filter(None, (ast.unparse(node.test), said))), said
            continue
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if not (isinstance(exc, ast.Name) and exc.id in PLAIN):
            continue
        scope = _scope(node, parent)
        if scope is not None and {ast.unparse(d).split("(")[0] for d in scope.decorator_list} & VALIDATORS:
            continue
        if scope is not None and ((scope.name, exc.id) in PROTOCOL or (
                exc.id == "NotImplementedError" and isinstance(parent.get(scope), ast.ClassDef))):
            continue
        args = node.exc.args if isinstance(node.exc, ast.Call) else []
        docstring = (ast.get_docstring(scope) or "") if scope is not None else ""
        yield node.lineno, exc.id, ast.unparse(args[0]) if args else "", docstring if exc.id in docstring else ""


def test_refusals_are_usage_errors_and_the_plain_raises_left_are_listed_invariants() -> None:
    """A new bare ``raise ValueError(...)`` (or RuntimeError, KeyError, any built-in exception) or ``assert`` in
    sigmanens_dist/ fails here: a refusal of the user's input is a UsageError (MissingPathError, UnsupportedError);
    a real invariant joins ALLOWED with a comment in the code saying why."""
    found, uncommented, used = [], [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().splitlines()
        for line, name, message, said in _plain_raises(path):
            fragments = {(rel, f) for f in ALLOWED.get(rel, []) if f in message}
            used |= fragments
            if not fragments:
                found.append(f"{rel}:{line}: {'assert' if name == 'assert' else 'raise ' + name}({message[:80]}…)")
            elif not said and not any("#" in text for text in lines[max(0, line - 3): line]):  # the line, 2 above
                uncommented.append(f"{rel}:{line}")
    assert not found, "refusals of the user's input are UsageError (sigmanens_dist/errors.py):\n" + "\n".join(found)
    assert not uncommented, "an allowed plain raise says why in a comment beside it: " + ", ".join(uncommented)
    listed = {(rel, fragment) for rel, fragments in ALLOWED.items() for fragment in fragments}
    assert listed == used, f"ALLOWED lists raises that are gone: {sorted(listed - used)}"


# a message starting with a command's name, one word or more (``sigmanens eval: …``, ``sigmanens data convert: …``)
PREFIX = re.compile(r"f?['\"]sigmanens(?: [\w-]+)+: ")


def _prefixed(path: Path) -> Iterator[int]:
    """Lines of ``path`` raising an exception whose message starts with a command's name."""
    for node in ast.walk(parse_source(path)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args \
                and PREFIX.match(ast.unparse(node.exc.args[0])):
            yield node.lineno


def test_no_error_message_carries_a_command_prefix() -> None:
    """Finding 12: ``sigmanens eval: error: sigmanens eval: …``: the commands print their name; a message does not."""
    prefixed = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
                for line in _prefixed(path)]
    assert not prefixed


def test_the_checks_see_every_kind_of_refusal(tmp_path: Path) -> None:
    """The two checks above on a module that breaks each rule once: refusals raised as RuntimeError, KeyError and
    an assert are found (protocol raises are not), and so is a two-word command's prefix."""
    source = tmp_path / "refusals.py"
    source.write_text('''
def pick(name, options):
    if name not in options:
        raise KeyError(f"--pick {name}: choose one of {options}")
    assert name != "none", "--pick none is refused"
    if name == "gpu":
        raise RuntimeError("--pick gpu needs a GPU")
    raise UsageError(f"sigmanens data convert: --pick {name}")


def __getattr__(name):
    raise AttributeError(name)


class Base:
    def forward(self):
        raise NotImplementedError
''')
    assert [(line, name) for line, name, *_ in sorted(_plain_raises(source))] == [
        (4, "KeyError"), (5, "assert"), (7, "RuntimeError")]
    assert list(_prefixed(source)) == [8]
