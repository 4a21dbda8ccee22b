"""``sigmanens study``: a grid of training runs (M-scaling, τ or λ sweep, methods) as one MLflow parent run with one
child run per grid point, resumable, and defined by one file that a Slurm job array can submit unchanged.

Four parts, bottom first: ``definition`` (the study definition, a typed and versioned record), ``grid`` (the kinds,
the grid points and their overrides), ``bookkeeping`` (the definition file, the MLflow parent run), ``running`` (the
children, one or all); the command's parser is
:mod:`sigmanens_dist.cli.study`. The public names of the parts are importable from here.
"""

from __future__ import annotations

from sigmanens_dist.experiments.study.bookkeeping import ensure_parent, write_definition
from sigmanens_dist.experiments.study.definition import (
    VERSION,
    ChildSpec,
    StudyDefinition,
    StudyTracking,
    read_definition,
    save_definition,
)
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
    StudyError,
    build_definition,
    method_table,
)
from sigmanens_dist.experiments.study.running import child_state, run_one, run_study, trainer_args

__all__ = ["AXES", "BASE_CONFIG", "CHILD_TAG", "DEFINITION", "KINDS", "LAMBDA_POLICIES", "METHOD_NAMES", "ROLE_TAG",
           "STUDY_TAG", "TAU_SWEEP_LAMBDA", "VERSION", "ChildSpec", "StudyDefinition", "StudyError", "StudyTracking",
           "build_definition", "child_state", "ensure_parent", "method_table", "read_definition", "run_one",
           "run_study", "save_definition", "trainer_args", "write_definition"]
