"""slurm/*.sh end to end on a real two-node Slurm cluster (launch/slurm_local.sh): preemption → checkpoint → requeue →
exact resume, a user's scancel, bounded retries of a crashing job. CPU and gloo; the scripts run unchanged, only their
GPU and CPU directives are overridden at submission. The test cluster uses proctrack/pgid."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from sigmanens_dist.data import FASHION_MNIST_ROOT
from sigmanens_dist.training.tracking import read_records
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, Nginx, env, losses, torchrun
from tests.slurm_cluster import FINAL_STATES, SlurmCluster, bring_up, can_run

pytestmark = [pytest.mark.slow, pytest.mark.skipif(can_run() is not None, reason=str(can_run()))]

STEPS = 48
# A tiny ViT on generated data, on CPU; checkpoints every 2 steps so a signal lands between checkpoints mid-run.
OVERRIDES = [*TINY_VIT, *SYNTHETIC, "data.format=raw", "data.val_split=0.1", f"train.max_steps={STEPS}",
             "train.batch_size=16", "train.log_every_steps=1", "checkpoint.every_steps=2", "train.amp=none",
             "strategy.backend=gloo", "train.ema_decay=null", "train.mixup_alpha=0", "train.cutmix_alpha=0",
             "train.randaugment=null", "train.label_smoothing=0", "schedule.warmup_steps=2"]
NO_GPUS = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]  # the test nodes have no GPUs and few CPUs
# The same tiny job over webdataset shards of Fashion-MNIST (the conversion of `served`), for a few steps: 5 a training
# epoch (8 shards of 20 images, 4 a rank, batches of 16), so the run crosses an epoch boundary.
STREAM_STEPS = 8
STREAM = [*TINY_VIT, "data.dataset=fashion_mnist", "data.format=webdataset", "data.img_size=16", "data.num_workers=0",
          "data.val_split=40", f"train.max_steps={STREAM_STEPS}",
          *[o for o in OVERRIDES if not o.startswith(("model.", "data.", "train.max_steps="))]]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from bring_up(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="module", autouse=True)
def crashing_job(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """Submitted before the first test so that its attempts overlap the others: a model that rejects the data's image
    size fails at its first forward pass (after set-up, not at config time), with one retry allowed."""
    tmp = tmp_path_factory.mktemp("crash")
    job = slurm.sbatch(tmp, *NO_GPUS, str(REPO / "slurm/cifar100_wrn.sh"), *OVERRIDES, "model.kwargs.img_size=32",
                       env=slurm.env(SIGMANENS_RUNS_ROOT=str(tmp / "runs"), SIGMANENS_MAX_RETRIES="1"))
    return job, tmp


@pytest.fixture(scope="module", autouse=True)
def m_scaling_array(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, int, Path]:
    """slurm/m_scaling.sh over M = 1, 2, 4 (array elements 0-2) and its comparison job, submitted early so that they
    overlap the other tests."""
    tmp = tmp_path_factory.mktemp("m_scaling")
    # Submit mode (bash, not sbatch): the study definition and parent run once, then the array and the comparison.
    # --nice and --comment stand for a cluster's required accounting options: they must reach the comparison job too
    proc = subprocess.run(["bash", str(REPO / "slurm/m_scaling.sh"), *NO_GPUS, "--nice=5", "--comment=sigmanens-test",
                           "--", *OVERRIDES, "train.max_steps=6",
                           "model.kwargs.depth=1"], cwd=tmp, capture_output=True, text=True, timeout=300, check=False,
                          env=slurm.env(SIGMANENS_RUNS_ROOT=str(tmp / "runs"), SIGMANENS_MEMBERS="1 2 4",
                                        SIGMANENS_ARRAY_LIMIT="2"))
    assert proc.returncode == 0, proc.stderr
    compare = re.search(r"comparison job (\d+) \(afterany\)", proc.stderr)
    assert compare is not None, proc.stderr
    return int(proc.stdout.strip()), int(compare.group(1)), tmp


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Nginx]]:
    """Fashion-MNIST's first 200 + 50 images converted to webdataset shards (``sigmanens data convert``: 160 for
    training in 8 shards, 40 validation, 50 test) in ``<served>/fmnist``, and Debian's nginx serving ``<served>`` on
    127.0.0.1."""
    from sigmanens_dist.cli import main

    if not FASHION_MNIST_ROOT.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")
    root = tmp_path_factory.mktemp("served")
    assert main(["data", "convert", "--dataset", "fashion_mnist", "--format", "webdataset", "--out",
                 str(root / "fmnist"), "--max-count", "20", "--train-subset", "200", "--test-subset", "50",
                 "--val-split", "40"]) == 0
    server = Nginx(root, tmp_path_factory.mktemp("nginx"))
    server.start()
    yield root / "fmnist", server
    server.stop()


def _wait_for(done: Callable[[], bool], job: int, cluster: SlurmCluster, timeout: float = 300) -> None:
    """Poll ``done`` (fast: the signal must land mid-run) while the job is alive."""
    deadline = time.time() + timeout
    while not done():
        state = cluster.job(job)["JobState"]  # COMPLETING and PENDING come between attempts of a requeued job
        assert state not in FINAL_STATES, f"job {job} ended ({state}) too early"
        assert time.time() < deadline, f"nothing happened within {timeout} s"
        time.sleep(0.05)


def _attempts(run_dir: Path) -> list[list[str]]:
    """``slurm_attempts.log``: restart count, job id, start step, end step, outcome — its complete lines only: the
    batch script's ``echo >>`` creates the file before it writes the line, and a poll can land in between."""
    log = run_dir / "slurm_attempts.log"
    text = log.read_text() if log.exists() else ""
    return [line.split() for line in text[: text.rfind("\n") + 1].splitlines()]


def _mlflow_runs(runs_root: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{runs_root / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [(r, client) for r in client.search_runs(experiments)]


def test_a_second_cluster_on_taken_ports_is_refused_before_starting(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Two local clusters on one machine (two research drivers) need their own ports: ``up`` on a port this session's
    cluster holds says which port and how to pick others, and starts no daemon (not even munged)."""
    port = re.search(r"^SlurmctldPort=(\d+)$", slurm.conf.read_text(), re.M)
    assert port is not None
    state = tmp_path / "second"
    out = subprocess.run(["bash", str(REPO / "launch/slurm_local.sh"), "up", str(state)], capture_output=True,
                         text=True, timeout=120, check=False, env={**slurm.env(), "SLURM_LOCAL_PORT": port[1]})
    assert out.returncode == 1
    assert f"port {port[1]} on 127.0.0.1 is taken" in out.stderr and "SLURM_LOCAL_PORT=N" in out.stderr
    assert not list(state.glob("run/*.pid")) and str(state) not in subprocess.run(
        ["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout


def test_user_scancel_is_not_requeued(slurm: SlurmCluster, tmp_path: Path) -> None:
    """scancel (SIGTERM to the batch shell and the steps): the trainer checkpoints, the MLflow run is KILLED, and the
    script does not requeue. Uses the one-node script."""
    runs = tmp_path / "runs"
    job = slurm.sbatch(tmp_path, *NO_GPUS, str(REPO / "slurm/cifar100_wrn.sh"), *OVERRIDES,
                       env=slurm.env(SIGMANENS_RUNS_ROOT=str(runs)))
    run = runs / f"cifar100_wrn-{job}"
    _wait_for(lambda: (run / "checkpoints" / "step_00000004.pt").exists(), job, slurm)
    slurm.run("scancel", str(job))
    deadline = time.time() + 120
    while not _attempts(run):  # the batch script's decision, after srun returned
        assert time.time() < deadline, "the batch script never recorded the attempt"
        time.sleep(0.5)
    info = slurm.wait_done(job, timeout=120)
    log = (tmp_path / f"slurm-sigmanens-cifar100-wrn-{job}.out").read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log[-4000:]
    assert [a[4] for a in _attempts(run)] == ["preempted"]
    assert json.loads((run / "preempted.json").read_text())["signal"] == "SIGTERM"
    assert "not requeueing" in log
    [(mlrun, _)] = _mlflow_runs(runs)
    assert mlrun.info.status == "KILLED"


def test_preempted_twice_requeues_and_resumes_exactly(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Two torchrun agents (n1, n2) train together; the time-limit warning through the batch shell (what
    --signal=B:USR1 does) and then through the steps (--signal=USR1 without B:, or cgroup clusters) each give a
    checkpoint and a requeue; the run ends with the losses of an uninterrupted run and one MLflow run."""
    runs = tmp_path / "runs"
    config = "configs/imagenet_vit.yaml"
    # The uninterrupted reference, alongside: same recipe, same world size, plain torchrun.
    with (tmp_path / "straight.log").open("w") as log:
        straight = subprocess.Popen([*torchrun(2), "-m", "sigmanens_dist.train", "--config", config,
                                     f"run_dir={tmp_path / 'straight'}", "tracking.enabled=false", *OVERRIDES],
                                    cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
    job_env = slurm.env(SIGMANENS_RUNS_ROOT=str(runs))
    job = slurm.sbatch(tmp_path, "--nodes=2", *NO_GPUS, str(REPO / "slurm/imagenet_vit.sh"), *OVERRIDES, env=job_env)
    run = runs / f"imagenet_vit-{job}"
    out = tmp_path / f"slurm-sigmanens-imagenet-vit-{job}.out"

    _wait_for(lambda: (run / "checkpoints" / "step_00000004.pt").exists(), job, slurm)
    slurm.run("scancel", "--batch", "--signal=USR1", str(job))
    _wait_for(lambda: len(_attempts(run)) > 0, job, slurm)  # attempt 1 answered; the requeue follows
    again = (int(_attempts(run)[0][3]) // 2 + 3) * 2  # a checkpoint the resumed attempt writes a few steps later
    _wait_for(lambda: (run / "checkpoints" / f"step_{again:08d}.pt").exists(), job, slurm)
    slurm.run("scancel", "--signal=USR1", str(job))
    info = slurm.wait_done(job, timeout=400)
    log = out.read_text()

    assert info["JobState"] == "COMPLETED", log[-4000:]
    assert info["Restarts"] == "2", log[-4000:]
    assert info["NodeList"] == "n[1-2]"
    assert straight.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    attempts = _attempts(run)
    assert [a[4] for a in attempts] == ["preempted", "preempted", "finished"], attempts
    markers = [json.loads(line.split("after a signal: ")[1]) for line in log.splitlines() if "after a signal: " in line]
    assert [(m["step"], m["signal"]) for m in markers] == [(int(a[3]), "SIGUSR1") for a in attempts[:2]], log[-4000:]
    # Each attempt resumed exactly where the previous one checkpointed, and the preemptions came mid-run.
    assert attempts[1][2] == attempts[0][3] and attempts[2][2] == attempts[1][3], attempts
    assert 0 < int(attempts[0][3]) < int(attempts[1][3]) < STEPS, attempts
    assert not (run / "preempted.json").exists(), "the resumed trainer must clear the old marker"
    assert losses(run) == losses(tmp_path / "straight")
    assert sorted(losses(run)) == list(range(1, STEPS + 1))

    [(mlrun, client)] = _mlflow_runs(runs)
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.tags["world_size"] == "2"
    steps = [m.step for m in client.get_metric_history(mlrun.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(1, STEPS + 1)), "one MLflow run with every step exactly once"


PREEMPT_TRIALS = int(os.environ.get("SIGMANENS_PREEMPT_TRIALS", "3"))  # 20 once by hand (docs/training.md)


def _step_running(cluster: SlurmCluster, job: int) -> bool:
    return bool(cluster.run("squeue", "--steps", "--noheader", "--jobs", str(job)).strip())


def test_preempted_at_random_moments_always_requeues(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The time-limit warning at a random moment of each attempt, start-up included: to the batch shell
    (--signal=B:USR1: during validation, srun's and torchrun's start, imports, set-up or training) and to the job's
    steps once they exist (--signal=USR1). Every attempt ends preempted and is requeued, never counted as a failure
    (SIGMANENS_MAX_RETRIES=0 would end the job), and the run finishes with every step exactly once."""
    runs, steps = tmp_path / "runs", 200 * PREEMPT_TRIALS + 400  # every signal lands before the last step
    job = slurm.sbatch(tmp_path, *NO_GPUS, str(REPO / "slurm/cifar100_wrn.sh"), *OVERRIDES,
                       f"train.max_steps={steps}", env=slurm.env(SIGMANENS_RUNS_ROOT=str(runs),
                                                                 SIGMANENS_MAX_RETRIES="0"))
    run, rng, sent = runs / f"cifar100_wrn-{job}", random.Random(job), []
    for trial in range(PREEMPT_TRIALS):
        _wait_for(lambda t=trial: slurm.job(job)["JobState"] == "RUNNING" and slurm.job(job)["Restarts"] == str(t),
                  job, slurm)
        to_batch = trial % 2 == 0
        if not to_batch:
            _wait_for(lambda: _step_running(slurm, job), job, slurm)
        sent.append(("batch" if to_batch else "steps", round(rng.uniform(0.0, 20.0 if to_batch else 15.0), 2)))
        time.sleep(sent[-1][1])
        slurm.run("scancel", *(["--batch"] if to_batch else []), "--signal=USR1", str(job))
        _wait_for(lambda t=trial: slurm.job(job)["Restarts"] == str(t + 1), job, slurm)
    info = slurm.wait_done(job, timeout=600)
    log = (tmp_path / f"slurm-sigmanens-cifar100-wrn-{job}.out").read_text()
    outcomes = [a[4] for a in _attempts(run)]
    assert info["JobState"] == "COMPLETED", (sent, outcomes, log[-4000:])
    assert outcomes[-1] == "finished" and len(outcomes) == PREEMPT_TRIALS + 1, (sent, outcomes, log[-4000:])
    assert set(outcomes[:-1]) <= {"preempted", "signalled-before-start"}, (sent, outcomes, log[-4000:])
    logged = [row["step"] for row in read_records(run / "metrics.jsonl") if "train/loss" in row]
    assert logged == list(range(1, steps + 1)), (sent, logged)


def test_crashing_job_is_retried_a_bounded_number_of_times(slurm: SlurmCluster, crashing_job: tuple[int, Path]
                                                           ) -> None:
    """SIGMANENS_MAX_RETRIES=1: one requeue after the crash, then the job fails; every MLflow run it started FAILED."""
    job, tmp = crashing_job
    info = slurm.wait_done(job, timeout=400)
    log = (tmp / f"slurm-sigmanens-cifar100-wrn-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1", log[-4000:]
    assert [a[4] for a in _attempts(tmp / "runs" / f"cifar100_wrn-{job}")] == ["failed", "failed", "gave-up"]
    assert "AssertionError" in log and "giving up" in log
    mlruns = _mlflow_runs(tmp / "runs")
    assert len(mlruns) == 2 and {r.info.status for r, _ in mlruns} == {"FAILED"}


def test_a_config_mistake_fails_once_without_requeue(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Run with bash, a batch script validates first and queues nothing; submitted with sbatch directly, the job
    validates before srun and fails once (exit 2, one message, no requeue, no traceback)."""
    runs = tmp_path / "runs"
    job_env = slurm.env(SIGMANENS_RUNS_ROOT=str(runs))
    script = str(REPO / "slurm/cifar100_wrn.sh")
    proc = subprocess.run(["bash", script, *NO_GPUS, "--", *OVERRIDES, "model.bogus_key=1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False, env=job_env)
    assert proc.returncode == 2, proc.stderr
    assert "  - model.bogus_key: unknown key (got 1)" in proc.stderr and not proc.stdout.strip()
    job = slurm.sbatch(tmp_path, *NO_GPUS, str(REPO / "slurm/cifar100_wrn.sh"), *OVERRIDES, "model.bogus_key=1",
                       env=job_env)
    info = slurm.wait_done(job, timeout=300)
    log = (tmp_path / f"slurm-sigmanens-cifar100-wrn-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0" and info["ExitCode"] == "2:0", log[-3000:]
    assert [a[4] for a in _attempts(runs / f"cifar100_wrn-{job}")] == ["usage-error"]
    assert "model.bogus_key: unknown key (got 1)" in log and "not requeueing" in log and "Traceback" not in log
    # The same through bash submit mode with a valid config: the job id is printed and the job is queued.
    proc = subprocess.run(["bash", str(REPO / "slurm/cifar100_wrn.sh"), *NO_GPUS, "--", *OVERRIDES,
                           "train.max_steps=2"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False, env=job_env)
    assert proc.returncode == 0, proc.stderr
    info = slurm.wait_done(int(proc.stdout.strip().split(";")[0]), timeout=300)
    assert info["JobState"] == "COMPLETED", info


def test_m_scaling_study_trains_each_m_and_compares(slurm: SlurmCluster,
                                                    m_scaling_array: tuple[int, int, Path]) -> None:
    """Element i trains the i-th child of the study (M = 1, 2, 4) into its folder and MLflow run, nested under the
    study's parent run; the comparison job runs after the array and writes the table and plots."""
    job, compare_job, tmp = m_scaling_array
    study = tmp / "runs" / "m_scaling"
    children = [c["name"] for c in yaml.safe_load((study / "study.yaml").read_text())["children"]]
    assert [n.split("-")[1] for n in children] == ["M1", "M2", "M4"]
    for task, name in enumerate(children):
        info = slurm.wait_done(f"{job}_{task}", timeout=400)
        assert info.get("ArrayTaskThrottle") == "2", info  # SIGMANENS_ARRAY_LIMIT
        log = (tmp / f"slurm-sigmanens-m-scaling-{job}_{task}.out").read_text()
        assert info["JobState"] == "COMPLETED", log[-4000:]
        assert log.count("MLflow writes to a sqlite file") == 1, log[-3000:]  # once, though the URI is given twice
        assert (study / name / "final_metrics.json").exists()
    by_name = {r.info.run_name: r for r, _ in _mlflow_runs(tmp / "runs")}
    parent = by_name.pop("m_scaling")
    assert sorted(by_name) == sorted(children)
    assert {r.data.tags["mlflow.parentRunId"] for r in by_name.values()} == {parent.info.run_id}
    assert {r.info.status for r in by_name.values()} == {"FINISHED"}
    info = slurm.wait_done(compare_job, timeout=300)
    assert info["JobState"] == "COMPLETED", next(study.glob("slurm-compare-*.out")).read_text()[-4000:]
    assert info["Nice"] == "5" and info["Comment"] == "sigmanens-test", info  # the user's sbatch options
    table = (study / "compare" / "table.md").read_text()
    assert all(f"| sigma | {m} |" in table for m in (1, 2, 4)), table
    assert (study / "compare" / "metric_vs_members.png").stat().st_size > 10_000


def test_two_nodes_stream_shards_from_http_as_from_local_disk(slurm: SlurmCluster, served: tuple[Path, Nginx],
                                                              tmp_path: Path) -> None:
    """slurm/imagenet_vit.sh on n1 and n2 with ``data.root=http://…`` (nginx on 127.0.0.1): the job trains to its last
    step with the losses of plain torchrun over the local copy of the same shards; between them the two ranks request
    every training shard from the server; rank 0 logs the ``remote data:`` throughput line, and MLflow records the
    URL as the dataset's source. ``sigmanens eval --checkpoint RUN`` then scores the test split streamed from the same
    URL, with the metrics of the local copy."""
    shards, server = served
    url, runs = f"{server}/{shards.name}", tmp_path / "runs"
    with (tmp_path / "local.log").open("w") as log:  # the reference over local disk, alongside
        local = subprocess.Popen([*torchrun(2), "-m", "sigmanens_dist.train", "--config", "configs/imagenet_vit.yaml",
                                  f"run_dir={tmp_path / 'local'}", "tracking.enabled=false", *STREAM,
                                  f"data.root={shards}"], cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT)
    job = slurm.sbatch(tmp_path, "--nodes=2", *NO_GPUS, str(REPO / "slurm/imagenet_vit.sh"), *STREAM,
                       f"data.root={url}", env=slurm.env(SIGMANENS_RUNS_ROOT=str(runs)))
    run = runs / f"imagenet_vit-{job}"
    info = slurm.wait_done(job, timeout=400)
    log = (tmp_path / f"slurm-sigmanens-imagenet-vit-{job}.out").read_text()

    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-4000:]
    assert info["NodeList"] == "n[1-2]"
    assert [a[4] for a in _attempts(run)] == ["finished"]
    assert local.wait(timeout=300) == 0, (tmp_path / "local.log").read_text()[-3000:]
    assert losses(run) == losses(tmp_path / "local")
    assert sorted(losses(run)) == list(range(1, STREAM_STEPS + 1))
    requested = {line.split()[6] for line in server.access_log.read_text().splitlines() if ".tar HTTP/" in line}
    train_shards = {f"/{shards.name}/train/{p.name}" for p in (shards / "train").glob("*.tar")}
    assert len(train_shards) == 8 and train_shards <= requested, sorted(requested)
    throughput = [line for line in log.splitlines() if " INFO remote data: " in line and " MB/s " in line]
    assert len(throughput) == STREAM_STEPS, log[-4000:]  # after each log line (every step), from rank 0 only

    [(mlrun, _)] = _mlflow_runs(runs)
    assert mlrun.info.status == "FINISHED" and mlrun.data.tags["world_size"] == "2"
    assert json.loads(mlrun.inputs.dataset_inputs[0].dataset.source) == {"url": url}  # MLflow's HTTP dataset source

    # `sigmanens eval` of the run reads its saved http:// root: the test split streams from nginx and scores as the
    # local copy does.
    from sigmanens_dist.cli import main

    def served_test_shards() -> list[str]:
        return sorted(line.split()[6] for line in server.access_log.read_text().splitlines()
                      if f" /{shards.name}/test/" in line and ".tar HTTP/" in line)

    assert served_test_shards() == []  # training read train and val only
    for name, data in (("http", []), ("local", ["--data", f"root={shards}"])):
        assert main(["eval", "--checkpoint", str(run), "--no-mlflow", "--no-sub-ensembles", "--out",
                     str(tmp_path / f"eval_{name}"), *data]) == 0
    assert served_test_shards() == sorted(f"/{shards.name}/test/{p.name}" for p in (shards / "test").glob("*.tar"))
    http, local_eval = (json.loads((tmp_path / f"eval_{n}" / "eval.json").read_text()) for n in ("http", "local"))
    assert http["split"] == "test" and http["weights"]["raw"]["metrics"]["num_samples"] == 50
    assert http["weights"]["raw"]["metrics"] == local_eval["weights"]["raw"]["metrics"]
