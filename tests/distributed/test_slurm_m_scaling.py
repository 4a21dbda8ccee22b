"""slurm/m_scaling.sh without a cluster: `sbatch`, `srun` and `scontrol` are stubs that record their arguments, so
both of the script's modes run for real (the study definition, `study run-one --print-args`, the trainer's config
check) down to the torchrun command an array element would start. The whole path on a real cluster is
tests/distributed/test_slurm.py (slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env

STUBS = {
    "sbatch": 'printf "%s\\n" "$@" > "$STUB_LOG/sbatch.args"; echo 101',
    "srun": 'printf "%s\\n" "$@" > "$STUB_LOG/srun.args"',
    "scontrol": 'case "$2" in hostnames) echo node0 ;; node) echo "NodeName=node0 NodeAddr=127.0.0.1" ;; esac',
}


def _script(tmp: Path, extra_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    run_env = {**env(), "PATH": f"{bin_dir}:{env()['PATH']}", "STUB_LOG": str(tmp), "SIGMANENS_PYTHON": sys.executable,
               "SIGMANENS_STUDY_DIR": str(tmp / "ms"), "SIGMANENS_RUNS_ROOT": str(tmp / "runs"), **extra_env}
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        run_env.setdefault(key, "")  # an outer Slurm job must not switch the script to its array-element mode
    return subprocess.run(["bash", str(REPO / "slurm/m_scaling.sh"), *args], cwd=tmp, env=run_env, text=True,
                          capture_output=True, timeout=300, check=False)


def test_max_backbone_batch_reaches_the_trainer_of_every_array_element(tmp_path: Path) -> None:
    """SIGMANENS_MAX_BACKBONE_BATCH=16 with 8 images per member: M = 1 (8 images) trains unsplit, M = 4 (32) as
    batches of 4 with 2 accumulation steps, and that is what its array element passes to the trainer."""
    overrides = [*TINY_VIT, *SYNTHETIC, "train.batch_size=8", "train.max_steps=2", "tracking.enabled=false"]
    split = {"SIGMANENS_MAX_BACKBONE_BATCH": "16", "SIGMANENS_MEMBERS": "1 4"}
    proc = _script(tmp_path, split, "--time=5", "--", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sbatch = (tmp_path / "sbatch.args").read_text().splitlines()
    definition = tmp_path / "ms" / "study.yaml"
    assert "--array=0-1" in sbatch and f"--export=ALL,SIGMANENS_DEFINITION={definition}" in sbatch, sbatch
    children = yaml.safe_load(definition.read_text())["children"]
    assert [c["point"]["members"] for c in children] == [1, 4]
    assert not any(o.startswith(("train.batch_size=", "train.grad_accum=")) for o in children[0]["overrides"])

    element = {**split, "SLURM_JOB_ID": "102", "SLURM_ARRAY_JOB_ID": "101", "SLURM_ARRAY_TASK_ID": "1",
               "SLURM_JOB_NODELIST": "node0", "SIGMANENS_DEFINITION": str(definition)}
    proc = _script(tmp_path, element)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    srun = (tmp_path / "srun.args").read_text().splitlines()
    trainer = srun[srun.index("sigmanens_dist.train"):]
    assert "model.num_members=4" in trainer and f"run_dir={tmp_path / 'ms' / children[1]['name']}" in trainer
    # the last value of a key wins in the trainer: the study's split, after the user's train.batch_size=8
    assert [o for o in trainer if o.startswith("train.batch_size=")][-1] == "train.batch_size=4", trainer
    assert [o for o in trainer if o.startswith("train.grad_accum=")][-1] == "train.grad_accum=2", trainer


def test_a_bad_max_backbone_batch_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    proc = _script(tmp_path, {"SIGMANENS_MAX_BACKBONE_BATCH": "0"}, "--", "train.max_steps=2")
    assert proc.returncode == 2
    assert "SIGMANENS_MAX_BACKBONE_BATCH=0: give a whole number ≥ 1" in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ms").exists()
    assert not (tmp_path / "sbatch.args").exists()
