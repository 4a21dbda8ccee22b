"""The wheel: built from the checkout, installed into a fresh virtual environment, used outside the checkout. The
recipes exist once (top-level ``configs/``); the wheel must carry them inside the package so ``--config NAME``
works after a plain ``pip install``."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(out), str(REPO)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"building the wheel failed (hatchling comes with the dev extra):\n{proc.stderr}"
    (whl,) = out.glob("sigmanens_dist-*.whl")
    return whl


def test_wheel_ships_the_recipes_and_only_the_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.startswith("sigmanens_dist/configs/"))
    assert shipped == [f"sigmanens_dist/configs/{p.name}" for p in sorted((REPO / "configs").glob("*.yaml"))]
    for name in shipped:
        assert zipfile.ZipFile(wheel).read(name) == (REPO / "configs" / Path(name).name).read_bytes()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"sigmanens_dist", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert "sigmanens_dist/methods/sigma.py" in names and "sigmanens_dist/sigma/convert.py" in names


@pytest.mark.slow
def test_installed_wheel_runs_a_recipe_by_name_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, text=True)
    # The dependencies (torch, timm, …) come from this environment; its .pth files are not read from there, so
    # the checkout's editable sigmanens_dist stays invisible: only the wheel's copy can be imported.
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = ("import sigmanens_dist, sigmanens_dist.config as c; print(sigmanens_dist.__file__); print(c.RECIPES); "
             "print(c.load_config('fmnist_small', check_data=False).model.name)")
    lines = subprocess.run([str(py), "-c", probe], cwd=work, check=True, capture_output=True, text=True
                           ).stdout.splitlines()
    assert lines[0].startswith(str(site / "sigmanens_dist")), lines
    assert lines[1] == str(site / "sigmanens_dist" / "configs"), lines
    assert lines[2] == "test_resnet"
    proc = subprocess.run([str(venv / "bin" / "sigmanens"), "train", "--config", "demo", "--check"], cwd=work,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "config ok" in proc.stdout


def _setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Source launch/setup.sh against a venv that has never been installed into (a python, no stamp, no pip)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    return subprocess.run(["bash", "-c", f"source {REPO / 'launch' / 'setup.sh'}"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "SIGMANENS_VENV": str(venv), **env},
                          check=False, timeout=120)


def test_setup_refuses_a_constraints_file_that_does_not_exist_before_installing(tmp_path: Path) -> None:
    if sysconfig.get_platform().split("-")[-1] not in ("x86_64", "amd64"):
        pytest.skip("the constraints apply on x86_64 only")
    missing = tmp_path / "pins.txt"
    proc = _setup(tmp_path, SIGMANENS_CONSTRAINTS=str(missing))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"SIGMANENS_CONSTRAINTS={missing}: no such file" in proc.stderr and "or none" in proc.stderr
    assert "installing" not in proc.stdout and not (tmp_path / "venv" / ".sigmanens-installed").exists()


def test_the_constraints_pin_the_torch_that_setup_installs() -> None:
    """setup.sh pins torch itself and holds the rest to launch/constraints.txt: the two must agree, or pip cannot
    resolve the install on a fresh machine."""
    setup = (REPO / "launch" / "setup.sh").read_text()
    x86 = setup.split("*) TORCH=(", 1)[1].split(")", 1)[0].split()
    pins = dict(line.split("==", 1) for line in (REPO / "launch" / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert x86 and all(pins[name] == version for name, version in (p.split("==") for p in x86)), (x86, pins["torch"])
    assert not any(name.startswith("sigmanens") for name in pins)  # the package itself is installed from the checkout
