"""The error model in the code (sigmanens_dist/errors.py): a refusal of the user's input is a UsageError raised where
the bad value is found, and the plain ValueError/FileNotFoundError/TypeError left are listed invariants; no message
carries a command's prefix. What the commands do with them: tests/cli/test_crashes_and_refusals.py.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO, parse_source

PACKAGE = REPO / "sigmanens_dist"
PLAIN = {"ValueError", "FileNotFoundError", "TypeError"}
# pydantic turns what its validators raise into the one ConfigError (a UsageError) listing every problem
VALIDATORS = {"field_validator", "model_validator"}
# The plain raises that stay: file -> a fragment of each message. Each is an invariant (a bug if hit: a tensor of a
# pass, a position or layout the run built itself) or is caught at once, and says so in a comment beside it.
ALLOWED = {
    "data/bad_samples.py": ["label {int(y)} outside"],
    "data/corruptions.py": ["expected a float image tensor"],
    "data/ffcv_decode.py": ["need 0 < scale[0]"],
    "data/ffcv_io.py": ["need 0 ≤ rank < world_size and batch_size", "start batch {start_batch} outside"],
    "data/idx.py": ["split={split!r} is not one of"],
    "data/member_streams.py": ["member streams differ in length"],
    "data/ood.py": ["SVHNOOD: split={split!r}"],
    "data/sampler.py": ["start batch {start} outside"],
    "data/webdataset_io.py": ["need 0 ≤ rank < world_size, batch_size", "start batch {start_batch} outside"],
    "evaluation/metrics.py": ["ood_detection needs samples on both sides", "member_logits must have shape",
                              "target must have shape (B=", "target must hold integer class indices",
                              "target values must lie in", "expected member_logits (M="],
    "evaluation/plots.py": ["expected probs (N, K) and target", "probs must be probabilities",
                            "target values must lie in"],
    "methods/base.py": ["member-major batch of", "inputs must be a Tensor or a mapping",
                        "cannot find logits in the backbone output"],
    "methods/batch.py": ["BatchEnsembleLayer: batch of"],
    "methods/sigma.py": ["forward_members: batch size", "input tensors disagree on the batch size"],
    "sigma/layers/batchnorm.py": ["channels at dim 1"],
    "sigma/layers/sigma_norm.py": ["input batch dimension"],
    "sigma/layers/store.py": ["the affine columns must follow"],
    "sigma/regularizer.py": ["gamma must be (num_members, num_features)"],
    "training/objective.py": ["labels for {y.shape[0]} samples do not fit"],
}


def _plain_raises(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line, exception, message source) of every ``raise ValueError/FileNotFoundError/TypeError(...)`` in ``path``
    outside pydantic validators."""
    tree = parse_source(path)
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if not (isinstance(exc, ast.Name) and exc.id in PLAIN):
            continue
        scope = parent.get(node)
        while scope is not None and not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            scope = parent.get(scope)
        if scope is not None and {ast.unparse(d).split("(")[0] for d in scope.decorator_list} & VALIDATORS:
            continue
        args = node.exc.args if isinstance(node.exc, ast.Call) else []
        yield node.lineno, exc.id, ast.unparse(args[0]) if args else ""


def test_refusals_are_usage_errors_and_the_plain_raises_left_are_listed_invariants() -> None:
    """A new bare ``raise ValueError(...)`` (or FileNotFoundError, TypeError) in sigmanens_dist/ fails here: a
    refusal of the user's input is a UsageError (MissingPathError, UnsupportedError); a real invariant joins
    ALLOWED with a comment in the code saying why."""
    found, uncommented, used = [], [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        lines = path.read_text().splitlines()
        for line, name, message in _plain_raises(path):
            fragments = {(rel, f) for f in ALLOWED.get(rel, []) if f in message}
            used |= fragments
            if not fragments:
                found.append(f"{rel}:{line}: raise {name}({message[:80]}…)")
            elif not any("#" in text for text in lines[max(0, line - 3): line]):  # the raise line or two above
                uncommented.append(f"{rel}:{line}")
    assert not found, "refusals of the user's input are UsageError (sigmanens_dist/errors.py):\n" + "\n".join(found)
    assert not uncommented, "an allowed plain raise says why in a comment beside it: " + ", ".join(uncommented)
    listed = {(rel, fragment) for rel, fragments in ALLOWED.items() for fragment in fragments}
    assert listed == used, f"ALLOWED lists raises that are gone: {sorted(listed - used)}"


def test_no_error_message_carries_a_command_prefix() -> None:
    """Finding 12: ``sigmanens eval: error: sigmanens eval: …``: the commands print their name; a message does not."""
    prefixed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(parse_source(path)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args \
                    and re.match(r"f?['\"]sigmanens [\w-]+: ", ast.unparse(node.exc.args[0])):
                prefixed.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not prefixed
