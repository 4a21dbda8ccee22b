"""``sigmanens study``: a grid of training runs (M-scaling, τ or λ sweep, methods) as one MLflow parent run with one
child run per grid point, resumable, and defined by one file that a Slurm job array can submit unchanged.

Three parts, bottom first: ``grid`` (the kinds, the grid points and their overrides), ``bookkeeping`` (the
definition file, the MLflow parent run), ``running`` (the children, one or all); the command's parser is
:mod:`sigmanens_dist.cli.study`. Every name this module had as one file is importable from here (``main``, with a
DeprecationWarning, for one release).
"""

from __future__ import annotations

from typing import Any

from sigmanens_dist.deprecation import moved
from sigmanens_dist.experiments.study.bookkeeping import ensure_parent, load_definition, write_definition
from sigmanens_dist.experiments.study.grid import (
    AXES,
    BASE_CONFIG,
    CHILD_TAG,
    DEFINITION,
    KINDS,
    LAMBDA_POLICIES,
    METHOD_NAMES,
    ROLE_TAG,
    STUDY_TAG,
    TAU_SWEEP_LAMBDA,
    Child,
    StudyError,
    build_definition,
    method_table,
)
from sigmanens_dist.experiments.study.running import _command, child_state, run_one, run_study, trainer_args

__all__ = ["AXES", "BASE_CONFIG", "CHILD_TAG", "DEFINITION", "KINDS", "LAMBDA_POLICIES", "METHOD_NAMES", "ROLE_TAG",
           "STUDY_TAG", "TAU_SWEEP_LAMBDA", "Child", "StudyError", "build_definition", "child_state", "ensure_parent",
           "load_definition", "method_table", "run_one", "run_study", "trainer_args", "write_definition"]
_PRIVATE = (_command,)  # reached by the tests through this module


_moved = moved(__name__, {"main": "sigmanens_dist.cli.study"})  # the command's parser moved to cli/ (0.3)


def __getattr__(name: str) -> Any:
    if name == "METHODS":  # re-exported: the table once lived here
        return method_table()
    return _moved(name)
