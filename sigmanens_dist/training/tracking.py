"""Experiment tracking: MLflow on rank 0, plus a local ``metrics.jsonl`` that is always written.

A tracking server that is down must never kill a week-long run: every MLflow call is guarded; the first failure is
reported once, MLflow is switched off for the rest of the run, and metrics keep going to ``metrics.jsonl``.

What users meet in the MLflow UI is set up here too: a new experiment in a sqlite store keeps its artifacts in
``mlartifacts/`` beside the ``.db`` file (MLflow's default, ``./mlruns`` of whatever directory the first run started
in, breaks ``mlflow ui`` started anywhere else); every experiment is tagged as model development (MLflow 3 otherwise
opens the GenAI overview); the training data is logged as a run input; and a run started with
``tracking.parent_run_id`` is nested under that run (a study's parent), in the parent's experiment, even when another
process or a Slurm array element starts it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sigmanens_dist.atomic import write_text
from sigmanens_dist.errors import UnavailableError, UsageError

__all__ = ["EXPERIMENT_KIND", "PARENT_TAG", "RUN_ID_FILE", "ParentRunNotFound", "Tracker", "artifact_root_for",
           "check_server", "default_tracking_uri", "ensure_experiment", "read_records", "set_status", "ui_hint"]

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"  # what the MLflow UI nests runs by
RUN_ID_FILE = "mlflow_run.txt"  # <run_dir>/mlflow_run.txt: the tracking URI and the run id, one per line
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


class ParentRunNotFound(UsageError):
    """``tracking.parent_run_id`` names a run the (reachable) store does not have: a config error, not an outage."""


def default_tracking_uri(run_dir: Path, uri: str | None) -> str:
    """Config value, else ``$MLFLOW_TRACKING_URI``, else a sqlite store beside the run directories."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path(run_dir).resolve().parent / 'mlflow.db').as_posix()}"


def artifact_root_for(uri: str) -> str | None:
    """``<folder of the .db>/mlartifacts`` for a sqlite store; None (the server's own default) for anything else."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


def ui_hint(uri: str, experiment_id: str) -> str:
    """How to open an experiment's runs in the MLflow UI. MLflow 3 opens a fresh browser in its GenAI overview; the
    ``workflowType=machine_learning`` runs view is what a training run needs. A sqlite store needs ``mlflow ui``
    started on it first (port 5000)."""
    runs = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    if uri.startswith(("http://", "https://")):
        return f"MLflow UI: {uri.rstrip('/')}/{runs}"
    return f"MLflow UI: mlflow ui --backend-store-uri {uri}  then open http://127.0.0.1:5000/{runs}"


def ensure_experiment(client: Any, name: str, uri: str) -> str:
    """The id of experiment ``name``, created if missing (artifacts beside a sqlite store; an existing experiment
    keeps its location, which MLflow cannot change), tagged as model development either way."""
    from mlflow.exceptions import MlflowException  # optional extra: mlflow

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            exp_id = client.create_experiment(name, artifact_location=artifact_root_for(uri))
        except MlflowException:  # another process (a sibling array element) created it first
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
            exp_id = exp.experiment_id
    else:
        exp_id = exp.experiment_id
    if exp is None or exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(exp_id, *EXPERIMENT_KIND)
    return exp_id


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Tracker:
    """Rank 0 logs; other ranks get a tracker whose calls do nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool, active: bool, uri: str | None, experiment: str) -> None:
        self.run_dir = Path(run_dir)
        self.active = active
        self.uri = default_tracking_uri(run_dir, uri) if enabled else None
        self.experiment = experiment
        self.run_id: str | None = None
        self._mlflow: Any = None
        self._local = self.run_dir / "metrics.jsonl"
        self._global_batch = 0

    def start(self, run_name: str, run_id: str | None, params: dict[str, Any], tags: dict[str, str]) -> str | None:
        """Start (or, given the id saved in a checkpoint, continue) the MLflow run; returns its id.

        ``params`` is the flattened config (:func:`sigmanens_dist.config.flatten`): it is logged as the run's params,
        and its ``tracking.parent_run_id`` and ``data.*`` keys give the parent run and the dataset input.
        """
        if not self.active or self.uri is None:
            return run_id
        self._end_abandoned(run_id)
        problem = _unwritable_store(self.uri)
        if problem:
            log.warning("MLflow store %s cannot be written (%s); tracking to MLflow is off for this run, metrics "
                        "continue in %s", self.uri, problem, self._local)
            return run_id
        # Fail fast against a dead server instead of MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        parent = params.get("tracking.parent_run_id")
        # the global batch of this (possibly resumed, re-batched) run: per-rank batch × accumulation × world size
        self._global_batch = (int(params.get("train.batch_size", 0)) * int(params.get("train.grad_accum", 1))
                              * int(tags.get("world_size") or 1))

        def _start() -> str:
            import mlflow  # optional extra: mlflow

            mlflow.set_tracking_uri(self.uri)
            client = mlflow.MlflowClient(self.uri)
            exp_id = _parent_experiment(client, parent) if parent else ensure_experiment(client, self.experiment,
                                                                                          self.uri)
            mlflow.set_experiment(experiment_id=exp_id)
            run_tags = {**tags, PARENT_TAG: parent} if parent else dict(tags)
            # a new run gets its tags (the parent among them) as it is created: a store busy with other writers
            # (sqlite under a Slurm array) can fail a later call, which must not leave a child without its parent
            for chatty in ("mlflow.system_metrics", "mlflow.store.db.utils"):  # four lines a run that say nothing
                logging.getLogger(chatty).setLevel(logging.WARNING)
            run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name, log_system_metrics=True,
                                   tags=None if run_id else run_tags)
            if run_id is None:
                mlflow.log_params({k: _param(v) for k, v in params.items()})
                mlflow.log_input(_dataset_input(params), context="training")
            mlflow.set_tags(run_tags)
            self._mlflow = mlflow
            return run.info.run_id

        self.run_id = self._guard("start run", _start) or run_id
        if self.run_id is not None:  # for whoever must close the run when this process cannot (a batch script)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text(self.run_dir / RUN_ID_FILE, f"{self.uri}\n{self.run_id}\n")
        return self.run_id

    def keep_records_to(self, step: int) -> None:
        """Before an attempt logs anything: ``metrics.jsonl`` drops what an earlier attempt logged after ``step``
        (the checkpoint this one continues from; 0 when it starts over), so no step is recorded twice, and a line
        torn by a crash mid-write is dropped with a warning instead of blocking the run."""
        if self.active and self._local.is_file():
            keep = [json.dumps(row) + "\n" for row in read_records(self._local) if row.get("step", 0) <= step]
            write_text(self._local, "".join(keep))

    def resumed(self, step: int) -> None:
        """A run continues from its checkpoint at ``step``: MLflow, which only appends, gets a ``resumed_from_step``
        metric at that step (readers of a metric's history keep the newest value per step)."""
        self.log_metrics({"resumed_from_step": float(step)}, step)

    def _end_abandoned(self, continued: str | None) -> None:
        """An earlier attempt in this run directory that died before its first checkpoint left its MLflow run
        RUNNING, and this attempt starts a new one: end the old one as FAILED (one try; never blocks the start)."""
        path = self.run_dir / RUN_ID_FILE
        if not path.is_file():
            return
        parts = path.read_text().split()
        if len(parts) < 2 or parts[1] == continued or parts[0] != self.uri or _unwritable_store(self.uri):
            return
        try:
            from mlflow import MlflowClient  # optional extra: mlflow

            client = MlflowClient(self.uri)
            if client.get_run(parts[1]).info.status == "RUNNING":
                client.set_terminated(parts[1], status="FAILED")
                log.info("ended MLflow run %s of an earlier attempt that stopped before its first checkpoint",
                         parts[1])
        except Exception as err:
            log.warning("could not end the earlier attempt's MLflow run %s (%s)", parts[1], str(err)[:200])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._local.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._mlflow is not None:
            values = {k: float(v) for k, v in metrics.items()}
            self._guard("log metrics", lambda: self._mlflow.log_metrics(values, step=step))

    def log_final(self, metrics: dict[str, float], step: int) -> None:
        """The final evaluation's extras that only ``final_metrics.json`` had (parameter count, training img/s), the
        step count and the images trained on, as ``final/*`` metrics, so ``sigmanens compare`` reads it all from
        MLflow."""
        extras = {f"final/{k}": v for k, v in metrics.items() if k in ("params", "train_img_per_s")}
        if self._global_batch:
            extras["final/train_images"] = float(step * self._global_batch)
        self.log_metrics({**extras, "final/steps": float(step)}, step)

    def log_artifact(self, path: Path) -> None:
        if self.active and self._mlflow is not None:
            self._guard("log artifact", lambda: self._mlflow.log_artifact(str(path)))

    def finish(self, status: str = "FINISHED") -> None:
        """``status``: FINISHED, FAILED or KILLED (preempted runs are left KILLED and resumed later)."""
        if self.active and self._mlflow is not None:
            self._guard("end run", lambda: self._mlflow.end_run(status=status))

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ParentRunNotFound:
            raise
        except Exception as err:
            log.warning("MLflow %s failed (%s: %s) at %s; tracking to MLflow is off for the rest of this run, "
                        "metrics continue in %s", what, type(err).__name__, str(err).splitlines()[0][:200],
                        self.uri, self._local)
            self._mlflow = None
            return None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file that an append may have been cut in: a line that is not a whole JSON object
    (a crash mid-write) is dropped with a warning naming the file and line."""
    rows = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict):
            log.warning("%s line %d is not a whole record (cut by a crash mid-write?): dropped", path, number)
            continue
        rows.append(row)
    return rows


def check_server(uri: str) -> None:
    """One :class:`~sigmanens_dist.errors.UnavailableError` line for an HTTP(S) tracking server that does not answer
    (refused, unknown host, timed out), asked once before a command that needs the store: MLflow's first call would
    fail with a traceback of its retry loop instead. Any HTTP answer, an error status too, is an answer; sqlite and
    file stores are not asked."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health",
                               timeout=float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "20"))).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError) as err:
        raise UnavailableError(f"the tracking server {uri} does not answer ({getattr(err, 'reason', err)}); start "
                               "it, or check the URI") from None


def _unwritable_store(uri: str) -> str | None:
    """Why a local store cannot take this run, found in microseconds (MLflow itself retries for minutes): a sqlite
    file or ``file:`` folder whose location cannot be written. A server is judged by its first answer instead."""
    if uri.startswith("sqlite:///"):
        target = Path(uri.removeprefix("sqlite:///"))
    elif uri.startswith("file:") or "://" not in uri:
        target = Path(uri.removeprefix("file://").removeprefix("file:"))
    else:
        return None
    folder = target.parent if uri.startswith("sqlite:") else target  # sqlite writes a journal beside the file
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("/"))
    for path in ([target] if target.exists() else []) + [existing]:
        if not os.access(path, os.W_OK):
            return f"{path} is not writable"
    return None


def _parent_experiment(client: Any, parent: str) -> str:
    """The parent's experiment: children live beside their parent whatever ``tracking.experiment`` says."""
    from mlflow.exceptions import MlflowException  # optional extra: mlflow

    try:
        return client.get_run(parent).info.experiment_id
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            raise ParentRunNotFound(f"tracking.parent_run_id={parent!r}: no such run in {client.tracking_uri}") from err
        raise


def _dataset_input(params: dict[str, Any]) -> Any:
    """The training data as an MLflow dataset: its name, where it is read from (the data root; generated data names
    its generator), and a digest of the settings that select it."""
    from mlflow.data.code_dataset_source import CodeDatasetSource  # optional extra: mlflow
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    data = {k.removeprefix("data."): v for k, v in params.items() if k.startswith("data.")}
    # the catalog imports pydantic, not at the top: predict imports this module (through the registry)
    from sigmanens_dist.catalog.datasets import DATASETS, resolve_root

    name, root = str(data.get("dataset", "unknown")), data.get("root")
    remote = isinstance(root, str) and "://" in root  # streamed shards: the URL (validation kept credentials out)
    if name in DATASETS and not remote:  # a dataset's default root (Fashion-MNIST's Debian folder) when none is set
        root = resolve_root(name, Path(root) if root else None)
    if root:
        with warnings.catch_warnings():  # "can be interpreted in multiple ways": every candidate is a local path
            warnings.simplefilter("ignore", UserWarning)
            source = resolve_dataset_source(root if remote else str(Path(root).resolve()))
    else:
        source = CodeDatasetSource(tags={"generator": f"sigmanens_dist.data ({name})"})
    selection = {k: data.get(k) for k in ("dataset", "format", "root", "img_size", "train_subset", "val_subset",
                                           "max_length", "tokenizer")}
    digest = hashlib.sha256(json.dumps(selection, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return MetaDataset(source=source, name=name, digest=digest)


def _param(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 500 else text[:497] + "..."


def set_status(run_dir: Path, status: str) -> str | None:
    """Mark a run directory's MLflow run ``status`` (FAILED, KILLED, FINISHED) from outside the trainer: a batch
    script that gives up after rank 0 was killed knows the outcome, the dead trainer could not report it. Returns the
    run id, or None when the run directory has no MLflow run."""
    path = Path(run_dir) / RUN_ID_FILE
    if not path.is_file():
        return None
    uri, run_id = path.read_text().split()[:2]
    from mlflow import MlflowClient  # optional extra: mlflow

    MlflowClient(uri).set_terminated(run_id, status=status)
    return run_id
