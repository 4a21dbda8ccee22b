"""Checkpoints written before the package was laid out by role (commit 12546e3, v0.1.0: a 2-member σN-Ens ViT, 2
steps, with EMA) still load, predict the same and resume: nothing of the layout is pickled in a checkpoint, and
this fixture keeps it so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sigmanens_dist.checkpoint import consolidated_ema, consolidated_state_dict
from sigmanens_dist.export import load_model
from tests.helpers import FIXTURE, run_train

CKPT = FIXTURE / "checkpoints" / "step_00000002.pt"


def test_old_checkpoint_predicts_what_it_predicted_when_written() -> None:
    expected = torch.load(FIXTURE / "expected_logits.pt", weights_only=True)  # the logits v0.1.0 computed
    with torch.no_grad():
        logits = load_model(CKPT)(expected["input"])
    assert logits.shape == (2, 3, 10)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-6)
    weights, state = consolidated_state_dict(CKPT)
    ema = consolidated_ema(CKPT, state)
    assert ema is not None and ema.keys() == weights.keys()


@pytest.mark.slow
def test_old_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    run_train(run, "--config", str(run / "config.yaml"), "train.max_steps=3", "checkpoint.resume=auto")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0].get("resumed_from_step") == 2
    assert [r["step"] for r in rows if "train/loss" in r] == [3]
    assert (run / "checkpoints" / "step_00000003.pt").is_file()
