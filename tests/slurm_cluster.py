"""A real two-node Slurm cluster for the end-to-end tests: ``launch/slurm_local.sh`` up once, down (by PID) at the end,
plus submitting and watching jobs on it."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

SCRIPT = REPO / "launch" / "slurm_local.sh"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def _free_port_base(count: int = 3) -> int:
    """A port with the ``count - 1`` after it also free (slurmctld, then one slurmd per node)."""
    for base in range(41000, 49000, 7):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no three consecutive free ports in 41000-49000 for the test Slurm cluster")


class SlurmCluster:
    """Handle on a running local cluster: the environment its clients need, sbatch, job state."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.conf = state / "slurm.conf"

    def env(self, **extra: str) -> dict[str, str]:
        """What a user's shell would have: this cluster's SLURM_CONF, the venv first on PATH, this checkout."""
        bin_dir = str(Path(sys.executable).parent)
        env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
               "PYTHONPATH": str(REPO), "SIGMANENS_ROOT": str(REPO), "SIGMANENS_PYTHON": sys.executable,
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        return {**env, **extra}

    def run(self, *cmd: str, env: dict[str, str] | None = None) -> str:
        proc = subprocess.run(cmd, env=env or self.env(), capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def sbatch(self, cwd: Path, *args: str, env: dict[str, str]) -> int:
        out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 0, f"sbatch {' '.join(args)}: {out.stderr}"
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int | str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList, …); ``<id>_<task>`` for an array
        element."""
        text = self.run("scontrol", "show", "job", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_done(self, job_id: int | str, timeout: float) -> dict[str, str]:
        deadline = time.time() + timeout
        while (info := self.job(job_id))["JobState"] not in FINAL_STATES:
            assert time.time() < deadline, f"job {job_id} still {info['JobState']} after {timeout} s"
            time.sleep(1)
        return info


def bring_up(state: Path) -> Iterator[SlurmCluster]:
    """Start the cluster (installing slurm-wlm and munge as root if missing), yield it, stop every daemon."""
    env = {**os.environ, "SLURM_LOCAL_PORT": str(_free_port_base())}
    up = subprocess.run(["bash", str(SCRIPT), "up", str(state)], env=env, capture_output=True, text=True,
                        timeout=900, check=False)
    try:
        assert up.returncode == 0, f"slurm_local.sh up failed:\n{up.stdout}\n{up.stderr}\n{_logs(state)}"
        yield SlurmCluster(state)
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", str(state)], env=env, timeout=180, check=False)


def can_run() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if shutil.which("slurmctld") and shutil.which("munged"):
        return None if os.geteuid() == 0 else "the local Slurm daemons run as root"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm/munge are not installed and cannot be (needs root and apt-get)"
    return None


def _logs(state: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted((state / "log").glob("*.log")))
