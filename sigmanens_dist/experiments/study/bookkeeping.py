"""A study's bookkeeping: the definition file (written atomically beside a copy of the base config) and the MLflow
parent run the children report to (created once, its params, its final status)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from sigmanens_dist.config import recipe_path
from sigmanens_dist.experiments.study.definition import StudyDefinition, read_definition, save_definition
from sigmanens_dist.experiments.study.grid import BASE_CONFIG, DEFINITION, ROLE_TAG, STUDY_TAG, StudyError
from sigmanens_dist.training.tracking import ensure_experiment

log = logging.getLogger("sigmanens.study")

__all__ = ["ensure_parent", "write_definition"]


def write_definition(definition: StudyDefinition, config: Path | None) -> Path:
    """Write ``<out>/study.yaml`` (and a copy of the base config beside it), or check that the one already there
    describes the same study; returns its path. A different study in the same folder is an error."""
    out = Path(definition.out)
    path = out / DEFINITION
    base_copy = out / BASE_CONFIG
    config = recipe_path(config) if config is not None else None
    if path.is_file():
        old = read_definition(path)
        differs = [k for k in ("kind", "overrides", "nproc", "lambda_policy", "max_backbone_batch", "axes")
                   if getattr(old, k) != getattr(definition, k)]
        if [c.overrides for c in old.children] != [c.overrides for c in definition.children]:
            differs.append("children")
        if config is not None and (not base_copy.is_file() or base_copy.read_bytes() != config.read_bytes()):
            differs.append(f"base config ({config} differs from the copy in {base_copy})")
        if differs:
            raise StudyError(f"{path} defines a different study (differs in: {', '.join(differs)}); continue it as "
                             f"defined with `sigmanens study resume {out}`, or start this one with another --out")
        return path
    out.mkdir(parents=True, exist_ok=True)
    if config is not None:
        shutil.copyfile(config, base_copy)
    save_definition(path, definition)
    return path


def ensure_parent(definition: StudyDefinition, path: Path) -> str | None:
    """Create the parent run once (its id is stored in the definition file, which every child reads), log the grid
    to it, and mark it running. An unreachable store is a warning: the children still train and track locally."""
    tracking = definition.tracking
    if tracking.uri is None:
        return None
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    try:
        from mlflow import MlflowClient  # optional extra: mlflow

        client = MlflowClient(tracking.uri)
        if tracking.parent_run_id is None:
            exp_id = ensure_experiment(client, tracking.experiment, tracking.uri)
            run = client.create_run(exp_id, run_name=definition.name,
                                    tags={ROLE_TAG: "parent", STUDY_TAG: definition.name,
                                          "sigmanens.kind": definition.kind})
            tracking.parent_run_id = run.info.run_id
            save_definition(path, definition)
            client.log_batch(run.info.run_id, params=_parent_params(definition))
            client.log_artifact(run.info.run_id, str(path))
        else:
            client.update_run(tracking.parent_run_id, status="RUNNING")
        return tracking.parent_run_id
    except Exception as err:  # an unreachable server must not stop the study; its children track locally
        log.warning("MLflow parent run at %s failed (%s: %s); the children run without one", tracking.uri,
                    type(err).__name__, str(err).splitlines()[0][:200])
        return tracking.parent_run_id


def _parent_params(definition: StudyDefinition) -> list[Any]:
    from mlflow.entities import Param  # optional extra: mlflow

    params = {"study.kind": definition.kind, "study.children": len(definition.children),
              "study.base_config": definition.base_config, "study.overrides": " ".join(definition.overrides),
              "study.nproc": definition.nproc, "study.lambda_policy": definition.lambda_policy,
              "study.lambda_policy_text": definition.lambda_policy_text,
              "study.global_batch": definition.global_batch,
              "study.max_backbone_batch": definition.max_backbone_batch}
    if definition.reg_normalize is not None:
        params["study.reg_normalize"] = definition.reg_normalize
    params.update({f"study.grid.{axis}": ",".join(map(str, values)) for axis, values in definition.axes.items()})
    return [Param(k, str(v)[:500]) for k, v in params.items()]


def _finish_parent(definition: StudyDefinition, status: str) -> None:
    run_id = definition.tracking.parent_run_id
    if run_id is None:
        return
    try:
        from mlflow import MlflowClient  # optional extra: mlflow

        MlflowClient(definition.tracking.uri).set_terminated(run_id, status=status)
    except Exception as err:
        log.warning("could not mark the parent run %s %s (%s)", run_id, status, err)
