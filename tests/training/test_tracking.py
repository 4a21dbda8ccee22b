"""MLflow tracking against an embedded sqlite store and a real ``mlflow server`` on 127.0.0.1; a dead server must
not stop training."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SYNTHETIC, TINY_VIT, free_port, losses, run_train
from tests.helpers import mlflow_server as tracking_server

mlflow = pytest.importorskip("mlflow")

BASE = [*TINY_VIT, *SYNTHETIC, "train.batch_size=16", "optim.name=adamw", "optim.lr=0.002", "train.log_every_steps=2",
        "tracking.enabled=true", "tracking.experiment=tests"]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real tracking server, one worker, job execution off (what the README recommends for small machines)."""
    with tracking_server(tmp_path_factory.mktemp("mlflow_server") / "mlflow.db") as url:
        yield url


def _check_run(uri: str, run_dir: Path, steps: int) -> None:
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tests")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{run_dir.name}'")
    assert len(runs) == 1, "a resumed run must continue its MLflow run, not start another"
    run = runs[0]
    assert run.data.params["model.num_members"] == "4"
    assert run.data.params["reg.tau"] == "0.5"
    for tag in ("git_commit", "num_members", "tau", "strategy", "world_size", "slurm_job_id"):
        assert tag in run.data.tags, tag
    assert run.data.tags["num_members"] == "4" and run.data.tags["strategy"] == "ddp"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == sorted(losses(run_dir))
    assert max(m.step for m in history) == steps
    assert "val/nll" in run.data.metrics and "val/member0/acc" in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "reliability.png"} <= artifacts


@pytest.mark.slow
def test_sqlite_store_and_resume_continue_the_same_run(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = tmp_path / "sqlite_run"
    run_train(run, *BASE, f"tracking.uri={uri}", "train.max_steps=4", "checkpoint.every_steps=2")
    run_train(run, *BASE, f"tracking.uri={uri}", "train.max_steps=8", "checkpoint.every_steps=2",
              "checkpoint.resume=auto")
    _check_run(uri, run, 8)


@pytest.mark.slow
def test_real_tracking_server(tmp_path: Path, mlflow_server: str) -> None:
    run = tmp_path / "server_run"
    run_train(run, *BASE, f"tracking.uri={mlflow_server}", "train.max_steps=6")
    _check_run(mlflow_server, run, 6)


@pytest.mark.slow
def test_unreachable_server_does_not_stop_training(tmp_path: Path) -> None:
    run = tmp_path / "offline_run"
    dead = f"http://127.0.0.1:{free_port()}"
    proc = run_train(run, *BASE, f"tracking.uri={dead}", "train.max_steps=4")
    assert "tracking to MLflow is off for the rest of this run" in proc.stderr
    assert sorted(losses(run)) == [2, 4]
    assert (run / "final_metrics.json").is_file()


def test_child_run_joins_its_parent_with_the_dataset_as_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    from sigmanens_dist.training.tracking import ParentRunNotFound, Tracker, ensure_experiment

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # mlflow.set_tracking_uri exports it: undo that for later tests
    client = mlflow.MlflowClient(uri)
    exp_id = ensure_experiment(client, "study", uri)
    exp = client.get_experiment(exp_id)
    assert exp.artifact_location == (tmp_path / "mlartifacts").as_uri()
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    parent = client.create_run(exp_id).info.run_id
    params = {"tracking.parent_run_id": parent, "data.dataset": "synthetic", "data.root": None, "seed": 0}
    # Started in another process with another experiment name, the child still lands beside its parent.
    tracker = Tracker(tmp_path / "child", enabled=True, active=True, uri=uri, experiment="elsewhere")
    run_id = tracker.start("child", None, params, {"num_members": "4"})
    tracker.finish()
    run = client.get_run(run_id)
    assert run.info.experiment_id == exp_id and run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.params["seed"] == "0" and run.data.tags["num_members"] == "4"
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["synthetic"]
    assert client.get_experiment_by_name("elsewhere") is None
    orphan = Tracker(tmp_path / "orphan", enabled=True, active=True, uri=uri, experiment="study")
    with pytest.raises(ParentRunNotFound, match=r"tracking\.parent_run_id='0123456789abcdef0123456789abcdef'"):
        orphan.start("orphan", None, {**params, "tracking.parent_run_id": "0123456789abcdef0123456789abcdef"}, {})


def test_a_batch_script_can_mark_a_dead_trainers_run_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer killed before it could report leaves its run RUNNING; slurm/common.sh marks it FAILED on giving up
    with ``python -m sigmanens_dist.cli.tracking set-status RUN_DIR FAILED``."""

    from sigmanens_dist.training.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run_id = Tracker(tmp_path / "run", enabled=True, active=True, uri=uri, experiment="x").start("run", None, {}, {})
    client = mlflow.MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"  # the process "died" here
    proc = subprocess.run([sys.executable, "-m", "sigmanens_dist.cli.tracking", "set-status",
                           str(tmp_path / "run"), "FAILED"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert client.get_run(run_id).info.status == "FAILED"
    empty = subprocess.run([sys.executable, "-m", "sigmanens_dist.cli.tracking", "set-status", str(tmp_path),
                            "FAILED"], capture_output=True, text=True, check=False)
    assert empty.returncode == 0 and "no MLflow run recorded" in empty.stdout
