"""``sigmanens --help``, every ``sigmanens <command> --help`` and a config's ``--check`` answer without importing
torch (issue 29 item 7: 8 s for ``--help`` when the CLI imported torch, timm, MLflow and DeepSpeed up front). Each
command runs in a fresh interpreter, which then reports the heavy modules it loaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, env

PROBE = """
import contextlib, io, json, sys
HEAVY = ("torch", "timm", "mlflow", "deepspeed")
import sigmanens_dist
from sigmanens_dist.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        status = main(sys.argv[1:])
    except SystemExit as exit:  # argparse's --help
        status = exit.code
print(json.dumps({"status": status, "out": out.getvalue(), "package": sigmanens_dist.__file__,
                  "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


def _probe(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("args", [
    ["--help"], ["train", "--help"], ["demo", "--help"], ["params", "--help"], ["data", "convert", "--help"],
    ["eval", "--help"], ["export", "--help"], ["study", "--help"], ["compare", "--help"], ["predict", "--help"],
    ["train", "--config", "demo", "--check"],
], ids=" ".join)
def test_help_and_check_import_no_torch(args: list[str]) -> None:
    result = _probe(*args)
    assert result["package"].startswith(str(REPO)), result["package"]  # this checkout's package, not another one
    assert result["status"] == 0
    assert result["out"].strip()
    assert result["heavy"] == [], f"sigmanens {' '.join(args)} imported {result['heavy']}"


def test_a_misspelt_model_is_still_caught_by_check() -> None:
    """The name check reads timm's sources for known names (no import); a name not there still goes to timm."""
    result = _probe("train", "--config", "demo", "model.name=resnet5O", "--check")
    assert result["status"] == 2


def test_timm_sources_name_what_timm_registers() -> None:
    """The source scan finds exactly the models timm lists; what it misses are deprecated aliases, which the config
    still accepts through timm.is_model."""
    import timm
    from timm.models._registry import _deprecated_models, _model_entrypoints

    from sigmanens_dist.config import load_config
    from sigmanens_dist.timm_names import _registered

    scanned = _registered()
    assert scanned == set(timm.list_models())
    missed = set(_model_entrypoints) - scanned
    assert missed <= set(_deprecated_models)
    if missed:
        name = sorted(missed)[0]
        assert load_config(None, [f"model.name={name}"], check_data=False).model.name == name
