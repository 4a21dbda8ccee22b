"""The study definition as one typed, versioned record: :class:`StudyDefinition` is what ``<out>/study.yaml`` holds,
written by one function (:func:`save_definition`) and read by one (:func:`read_definition`), so no other module
knows the file's keys, and a definition of a later layout is refused in one line instead of failing on a missing key
in a Slurm array element hours later.

Versions (:data:`VERSION` is the one this code writes; every older one is read):

1. every definition written up to and including release 0.3.0 (those carry no ``version`` key;
   ``tests/fixtures/study_v1`` is one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sigmanens_dist.atomic import write_text
from sigmanens_dist.errors import UsageError

__all__ = ["VERSION", "ChildSpec", "StudyDefinition", "StudyTracking", "read_definition", "save_definition"]

#: The layout this code writes; a definition of a higher one is refused.
VERSION = 1


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChildSpec(_Record):
    """One grid point: its index and name (also its run directory and MLflow run name), its grid values (method,
    members, tau, lambda, budget, seed) and the trainer overrides that make it."""

    index: int = Field(ge=0)
    name: str
    point: dict[str, Any]
    overrides: list[str]


class StudyTracking(_Record):
    """Where the children report: the store (None: not tracked), the experiment, and the parent run once created."""

    uri: str | None
    experiment: str
    parent_run_id: str | None = None


class StudyDefinition(_Record):
    """A study: its kind and grid, the base config (copied beside the definition) and overrides every child gets,
    the launch (processes per child), the λ policy, the global batch, the tracking and every child."""

    version: int = VERSION
    kind: str
    name: str
    out: str
    base_config: str | None
    overrides: list[str]
    nproc: int = Field(ge=1)
    lambda_policy: str
    lambda_policy_text: str
    reg_normalize: str | None
    max_backbone_batch: int | None
    global_batch: int
    axes: dict[str, list[Any]]
    tracking: StudyTracking
    children: list[ChildSpec]


def read_definition(path: Path, text: str | None = None) -> StudyDefinition:
    """The definition in ``path`` (or ``text``, a copy of it named by ``path``, e.g. one logged to MLflow); a
    missing file, one that is not a definition and one of a later version are each one :class:`UsageError` line."""
    if text is None:
        if not path.is_file():
            raise UsageError(f"--definition {path}: no such file (write it with `sigmanens study <kind> ... "
                             "--prepare`)")
        text = path.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UsageError(f"{path} is not a study definition (not YAML: {str(err).splitlines()[0]})") from None
    if not isinstance(raw, dict) or "children" not in raw:
        raise UsageError(f"{path} is not a study definition (no 'children')")
    version = raw.get("version", 1)
    if not isinstance(version, int) or version > VERSION:
        raise UsageError(f"{path}: a study definition of version {version!r}, written by a later sigmanens-dist; "
                         f"this one reads versions 1 to {VERSION}: upgrade it to run this study")
    try:
        return StudyDefinition.model_validate({**raw, "version": version})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
        raise UsageError(f"{path} is not a study definition of version {version} ({problems})") from None


def save_definition(path: Path, definition: StudyDefinition) -> None:
    """Write ``definition`` to ``path`` atomically, with the command a Slurm array element runs it by."""
    write_text(path, "# written by `sigmanens study`; a Slurm array runs element I with\n"
               f"#   sigmanens study run-one --definition {path} --index $SLURM_ARRAY_TASK_ID\n"
               + yaml.safe_dump(definition.model_dump(mode="json"), sort_keys=False, width=120))
