"""Vetting a ``torch.export`` program (``.pt2``) before ``torch.export.load`` sees it: nothing a user loads runs code.

torch.export.load runs code from the file in several ways: payloads marked ``use_pickle`` and legacy weight files go
through torch.load(weights_only=False), opaque constants through pickle.loads, sample inputs fall back to
weights_only=False when the safe load fails, AOTInductor entries load a shared library, every symbolic shape
(``expr_str``) goes through sympy.sympify (an eval), ``guards_code`` is compiled into a Python function by
``.module()``, and a tree spec may name a module to import. A program this project writes uses none of these beyond
shape expressions of its batch size, so anything else is refused. Nor may loading hang: sympy computes what a shape
expression says (``Pow(Integer(10), Integer(100000000))`` never returns, nor does ``str`` of
``Float(Rational(1, 3), 300000000)``), so an expression may only have the forms torch.export writes for a batch size
(integers below 2**63, size symbols and a few integer operations, within 2000 characters: :func:`_allowed`), and every
integer of the graph fits in 64 bits, as a size does. What is allowed is listed, not what is refused: bounding one
way to make sympy compute leaves the next.

Standalone on purpose (torch and the standard library, nothing of sigmanens_dist): the same file is logged beside a
registered program (sigmanens_dist/registry/pyfunc_program.py) and vets it where the package is not installed.
:func:`sigmanens_dist.safe_load.check_program_file` is this check with the package's error types.
"""

from __future__ import annotations

import ast
import io
import json
import pickle
import re
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
# What torch.export writes for a program's one dynamic size (the batch): size symbols, 64-bit integers and the integer
# operations below, e.g. Min(Integer(10), Mul(Integer(10), Symbol('s77', positive=True, integer=True))). Nothing
# else passes: no Float or Rational (sympy computes a 10**9-bit mantissa for ever), no Pow, no other name sympify
# would call. Within 2000 characters such an expression is a product of at most a few hundred 64-bit numbers, which
# sympy computes at once.
_OPERATIONS = frozenset({"Add", "Mul", "Max", "Min", "FloorDiv", "CleanDiv", "Mod", "PythonMod"})
_ASSUMPTIONS = frozenset({"positive", "integer", "nonnegative", "real", "finite"})  # Symbol's keywords
_SYMBOL_NAME = re.compile(r"[a-z]+\d+")  # s77, u0
_EXPR_CHARS, _INT_BITS = 2000, 63


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
    """Every shape expression is of :func:`_size_expression`'s forms; no tree spec (a JSON string inside) names a
    module to import; every integer fits in 64 bits."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("__enum__", "default_factory_module"):
                raise _program_refused(what, path, f"a tree spec that imports a module ({key})")
            if key == "expr_str" and not _size_expression(value):
                raise ProgramRefused(f"{what} {path}: refused: it holds the shape expression {str(value)[:80]!r}, "
                                     "not of the forms torch.export writes for a program's batch size (size "
                                     "symbols, 64-bit integers, Add, Mul, Min, Max, FloorDiv, Mod; at most "
                                     f"{_EXPR_CHARS} characters), which sympy would eval and compute while loading: it "
                                     "could run any code, or take forever")
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


def _size_expression(text: Any) -> bool:
    """Whether ``text`` is a shape expression of the forms torch.export writes (see :data:`_OPERATIONS`), read as
    Python syntax only (``ast.parse`` evaluates nothing)."""
    if not isinstance(text, str) or len(text) > _EXPR_CHARS:
        return False
    try:
        return _allowed(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def _allowed(node: ast.AST) -> bool:
    """``Symbol('s77', positive=True, …)``, ``Integer(n)`` with |n| < 2**63, or an operation of
    :data:`_OPERATIONS` on such nodes; nothing else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return False
    name, args, keywords = node.func.id, node.args, node.keywords
    if name == "Symbol":
        return (len(args) == 1 and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)
                and bool(_SYMBOL_NAME.fullmatch(args[0].value))
                and all(k.arg in _ASSUMPTIONS and isinstance(k.value, ast.Constant) and isinstance(k.value.value, bool)
                        for k in keywords))
    if keywords:
        return False
    if name == "Integer":
        return len(args) == 1 and _small_int(args[0])
    return name in _OPERATIONS and len(args) >= 2 and all(map(_allowed, args))


def _small_int(node: ast.AST) -> bool:
    """A literal integer (``5``, ``-5``) below 2**63 in magnitude."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return (isinstance(node, ast.Constant) and type(node.value) is int
            and node.value.bit_length() <= _INT_BITS)
