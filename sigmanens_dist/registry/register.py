"""A program (``sigmanens export RUN --program OUT``) as an MLflow Model in MLflow's Model Registry, and back.

:func:`register_program` logs the program into the MLflow run that trained it as a pyfunc model (the code file
``pyfunc_program.py`` with ``program_check.py`` and the metadata's ``program_meta.py`` beside it, the ``.pt2`` or
``.onnx`` as its artifact, a signature and an input example, the program's metadata), registers a version of it
under a name with the metadata as the version's tags and description, and points an alias at it.
:func:`fetch_program` downloads the program a ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` URI names, for
``sigmanens predict``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sigmanens_dist import program_check, program_meta
from sigmanens_dist.atomic import file_sha256
from sigmanens_dist.errors import UnavailableError, UsageError
from sigmanens_dist.export import image_input
from sigmanens_dist.predict.backends import load_program
from sigmanens_dist.program_meta import ProgramMeta
from sigmanens_dist.training.tracking import RUN_ID_FILE, check_server

__all__ = ["MODEL_URI", "check_alias", "check_name", "check_registration", "check_store", "fetch_program",
           "recorded_tracking_uri", "register_program"]

PYFUNC_FILE = Path(__file__).with_name("pyfunc_program.py")  # the model's code (models from code)
# what the pyfunc imports, logged beside it (code_paths): standalone files, no sigmanens_dist where it is served
CODE_FILES = (program_check.__file__, program_meta.__file__, image_input.__file__)
PROGRAM_ARTIFACT = "program"  # pyfunc_program.PROGRAM: the artifact the pyfunc loads
# the logged model's name inside its run (MLflow allows fewer characters there than in a registered name, '.' not)
LOGGED_MODEL = "sigmanens-program"
TAG_PREFIX = "sigmanens."
# the schemes MLflow's Model Registry has a store for, less its file store (refused: check_store)
_REGISTRY_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")
MODEL_URI = re.compile(r"models:/(?P<name>[\w.-]+)(?:@(?P<alias>[\w-]+)|/(?P<version>\d+))")
_NAME = re.compile(r"[\w.-]{1,256}")  # what models:/NAME@ALIAS can carry unambiguously
_ALIAS = re.compile(r"[\w-]{1,255}")  # MLflow's own rule for aliases, less the reserved names below


def check_name(name: str, flag: str) -> str:
    """A registered model's name, refused unless ``models:/NAME@ALIAS`` can name it and MLflow's own check of a
    registered model's name passes (so nothing is written for a name the registry would refuse after it)."""
    if not _NAME.fullmatch(name):
        raise UsageError(f"{flag} {name!r}: a registered model's name is letters, digits, '_', '-' and '.' (at "
                         "most 256), so that models:/NAME@ALIAS names it")
    from mlflow.exceptions import MlflowException  # optional extra: mlflow
    from mlflow.utils.validation import _validate_model_name

    try:
        _validate_model_name(name)
    except MlflowException as err:
        raise UsageError(f"{flag} {name!r}: MLflow refuses it as a registered model's name "
                         f"({err.message.splitlines()[0][:200]})") from None
    return name


def check_alias(alias: str | None) -> str | None:
    """An alias, refused unless MLflow takes it: letters, digits, '_' and '-', not ``latest`` nor ``v<N>``."""
    if alias is not None and (not _ALIAS.fullmatch(alias) or alias.lower() == "latest"
                              or re.fullmatch(r"[vV]\d+", alias)):
        raise UsageError(f"--alias {alias!r}: an alias is letters, digits, '_' and '-', and neither 'latest' nor "
                         "v<number> (MLflow reserves those), e.g. champion")
    return alias


def recorded_tracking_uri(checkpoint: Path) -> str | None:
    """The tracking URI the trainer of ``checkpoint`` logged to: its run directory's ``mlflow_run.txt`` (the run
    directory itself, or the folder above a ``checkpoints/`` entry); None when the run was not tracked."""
    path = Path(checkpoint).resolve()
    for folder in [path, *path.parents][:3]:
        if (folder / RUN_ID_FILE).is_file():
            parts = (folder / RUN_ID_FILE).read_text().split()
            return parts[0] if parts else None
    return None


def check_store(uri: str) -> str:
    """Refuse, in one line before anything is read or written, a store MLflow's Model Registry cannot be: a scheme
    it has no registry for, a folder (MLflow's file store, which it refuses for the registry) and a sqlite file that
    is not there (a typo would otherwise create an empty database, and its folders)."""
    scheme = uri.partition("://")[0].split("+")[0] if "://" in uri else ""
    if scheme in ("", "file"):
        raise UsageError(f"tracking store {uri}: a folder (MLflow's file store), which MLflow keeps in maintenance "
                         "mode and refuses for the Model Registry; give a tracking server (http://HOST:PORT) or a "
                         "database (sqlite:///PATH.db)")
    if scheme not in _REGISTRY_SCHEMES:
        raise UsageError(f"tracking store {uri!r}: MLflow's Model Registry has no store of scheme {scheme!r}; give "
                         "http(s)://HOST:PORT (a tracking server), sqlite:///PATH.db or a postgresql://, mysql:// or "
                         "mssql:// database")
    if scheme == "sqlite" and not Path(uri.partition(":///")[2]).is_file():
        raise UsageError(f"tracking store {uri}: no such sqlite file {uri.partition(':///')[2]!r} (the registry is "
                         "a store that already holds the runs; nothing is created for a path that is not there)")
    return uri


def _client(uri: str) -> Any:
    """A client of ``uri`` (checked by :func:`check_store`), failing fast on a server that does not answer: one
    :class:`~sigmanens_dist.errors.UnavailableError` line, not a traceback of MLflow's retry loop."""
    check_store(uri)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    check_server(uri)
    import mlflow  # optional extra: mlflow

    return mlflow.MlflowClient(uri)


@contextlib.contextmanager
def _fluent_uri(uri: str) -> Iterator[None]:
    """MLflow's global tracking and registry URI at ``uri`` while the fluent calls that log a model run, then back as
    they were: MLflow also exports them (and the experiment set meanwhile) as MLFLOW_TRACKING_URI,
    MLFLOW_REGISTRY_URI and MLFLOW_EXPERIMENT_ID, which every later subprocess of this process (a trainer, a Slurm
    job) would inherit."""
    import mlflow  # optional extra: mlflow

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI",
                                                     "MLFLOW_EXPERIMENT_ID")}  # set_experiment exports it too
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved["MLFLOW_TRACKING_URI"])
        mlflow.set_registry_uri(saved["MLFLOW_REGISTRY_URI"])
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _signature(program: Any, example: np.ndarray) -> Any:
    """No input schema (the model takes float images or a column of image files, and checks both itself: see
    pyfunc_program.py); one named output per program output, its dtype and shape what the program returns for
    ``example`` (the batch axis free)."""
    from mlflow.models import ModelSignature  # optional extra: mlflow
    from mlflow.types import Schema, TensorSpec

    outputs = program(torch.from_numpy(example))
    return ModelSignature(None, Schema([TensorSpec(value.dtype, (-1, *value.shape[1:]), name)
                                        for name, value in outputs.items()]))


def _tags(meta: dict[str, Any]) -> dict[str, str]:
    """The metadata as model-version tags, ``sigmanens.<key>`` (nested keys joined by '.'), lists as JSON; the input
    description, normalisation and output names stay in the model's MLmodel file (``metadata.sigmanens``)."""
    tags: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}", sub)
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            tags[prefix] = text if len(text) <= 5000 else text[:4997] + "..."

    for key, value in meta.items():
        if key not in ("input", "normalisation", "outputs", "format"):
            walk(TAG_PREFIX + key, value)
    return tags


def _description(meta: ProgramMeta, run_id: str) -> str:
    """One line a person reads in the registry: what the program is and where it comes from."""
    members = f"{len(meta.members)} of {meta.trained_members} members"
    tau = f", τ={meta.tau:g}" if meta.tau is not None else ""
    sets = meta.conformal
    conformal = f", {sets.score} sets at α={sets.alpha:g}" if sets else ""
    return (f"sigmanens program ({meta.program_format}): {meta.method} ({members}{tau}) on {meta.dataset}, "
            f"T={meta.temperature:.4g}{conformal}; run {run_id} step {meta.step}, sigmanens-dist "
            f"{meta.package_version}")


def check_registration(uri: str, run_id: str | None, name: str, alias: str | None) -> Any:
    """Refuse a registration that cannot happen, before the program is exported for it (``export --register``
    would otherwise leave OUT written and the registration undone): a bad name or alias, a run trained without
    MLflow (no run to log the model into) or one the store ``uri`` does not hold (a :class:`UsageError`), a
    server that does not answer (an :class:`~sigmanens_dist.errors.UnavailableError`). Returns the MLflow run."""
    from mlflow.exceptions import MlflowException  # optional extra: mlflow

    check_name(name, "--register")
    check_alias(alias)
    if run_id is None:
        raise UsageError("--register: the run was trained without MLflow tracking (its checkpoint names no MLflow "
                         "run), so there is no run to log the model into")
    client = _client(uri)
    try:
        return client.get_run(run_id)
    except MlflowException as err:
        if err.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise UsageError(f"--register: the run's MLflow run {run_id} is not in {uri}; give the store it was tracked "
                         "in (--tracking-uri)") from None


def register_program(program: Path, name: str, *, uri: str, run: Any, alias: str | None = None,
                     tags: dict[str, str] | None = None) -> Any:
    """Log ``program`` into ``run`` (the MLflow run of store ``uri`` that :func:`check_registration` returned for
    ``name`` and ``alias``, before the program was written) as a pyfunc model, register it as a new version of
    ``name`` (created if missing) tagged with its metadata and ``tags``, point ``alias`` at it; returns the version.
    The program is loaded (and a ``.pt2`` vetted) as ``sigmanens predict`` loads it."""
    import mlflow  # optional extra: mlflow
    from mlflow.exceptions import MlflowException

    run_id = run.info.run_id
    client = mlflow.MlflowClient(uri)
    loaded = load_program(program, torch.device("cpu"))
    meta = loaded.meta
    example = np.full((2, *meta.input.chw), 0.5, dtype=np.float32)
    runtime = "onnxruntime" if program.suffix == ".onnx" else "torch"
    requirements = [f"{dist}=={importlib.metadata.version(dist)}" for dist in ("mlflow", "numpy", runtime)]
    left = f"nothing registered; maybe a logged model {LOGGED_MODEL!r} left PENDING in run {run_id}"
    try:
        with _fluent_uri(uri):
            mlflow.set_experiment(experiment_id=run.info.experiment_id)
            info = mlflow.models.Model.log(
                None, name=LOGGED_MODEL, flavor=mlflow.pyfunc, run_id=run_id, python_model=str(PYFUNC_FILE),
                artifacts={PROGRAM_ARTIFACT: str(program)}, code_paths=list(CODE_FILES),
                signature=_signature(loaded, example), input_example=example,
                metadata={"sigmanens": meta.to_dict()}, pip_requirements=requirements)
        left = f"the model logged as {info.model_uri} in run {run_id}, no version of {name} registered"
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version_tags = {**_tags(meta.to_dict()), f"{TAG_PREFIX}program_sha256": file_sha256(program), **(tags or {})}
        version = client.create_model_version(name, info.model_uri, run_id=run_id, tags=version_tags,
                                              description=_description(meta, run_id), model_id=info.model_id)
        left = f"models:/{name}/{version.version} registered, the alias {alias} not set"
        if alias is not None:
            client.set_registered_model_alias(name, alias, version.version)
    except (MlflowException, OSError) as err:  # requests' errors are OSErrors
        _gone(uri, f"during the registration ({left})", err)
        raise
    return version


def _gone(uri: str, when: str, err: BaseException) -> None:
    """Raise one :class:`~sigmanens_dist.errors.UnavailableError` line when the server ``uri`` no longer answers
    (what failed was the connection, and ``when`` says what was left); return otherwise, so that any other
    failure keeps its traceback."""
    try:
        check_server(uri)
    except UnavailableError as down:
        raise UnavailableError(f"{down} (it stopped answering {when})") from err


def fetch_program(model_uri: str, tracking_uri: str | None, dest: Path) -> Path:
    """Download the model ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` names into ``dest``; the path of its
    program file. A URI of another form, a name, alias or version the registry does not have, and a model that
    is not a sigmanens program are refused in one line."""
    if not MODEL_URI.fullmatch(model_uri):
        raise UsageError(f"PROGRAM {model_uri}: give models:/NAME@ALIAS or models:/NAME/VERSION")
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise UsageError(f"PROGRAM {model_uri}: give the registry's store (--tracking-uri, or MLFLOW_TRACKING_URI)")
    _client(uri)
    import mlflow  # optional extra: mlflow
    from mlflow.exceptions import MlflowException

    quiet = logging.getLogger("mlflow.store.artifact.artifact_repo")  # "No artifacts found": said below, once
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with _fluent_uri(uri):  # a models:/ URI is resolved by the global registry URI
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dest),
                                                             tracking_uri=uri))
    except MlflowException as err:
        if err.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            _gone(uri, f"while {model_uri} was downloaded", err)
            raise
        raise UsageError(f"PROGRAM {model_uri}: not in the registry of {uri} "
                         f"({str(err).splitlines()[0][:200]})") from None
    except OSError as err:  # requests' errors are OSErrors
        _gone(uri, f"while {model_uri} was downloaded", err)
        raise
    finally:
        quiet.setLevel(level)
    if not (local / "MLmodel").is_file():  # MLflow downloads nothing, without an error, when the files are gone
        raise UsageError(f"PROGRAM {model_uri}: the registry of {uri} names it, but its files are gone from the "
                         "artifact store (no MLmodel there); register the program again")
    flavor = mlflow.models.Model.load(str(local)).flavors.get("python_function", {})
    artifact = flavor.get("artifacts", {}).get(PROGRAM_ARTIFACT, {}).get("path")
    if artifact is None or not (local / artifact).is_file():
        raise UsageError(f"PROGRAM {model_uri}: not a sigmanens program (the model has no {PROGRAM_ARTIFACT!r} "
                         "artifact); register one with sigmanens export RUN --program OUT --register NAME")
    return local / artifact
