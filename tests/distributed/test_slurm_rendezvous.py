"""slurm/common.sh's rendezvous port: a port something already listens on at the head is never handed to torchrun.
Two jobs on one port (ids equal mod 22000, or two clusters on one host) put one job's agents into the other's
rendezvous, where they wait until the time limit: seen when the test cluster ran beside a second local cluster."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.helpers import REPO


def _pick(job: int, **env: str) -> subprocess.CompletedProcess[str]:
    script = f'source "{REPO}/slurm/common.sh"; SLURM_JOB_ID={job}; _sm_rdzv_port 127.0.0.1'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", **env})


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port in the derived range held by a listener, with the port after it free."""
    for port in range(21000, 31000, 3):
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            listener = socket.socket()
            listener.bind(("127.0.0.1", port))
        except OSError:
            continue
        listener.listen()
        try:
            yield port
        finally:
            listener.close()
        return
    pytest.skip("no two consecutive free ports in 21000-31000")


def test_a_taken_rendezvous_port_is_skipped_or_refused(held_port: int) -> None:
    job = held_port - 10000  # its derived port is the held one
    skipped = _pick(job)
    assert skipped.returncode == 0 and skipped.stdout.strip() == str(held_port + 1), skipped.stderr
    free = _pick(job + 1)
    assert free.returncode == 0 and free.stdout.strip() == str(held_port + 1)
    given = _pick(job, SIGMANENS_RDZV_PORT=str(held_port))
    assert given.returncode == 1 and not given.stdout.strip()
    assert f"SIGMANENS_RDZV_PORT={held_port} is taken on 127.0.0.1" in given.stderr
