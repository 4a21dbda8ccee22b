"""Every method under the real trainer: a few steps each (in-process, to keep CI time down), a Deep Ensemble equal to
its members' single runs, a Deep Ensemble with independent member batches under 2-process DDP, and every method
trained and evaluated (in the loop and by ``sigmanens eval``) on 2 ranks against a 1-process evaluation."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from sigmanens_dist.cli.eval import main as eval_main
from sigmanens_dist.cli.train import main
from sigmanens_dist.config import load_config
from sigmanens_dist.models import build_model, enable_grad_checkpointing
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, env, final_state, losses, run_train, torchrun

BASE = [*TINY_VIT, *SYNTHETIC, "optim.name=sgd", "optim.lr=0.05", "train.max_steps=3", "train.log_every_steps=1",
        "checkpoint.every_steps=3", "tracking.enabled=false", "model.num_members=2"]


def _train(run_dir: Path, *overrides: str) -> dict[str, float]:
    assert main([f"run_dir={run_dir}", *BASE, *overrides]) == 0
    metrics = json.loads((run_dir / "final_metrics.json").read_text())
    assert all(math.isfinite(v) for v in losses(run_dir).values())
    assert math.isfinite(metrics["nll"])
    return metrics


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sigma", "batch", "packed", "film", "deep"])
def test_method_trains_a_few_steps_and_its_checkpoint_evaluates_the_same(tmp_path: Path, method: str) -> None:
    """Each method trains, and `sigmanens eval` of its last checkpoint (the model rebuilt from the stored config by
    the one checkpoint reader) scores the validation split exactly as the trainer's final evaluation did."""
    extra = ["model.name=resnet10t", "model.kwargs={}"] if method == "packed" else []
    run = tmp_path / method
    metrics = _train(run, f"model.method={method}", "train.batch_size=8", *extra)
    assert "member1/nll" in metrics
    assert ("sharing/members_on" in metrics) == (method == "sigma")
    assert eval_main(["--checkpoint", str(run / "checkpoints" / "step_00000003.pt"), "--split", "val",
                      "--no-mlflow"]) == 0
    report = json.loads((run / "checkpoints" / "eval_step_00000003" / "eval.json").read_text())
    scored = report["weights"]["raw"]["metrics"]
    for key in ("acc", "nll", "ece", "member1/nll"):
        assert scored[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def deep_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two single runs (seeds 0 and 1) and a 2-member Deep Ensemble (seed 0), one process, batch 16."""
    root = tmp_path_factory.mktemp("deep")
    common = ["train.batch_size=16", "optim.weight_decay=5e-4"]
    for name, overrides in {"single0": ["model.method=single", "seed=0"], "single1": ["model.method=single", "seed=1"],
                            "deep": ["model.method=deep", "seed=0"]}.items():
        _train(root / name, *common, *overrides)
    return {name: root / name for name in ("single0", "single1", "deep")}


@pytest.mark.slow
def test_deep_ensemble_in_one_job_equals_single_runs_through_the_trainer(deep_runs: dict[str, Path]) -> None:
    """Member k of the ensemble trained by the CLI equals the single run with seed k (init, data order, SGD with
    momentum and coupled weight decay), to 1e-6; and the logged ensemble loss is the sum of theirs."""
    deep = final_state(deep_runs["deep"])
    for k in (0, 1):
        single = final_state(deep_runs[f"single{k}"])
        for name, value in single.items():
            if value.is_floating_point():
                theirs = deep[name.replace("backbone.", f"members.{k}.", 1)]
                torch.testing.assert_close(theirs, value, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    single_losses = [losses(deep_runs[f"single{k}"]) for k in (0, 1)]
    for step, loss in losses(deep_runs["deep"]).items():
        assert loss == pytest.approx(single_losses[0][step] + single_losses[1][step], rel=1e-5)


@pytest.mark.slow
def test_deep_ensemble_under_two_process_ddp_matches_one_process(tmp_path: Path, deep_runs: dict[str, Path]) -> None:
    """Independent member batches sharded over 2 ranks (8 per rank) train as the 1-process run with 16 does."""
    run = tmp_path / "ddp"
    run_train(run, *BASE, "model.method=deep", "seed=0", "train.batch_size=8", "optim.weight_decay=5e-4", nproc=2)
    assert (run / "final_metrics.json").is_file()
    one = losses(deep_runs["deep"])
    for step, loss in losses(run).items():
        assert loss == pytest.approx(one[step], rel=1e-4), step
    a, b = final_state(run), final_state(deep_runs["deep"])
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_grad_checkpointing_trains_the_same_model(tmp_path: Path) -> None:
    """Recomputing block activations in backward changes memory, not the result: with dropout and drop-path on (the
    recomputation replays the RNG state), σN-Ens's losses and weights equal those without checkpointing."""
    common = ["train.batch_size=8", "model.kwargs.drop_rate=0.1", "model.kwargs.drop_path_rate=0.1"]
    _train(tmp_path / "plain", *common)
    _train(tmp_path / "ckpt", *common, "train.grad_checkpointing=true")
    assert losses(tmp_path / "ckpt") == pytest.approx(losses(tmp_path / "plain"), rel=1e-6)
    plain, ckpt = final_state(tmp_path / "plain"), final_state(tmp_path / "ckpt")
    for name, value in plain.items():
        torch.testing.assert_close(ckpt[name], value, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    cfg = load_config(None, [*BASE, "train.grad_checkpointing=true"])
    assert build_model(cfg, num_classes=10, in_chans=3).backbone.grad_checkpointing  # timm's flag, after conversion
    with pytest.raises(ValueError, match=r"train.grad_checkpointing: model.name='lin' \(Linear\) has neither"):
        enable_grad_checkpointing(torch.nn.Linear(2, 2), "lin")


@pytest.mark.slow
def test_every_method_trains_and_evaluates_under_two_process_ddp(tmp_path: Path) -> None:
    """One torchrun launch trains each method on 2 ranks and evaluates it twice there: in the loop and with
    `sigmanens eval` under torchrun. On a validation split of 37 samples (uneven over 2 ranks at batch 4) both must
    score every sample exactly once and agree with a 1-process `sigmanens eval` of the same checkpoint."""
    script = REPO / "tests" / "dist_scripts" / "methods_ddp.py"
    proc = subprocess.run([*torchrun(2), str(script), str(tmp_path)], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for method in ("single", "sigma", "batch", "film", "deep", "packed"):
        run = tmp_path / method
        assert sorted(losses(run)) == [1, 2, 3], method
        in_loop = json.loads((run / "final_metrics.json").read_text())
        two = json.loads((run / "eval2" / "eval.json").read_text())["weights"]["raw"]
        assert eval_main(["--checkpoint", str(run / "checkpoints" / "step_00000003.pt"), "--split", "val",
                          "--no-mlflow", "--out", str(run / "eval1")]) == 0
        one = json.loads((run / "eval1" / "eval.json").read_text())["weights"]["raw"]
        assert one["metrics"]["num_samples"] == two["metrics"]["num_samples"] == 37, method
        for key in ("acc", "nll", "ece", "brier", "disagreement", "member0/nll"):
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), (method, key)
            assert in_loop[key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), (method, key)
        assert [row["k"] for row in two["sub_ensembles"]] == [row["k"] for row in one["sub_ensembles"]]
        for a, b in zip(two["sub_ensembles"], one["sub_ensembles"], strict=True):
            assert a["nll"] == pytest.approx(b["nll"], rel=1e-5), (method, a["k"])
