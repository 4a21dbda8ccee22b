"""A skip is not a pass in CI (tests/conftest.py, ``SIGMANENS_FORBID_SKIPS=1``, set by ``.ci/run``): a run whose
test or module skipped, unless ``ALLOWED_SKIPS`` allows it on this runner, exits 1 naming it, in one process and
under pytest-xdist; without the variable a skip stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SKIPPING = '''
import pytest


def test_runs() -> None:
    assert True


def test_needs_a_tool() -> None:
    pytest.skip("needs the frobnicator (launch/setup.sh installs it)")
'''
MODULE_SKIP = '''
import pytest

pytest.importorskip("sigmanens_no_such_module")


def test_never_collected() -> None:
    assert True
'''
# a test whose node id (relative to the temporary rootdir) is one ALLOWED_SKIPS allows on every runner
ALLOWED = '''
import pytest


@pytest.mark.parametrize("after", [2.5])
def test_a_signal_during_start_up_is_a_preemption(after: float) -> None:
    pytest.skip("training had already started on this machine")
'''


def _pytest(root: Path, *args: str, forbid: bool = True) -> subprocess.CompletedProcess:
    """pytest over ``root`` with this suite's conftest as a plugin (``-p tests.conftest``, importable from REPO)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("SIGMANENS_FORBID_SKIPS", "PYTEST_XDIST_WORKER")}
    environ |= {"SIGMANENS_FORBID_SKIPS": "1"} if forbid else {}
    environ["PYTHONPATH"] = str(REPO) + os.pathsep + environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           "--rootdir", str(root), "-c", os.devnull, *args, str(root)],
                          cwd=root, env=environ, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_an_unlisted_skip_fails_the_run_and_names_the_test(tmp_path: Path, workers: list[str]) -> None:
    (tmp_path / "test_tool.py").write_text(SKIPPING)
    (tmp_path / "test_dependency.py").write_text(MODULE_SKIP)
    proc = _pytest(tmp_path, *workers)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "skips not allowed on this runner (SIGMANENS_FORBID_SKIPS=1)" in out
    assert "test_tool.py::test_needs_a_tool: needs the frobnicator (launch/setup.sh installs it)" in out
    assert "test_dependency.py: could not import 'sigmanens_no_such_module'" in out  # a whole module, and why
    assert "2 skipped: install what they need" in out and "test_tool.py::test_runs:" not in out

    allowed = _pytest(tmp_path, *workers, forbid=False)  # outside CI a skip is a skip
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "skips not allowed" not in allowed.stdout


def test_a_skip_the_runner_allows_passes(tmp_path: Path) -> None:
    (tmp_path / "tests" / "training").mkdir(parents=True)
    (tmp_path / "tests" / "training" / "test_run_ownership.py").write_text(ALLOWED)
    proc = _pytest(tmp_path, "-n", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "skips not allowed" not in proc.stdout
    assert "test_a_signal_during_start_up_is_a_preemption[2.5]: training had already started on this machine " \
        "(allowed: training had already started when the signal came)" in proc.stdout


def test_ci_forbids_skips() -> None:
    """``.ci/run`` runs the suite with the check on."""
    assert "SIGMANENS_FORBID_SKIPS=1 bash launch/test.sh" in (REPO / ".ci" / "run").read_text()
