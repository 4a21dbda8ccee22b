"""Experiment tracking: MLflow on rank 0, plus a local ``metrics.jsonl`` that is always written.

A tracking server that is down must never kill a week-long run: every MLflow call is guarded; the first failure is
reported once, MLflow is switched off for the rest of the run, and metrics keep going to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Tracker", "default_tracking_uri"]

log = logging.getLogger(__name__)


def default_tracking_uri(run_dir: Path, uri: str | None) -> str:
    """Config value, else ``$MLFLOW_TRACKING_URI``, else a sqlite store beside the run directories."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(Path(run_dir).resolve().parent / 'mlflow.db').as_posix()}"


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

    def start(self, run_name: str, run_id: str | None, params: dict[str, Any], tags: dict[str, str]) -> str | None:
        """Start (or, given the id saved in a checkpoint, continue) the MLflow run; returns its id."""
        if not self.active or self.uri is None:
            return run_id
        # Fail fast against a dead server instead of MLflow's default minutes of retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

        def _start() -> str:
            import mlflow

            mlflow.set_tracking_uri(self.uri)
            mlflow.set_experiment(self.experiment)
            run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name, log_system_metrics=True)
            if run_id is None:
                mlflow.log_params({k: _param(v) for k, v in params.items()})
            mlflow.set_tags(tags)
            self._mlflow = mlflow
            return run.info.run_id

        self.run_id = self._guard("start run", _start) or run_id
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._local.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._mlflow is not None:
            values = {k: float(v) for k, v in metrics.items()}
            self._guard("log metrics", lambda: self._mlflow.log_metrics(values, step=step))

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
        except Exception as err:
            log.warning("MLflow %s failed (%s: %s) at %s; tracking to MLflow is off for the rest of this run, "
                        "metrics continue in %s", what, type(err).__name__, str(err).splitlines()[0][:200],
                        self.uri, self._local)
            self._mlflow = None
            return None


def _param(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 500 else text[:497] + "..."
