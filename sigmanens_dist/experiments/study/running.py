"""Running a study's children: which are finished (in MLflow or on disk), the trainer command of each, one child
(a Slurm array element) or all of them in turn, resuming interrupted ones."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from sigmanens_dist.experiments.study.bookkeeping import _finish_parent, ensure_parent
from sigmanens_dist.experiments.study.definition import ChildSpec, StudyDefinition, read_definition
from sigmanens_dist.experiments.study.grid import CHILD_TAG, STUDY_TAG, StudyError
from sigmanens_dist.progress import shell_command
from sigmanens_dist.training.preemption import EXIT_PREEMPTED, MARKER
from sigmanens_dist.training.tracking import PARENT_TAG

log = logging.getLogger("sigmanens.study")

__all__ = ["child_state", "run_one", "run_study", "trainer_args"]

def child_state(definition: StudyDefinition, child: ChildSpec, finished_in_mlflow: set[str]) -> str:
    """``finished`` (skip), ``resume`` (it has checkpoints) or ``start``."""
    run_dir = Path(definition.out) / child.name
    if (run_dir / "final_metrics.json").is_file() or child.name in finished_in_mlflow:
        return "finished"
    if any((run_dir / "checkpoints").glob("step_*.pt")):
        return "resume"
    return "start"


def _finished_in_mlflow(definition: StudyDefinition) -> set[str]:
    """Children whose MLflow run is FINISHED (a child trained on another node leaves no final_metrics.json here)."""
    run_id, uri = definition.tracking.parent_run_id, definition.tracking.uri
    if run_id is None:
        return set()
    try:
        from mlflow import MlflowClient  # optional extra: mlflow

        client = MlflowClient(uri)
        exp_id = client.get_run(run_id).info.experiment_id
        runs = client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and "
                                                          "attributes.status = 'FINISHED'", max_results=50000)
        return {r.info.run_name for r in runs}
    except Exception as err:
        log.warning("cannot read finished children from %s (%s); relying on final_metrics.json", uri, err)
        return set()


def trainer_args(definition: StudyDefinition, child: ChildSpec, def_path: Path) -> list[str]:
    """The trainer's arguments for ``child`` (after ``-m sigmanens_dist.train``): what any launcher runs."""
    config = ["--config", str(def_path.parent / definition.base_config)] if definition.base_config else []
    parent = definition.tracking.parent_run_id
    return [*config, *definition.overrides, *child.overrides,
            *([f"tracking.parent_run_id={parent}"] if parent else []), "checkpoint.resume=auto"]


def _command(definition: StudyDefinition, child: ChildSpec, def_path: Path) -> list[str]:
    nproc = definition.nproc
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
                if nproc > 1 else [sys.executable, "-m"])
    return [*launcher, "sigmanens_dist.train", *trainer_args(definition, child, def_path)]


def run_one(def_path: Path, index: int, *, print_args: bool = False) -> int:
    """Run child ``index`` of the study (skip it if finished, resume it if interrupted); the trainer's exit status.
    With ``print_args`` only print the trainer's arguments, one per line, for a launcher of one's own (a multi-node
    Slurm element: slurm/m_scaling.sh)."""
    definition = read_definition(def_path)
    children = definition.children
    if not 0 <= index < len(children):
        raise StudyError(f"--index {index}: the study has children 0..{len(children) - 1}")
    if print_args:
        print("\n".join(trainer_args(definition, children[index], def_path)))
        return 0
    return _run_child(definition, children[index], def_path, _finished_in_mlflow(definition))


def _run_child(definition: StudyDefinition, child: ChildSpec, def_path: Path, finished: set[str]) -> int:
    state = child_state(definition, child, finished)
    total = len(definition.children)
    if state == "finished":
        print(f"[{child.index + 1}/{total}] {child.name}: finished, skipped", flush=True)
        return 0
    cmd = _command(definition, child, def_path)
    print(f"[{child.index + 1}/{total}] {child.name}: {'resuming' if state == 'resume' else 'starting'}\n"
          + shell_command(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        """A preemption signal sent to this process (not only to the child) must reach the trainer, and must not
        kill this process before the trainer has checkpointed. torchrun passes SIGTERM on to its workers."""
        received.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM if definition.nproc > 1 else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _tag_child(definition, child)
    # torchrun rewrites a worker's exit status; the trainer's marker says "checkpointed after a signal"
    if received or (Path(definition.out) / child.name / MARKER).is_file():
        return EXIT_PREEMPTED
    return status


def _tag_child(definition: StudyDefinition, child: ChildSpec) -> None:
    """Name the grid point in the child's MLflow tags (nominal λ included, whatever the λ(M) policy made of it)."""
    run_id, uri = definition.tracking.parent_run_id, definition.tracking.uri
    if run_id is None:
        return
    try:
        from mlflow import MlflowClient  # optional extra: mlflow

        client = MlflowClient(uri)
        exp_id = client.get_run(run_id).info.experiment_id
        runs = client.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}' and "
                                                          f"attributes.run_name = '{child.name}'")
        point = child.point
        tags = {STUDY_TAG: definition.name, CHILD_TAG: str(child.index), "sigmanens.method": point["method"],
                "sigmanens.lambda_policy": definition.lambda_policy,
                **{f"sigmanens.grid.{k}": str(v) for k, v in point.items() if v is not None and k != "method"}}
        for run in runs:
            for key, value in tags.items():
                client.set_tag(run.info.run_id, key, value)
    except Exception as err:  # the tags are a convenience: compare reads the same values from the params
        log.warning("could not tag %s's MLflow run (%s)", child.name, err)


def run_study(definition: StudyDefinition, def_path: Path) -> int:
    """Every child in order. A preempted child stops the study (exit 75, to requeue); a failed one is reported and
    the others still run; exit 1 if any failed."""
    ensure_parent(definition, def_path)
    finished = _finished_in_mlflow(definition)
    failed = []
    for child in definition.children:
        status = _run_child(definition, child, def_path, finished)
        if status == EXIT_PREEMPTED:
            _finish_parent(definition, "KILLED")
            print(f"{child.name} was preempted; run the same command again to continue the study", flush=True)
            return EXIT_PREEMPTED
        if status != 0:
            failed.append(f"{child.name} (exit {status})")
    _finish_parent(definition, "FAILED" if failed else "FINISHED")
    if failed:
        print("failed children: " + ", ".join(failed), file=sys.stderr)
        return 1
    tracking = definition.tracking
    print(f"study {definition.name}: all {len(definition.children)} children finished"
          + ("; compare them with\n" + shell_command(["sigmanens", "compare", "--parent", tracking.parent_run_id,
                                                      "--uri", tracking.uri], prompt="  ")
             if tracking.parent_run_id else ""))
    return 0
