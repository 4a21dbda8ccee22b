"""Vetting a ``torch.export`` program (``.pt2``) before ``torch.export.load`` sees it: nothing a user loads runs code.

torch.export.load runs code from the file in several ways: payloads marked ``use_pickle`` and legacy weight files go
through torch.load(weights_only=False), opaque constants through pickle.loads, sample inputs fall back to
weights_only=False when the safe load fails, AOTInductor entries load a shared library, every symbolic shape
(``expr_str``) goes through sympy.sympify (an eval), ``guards_code`` is compiled into a Python function by
``.module()``, and a tree spec may name a module to import. A program this project writes uses none of these beyond
plain shape expressions, so anything else is refused. Nor may loading hang: sympy computes what a shape expression
says (``Pow(Integer(10), Integer(100000000))`` never returns), so every expression is bounded in length and in the
magnitude it can reach, and every integer of the graph fits in 64 bits, as a size does.

Standalone on purpose (torch and the standard library, nothing of sigmanens_dist): the same file is logged beside a
registered program (sigmanens_dist/registry/pyfunc_program.py) and vets it where the package is not installed.
:func:`sigmanens_dist.safe_load.check_program_file` is this check with the package's error types.
"""

from __future__ import annotations

import ast
import io
import json
import math
import pickle
import re
import tokenize
from pathlib import Path
from typing import Any

import torch

__all__ = ["ZIP_MAGIC", "ProgramError", "ProgramRefused", "check_program", "unreadable"]

ZIP_MAGIC = b"PK\x03\x04"  # how torch.load tells its zip format from the legacy one: the first four bytes


class ProgramError(ValueError):
    """A file that is not a readable ``torch.export`` program (one line naming it)."""


class ProgramRefused(ProgramError):
    """A program that would run code when loaded."""


def unreadable(what: str, path: Any, err: BaseException) -> str:
    """One line for a file torch could not read: torch's own finding, not its advice around it."""
    text = str(err).split("WeightsUnpickler error:")[-1]
    detail = ([line.strip() for line in text.splitlines() if line.strip()] or [type(err).__name__])[0][:200]
    return f"{what} {path}: unreadable (truncated, empty or not this format: {detail})"


# the entries of a program of plain tensors, as torch.export.save writes it
_PROGRAM_RECORD = re.compile(r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
                             r"|models/model\.json|data/sample_inputs/model\.pt|extra/[^/]+"
                             r"|data/weights/model_weights_config\.json|data/weights/weight_\d+"
                             r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+")
# names a shape expression may call: sympy's own constructors (as srepr writes them) and torch's shape functions
_SYMPY_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "floor", "ceiling",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan",
    "Equality", "Unequality", "And", "Or", "Not", "Piecewise", "ITE", "true", "false", "True", "False", "oo", "zoo",
    "nan", "Infinity", "NegativeInfinity", "Half", "One", "Zero", "NegativeOne", "IntInfinity",
    "NegativeIntInfinity", "BooleanTrue", "BooleanFalse", "FloorDiv", "ModularIndexing", "Where", "PythonMod",
    "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "IntTrueDiv", "FloatTrueDiv", "LShift", "RShift",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat",
    "FloatPow", "PowByNatural", "Identity"})
_SYMBOL_NAME = re.compile(r"[a-z]+\d+")  # s77, u0: a name sympify turns into a Symbol
_EXPR_OPS = frozenset({"(", ")", ",", "+", "-", "*", "/", "**", "//", "%", "=", "<", ">", "<=", ">=", "==", "!=", "&",
                       "|", "~"})
_QUOTED_NAME = re.compile(r"""(['"])[A-Za-z_]\w*\1""")
# The bounds of what sympy is made to compute: a program's expressions are a few symbols and small integers (sizes,
# strides: below 2**64), so 4096 bits and 2000 characters leave room for any real one and cost sympy nothing.
_EXPR_CHARS, _EXPR_BITS, _SYMBOL_BITS = 2000, 4096, 64
_POWERS = frozenset({"Pow", "FloatPow", "PowByNatural"})
_PRODUCTS = frozenset({"Mul", "Rational", "FloorDiv", "CleanDiv", "CeilDiv", "IntTrueDiv", "FloatTrueDiv", "LShift",
                       "RShift", "ModularIndexing"})
_CONSTANTS = {"Half": 0.5, "One": 1, "Zero": 0, "NegativeOne": -1}


def check_program(path: Path | str, what: str = "PROGRAM") -> None:
    """Refuse (one line) a ``.pt2`` that ``torch.export.load`` or ``.module()`` would run code from (the ways the
    module's docstring lists); return quietly for a program made only of JSON, raw tensor bytes and plain shape
    expressions."""
    with open(path, "rb") as f:
        if f.read(4) != ZIP_MAGIC:
            raise ProgramError(f"{what} {path}: not a torch.export program (.pt2, a zip archive)")
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        records = reader.get_all_records()
        if "models/model.json" not in records:
            raise ProgramError(f"{what} {path}: not a torch.export program (no models/model.json)")
        for name in records:
            if not _PROGRAM_RECORD.fullmatch(name):
                raise _program_refused(what, path, f"the entry {name!r}, which a saved program of plain tensors "
                                                   "does not have")
        for name in ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json"):
            if name in records:
                pickled = [k for k, v in json.loads(reader.get_record(name))["config"].items() if v["use_pickle"]]
                if pickled:
                    raise _program_refused(what, path, f"pickled payloads ({pickled[0]!r})")
        if "data/sample_inputs/model.pt" in records:
            _sample_inputs(reader.get_record("data/sample_inputs/model.pt"), what, path)
        model = json.loads(reader.get_record("models/model.json"))
    except (RuntimeError, KeyError, TypeError, ValueError) as err:
        if isinstance(err, ProgramError):
            raise
        raise ProgramError(unreadable(what, path, err)) from None
    if model.get("guards_code"):
        raise _program_refused(what, path, "guards code, which .module() compiles into Python")
    _check_program_json(model, what, path)


def _sample_inputs(data: bytes, what: str, path: Any) -> None:
    """torch loads a program's sample inputs with ``weights_only`` and, when that fails, without restriction: the
    same safe load must succeed here (nothing besides tensors and plain values)."""
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        name = found.group(1) if found else "other objects"
        raise _program_refused(what, path, f"sample inputs naming {name}") from None
    except (RuntimeError, EOFError, ValueError, TypeError, OverflowError, MemoryError, KeyError, AttributeError,
            IndexError, UnicodeDecodeError) as err:
        raise ProgramError(unreadable(what, path, err)) from None


def _program_refused(what: str, path: Any, name: str) -> ProgramRefused:
    return ProgramRefused(f"{what} {path}: refused: it holds {name}, and loading it could run any code")


def _check_program_json(node: Any, what: str, path: Any) -> None:
    """Every shape expression passes :func:`_plain_expression`; no tree spec (a JSON string inside) names a module
    to import."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("__enum__", "default_factory_module"):
                raise _program_refused(what, path, f"a tree spec that imports a module ({key})")
            if key == "expr_str" and not _plain_expression(value):
                raise _program_refused(what, path, f"the shape expression {str(value)[:80]!r}, which sympy evals")
            if key == "expr_str" and not _bounded_expression(value):
                raise ProgramRefused(f"{what} {path}: refused: it holds the shape expression {value[:80]!r}, longer "
                                     f"than {_EXPR_CHARS} characters or reaching beyond 2**{_EXPR_BITS}, which sympy "
                                     "would compute while loading (it can take forever)")
            _check_program_json(value, what, path)
    elif isinstance(node, list):
        for value in node:
            _check_program_json(value, what, path)
    elif isinstance(node, int) and node.bit_length() > 64:
        raise ProgramRefused(f"{what} {path}: refused: it holds the integer {str(node)[:40]}…, beyond the 64 bits of "
                             "any size or index a program has")
    elif isinstance(node, str) and node.lstrip()[:1] in ("[", "{"):
        try:
            inner = json.loads(node)
        except ValueError:
            return
        _check_program_json(inner, what, path)


def _plain_expression(text: Any) -> bool:
    """Whether ``text`` is an arithmetic expression of sympy constructors, symbol names, numbers and quoted names:
    nothing sympify's eval could turn into a call of anything else."""
    if not isinstance(text, str):
        return False
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                  if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)]
    except (tokenize.TokenError, SyntaxError):
        return False
    for i, tok in enumerate(tokens):
        keyword = i + 1 < len(tokens) and tokens[i + 1].string == "=" and tok.type == tokenize.NAME
        if tok.type == tokenize.NAME:
            if not (tok.string in _SYMPY_NAMES or _SYMBOL_NAME.fullmatch(tok.string)
                    or (keyword and not tok.string.startswith("_"))):
                return False
        elif tok.type == tokenize.STRING:
            if not _QUOTED_NAME.fullmatch(tok.string):
                return False
        elif tok.type == tokenize.OP:
            if tok.string not in _EXPR_OPS:
                return False
        elif tok.type != tokenize.NUMBER:
            return False
    return True


def _bounded_expression(text: str) -> bool:
    """Whether the plain expression ``text`` (:func:`_plain_expression`) is short and its value, whatever its
    symbols (each a size, below 2**64), stays below 2**_EXPR_BITS, so that sympy computes it at once."""
    if len(text) > _EXPR_CHARS:
        return False
    try:
        return _bits(ast.parse(text.strip(), mode="eval").body) <= _EXPR_BITS
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def _bits(node: ast.AST) -> float:
    """An upper bound of log2 of the magnitude of ``node``'s value (≥ 0, so that no part of an expression is bigger
    than the whole); ``inf`` for what cannot be bounded (a power whose exponent is not a literal number, a construct
    no program has)."""
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float) or not value or not math.isfinite(value):
            return 0.0
        return max(math.log2(abs(value)) + 1, 0.0)
    if isinstance(node, ast.Name):
        return _SYMBOL_BITS
    if isinstance(node, ast.UnaryOp):
        return _bits(node.operand)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Pow):
            return _power(node.left, node.right)
        left, right = _bits(node.left), _bits(node.right)
        return left + right if isinstance(node.op, ast.Mult | ast.Div | ast.FloorDiv) else max(left, right) + 1
    if isinstance(node, ast.Compare):
        return max(map(_bits, [node.left, *node.comparators]))
    if isinstance(node, ast.BoolOp | ast.Tuple):
        return max(map(_bits, node.values if isinstance(node, ast.BoolOp) else node.elts), default=0.0)
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or any(
            isinstance(arg, ast.Starred) for arg in node.args) or not all(k.arg for k in node.keywords):
        return math.inf
    name, args = node.func.id, node.args
    options = max((_bits(k.value) for k in node.keywords), default=0.0)  # a symbol's assumptions: evaluated too
    if name in _POWERS and len(args) == 2:
        return max(_power(*args), options)
    bits = [_bits(arg) for arg in args]
    if name == "Symbol":
        value = _SYMBOL_BITS
    elif name in _PRODUCTS:
        value = sum(bits) + (_literal(args[-1]) if name == "LShift" and args else 0.0)
    else:
        value = max(bits, default=0.0) + math.log2(len(bits) + 1)
    return max(value, *bits, options)


def _power(base: ast.AST, exponent: ast.AST) -> float:
    """The bits of ``base ** exponent``: bounded only for a literal exponent."""
    return _bits(base) * max(abs(_literal(exponent)), 1.0)


def _literal(node: ast.AST) -> float:
    """The value of a literal number (``3``, ``-2``, ``Integer(3)``, ``Rational(1, 2)``, ``Half``); ``inf`` for
    anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value) if abs(node.value) < 2**_EXPR_BITS else math.inf
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return _literal(node.operand)
    if isinstance(node, ast.Name):
        return _CONSTANTS.get(node.id, math.inf)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        values = [_literal(arg) for arg in node.args]
        if not all(map(math.isfinite, values)):
            return math.inf
        if node.func.id in ("Integer", "Float") and len(values) == 1:
            return values[0]
        if node.func.id == "Rational" and len(values) == 2 and values[1]:
            return values[0] / values[1]
    return math.inf
