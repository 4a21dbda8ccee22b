"""``sigmanens export RUN --program OUT``: the program predicts what the eager ensemble predicts, at any batch size,
in a process where sigmanens_dist and timm cannot be imported; a sub-ensemble program is the eager sub-ensemble;
bad ``--members`` is one line and exit 2 before anything is computed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sigmanens_dist.cli import main
from sigmanens_dist.evaluation import load_for_eval, sub_ensemble
from sigmanens_dist.evaluation.program import METADATA_FILE
from tests.test_checkpoint_compat import FIXTURE

CKPT = Path("checkpoints") / "step_00000002.pt"

# Runs in a fresh interpreter: imports of sigmanens_dist and timm fail before the program is loaded.
LOAD_WITHOUT_PACKAGE = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sigmanens_dist", "timm"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
for name in ("sigmanens_dist", "timm"):
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(name + " was importable")
import torch
extra = {"sigmanens.json": ""}
program = torch.export.load(sys.argv[1], extra_files=extra).module()
x = torch.load(sys.argv[2])
torch.save({k: v for k, v in program(x).items()}, sys.argv[3])
print(extra["sigmanens.json"])
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shutil.copytree(FIXTURE, tmp_path_factory.mktemp("program") / "run")


def _export(run: Path, name: str, *args: str) -> Path:
    out = run.parent / name
    assert main(["export", str(run / CKPT), "--program", str(out), *args]) == 0
    return out


def _metadata(path: Path) -> dict:
    extra = {METADATA_FILE: ""}
    torch.export.load(path, extra_files=extra)
    return json.loads(extra[METADATA_FILE])


def _eager_probs(run: Path, x: torch.Tensor, members: list[int], temperature: float = 1.0) -> torch.Tensor:
    model = sub_ensemble(load_for_eval(run / CKPT).model, members)
    with torch.no_grad():
        return (model(x) / temperature).softmax(-1).mean(0)  # the synthetic recipe: mean 0, std 1


@pytest.fixture(scope="module")
def calibrated(run: Path) -> Path:
    return _export(run, "calibrated.pt2", "--calibration", "temperature")


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_program_equals_the_eager_ensemble(run: Path, calibrated: Path, batch: int) -> None:
    meta = _metadata(calibrated)
    assert meta["members"] == [0, 1] and meta["method"] == "sigma" and meta["fitted_on"] == "val"
    assert meta["val_nll_after"] <= meta["val_nll_before"]
    x = torch.rand(batch, 3, 16, 16, generator=torch.Generator().manual_seed(batch))
    out = torch.export.load(calibrated).module()(x)
    expected = _eager_probs(run, x, [0, 1], meta["temperature"])
    torch.testing.assert_close(out["probabilities"], expected, rtol=0, atol=1e-5)
    assert torch.equal(out["prediction"], expected.argmax(-1))
    assert {k: v.shape[0] for k, v in out.items()} == dict.fromkeys(meta["outputs"], batch)


def test_program_loads_and_runs_without_sigmanens_and_timm(run: Path, calibrated: Path, tmp_path: Path) -> None:
    x = torch.rand(5, 3, 16, 16)
    torch.save(x, tmp_path / "x.pt")
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PACKAGE, str(calibrated), str(tmp_path / "x.pt"),
                           str(tmp_path / "out.pt")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["probabilities"], _eager_probs(run, x, [0, 1], meta["temperature"]),
                               rtol=0, atol=1e-5)


def test_sub_ensemble_program_is_the_eager_sub_ensemble(run: Path) -> None:
    program = _export(run, "one.pt2", "--members", "0")
    assert _metadata(program)["members"] == [0]
    module = torch.export.load(program).module()
    n_ops = sum(1 for node in module.graph.nodes if node.op == "call_function")
    full = torch.export.load(_export(run, "full.pt2")).module()
    assert n_ops < sum(1 for node in full.graph.nodes if node.op == "call_function")  # smaller, not masked
    x = torch.rand(7, 3, 16, 16)
    out = module(x)
    torch.testing.assert_close(out["probabilities"], _eager_probs(run, x, [0]), rtol=0, atol=1e-5)
    assert torch.all(out["disagreement"] == 0) and torch.allclose(out["mutual_information"], torch.zeros(7))


@pytest.mark.parametrize(("members", "message"), [
    ("2", "--members '2': give distinct member indices in 0..1"),
    ("", "--members '': give distinct member indices in 0..1"),
    ("0,x", "--members '0,x': give member indices separated by commas, e.g. 0,1"),
])
def test_bad_members_is_one_line_and_exit_2(run: Path, members: str, message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = run.parent / "bad.pt2"
    assert main(["export", str(run / CKPT), "--program", str(out), "--members", members]) == 2
    err = capsys.readouterr().err
    assert err == f"sigmanens export: error: {message}\n"
    assert not out.exists()
