"""FSDP2 and DeepSpeed ZeRO beside DDP: the same numbers, checkpoints that resume (also on another world size),
export from any of them, the checkpoint policy for folders, and clear errors for bad strategy settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from sigmanens_dist import convert_to_sigma_ensemble
from sigmanens_dist.checkpoint import CheckpointManager, consolidated_ema, consolidated_state_dict
from sigmanens_dist.cli.eval import main as eval_main
from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.distributed.env import DistEnv
from sigmanens_dist.distributed.strategies.fsdp import FSDPStrategy, shard_units
from sigmanens_dist.export import load_model
from tests.helpers import REPO, env, torchrun

SCRIPT = REPO / "tests" / "dist_scripts" / "strategy_matrix.py"
HAS_DEEPSPEED = __import__("importlib").util.find_spec("deepspeed") is not None
STRATEGIES = ["ddp", "fsdp", *(["zero1", "zero2", "zero3"] if HAS_DEEPSPEED else [])]


# -- FSDP units -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "kwargs", "expected"), [
    ("vit_tiny_patch16_224", {"img_size": 16, "patch_size": 4, "depth": 3, "embed_dim": 48, "num_heads": 2},
     ["backbone.blocks.0", "backbone.blocks.1", "backbone.blocks.2"]),
    ("resnet10t", {}, ["backbone.layer1", "backbone.layer2", "backbone.layer3", "backbone.layer4"]),
    ("convnext_atto", {}, [f"backbone.stages.{i}" for i in range(4)]),
])
def test_fsdp_shards_every_block_of_timm_families(name: str, kwargs: dict, expected: list[str]) -> None:
    ens = convert_to_sigma_ensemble(timm.create_model(name, num_classes=3, **kwargs), 2)
    assert [n for n, _ in shard_units(ens)] == expected


def test_fsdp_shards_every_hugging_face_encoder_layer() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3,
                                                    num_attention_heads=2, intermediate_size=32))
    ens = convert_to_sigma_ensemble(bert, 2)
    assert [n for n, _ in shard_units(ens)] == [f"backbone.bert.encoder.layer.{i}" for i in range(3)]


# -- bad input, before any step ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy.name=fsdp", "strategy.zero_stage=2"], "strategy.zero_stage applies to strategy.name=deepspeed only"),
    (["strategy.deepspeed_config=x.json"], "applies to strategy.name=deepspeed only, not strategy.name=ddp"),
    (["strategy.fsdp_replicate=2"], "strategy.fsdp_replicate applies to strategy.name=fsdp only"),
    (["strategy.name=deepspeed", "strategy.zero_stage=3", "train.ema_decay=0.9"], "EMA is not supported with ZeRO-3"),
    (["strategy.name=megatron"], "megatron"),
])
def test_strategy_options_that_do_not_apply_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["data.dataset=synthetic", *overrides])


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'sigmanens-dist\[deepspeed\]'"):
        load_config(None, ["data.dataset=synthetic", "strategy.name=deepspeed"])


def test_hsdp_mesh_must_divide_the_world_size() -> None:
    with pytest.raises(ValueError, match=r"strategy\.fsdp_replicate=3 does not divide the world size 4"):
        FSDPStrategy(DistEnv(0, 4, 0, torch.device("cpu")), replicate=3)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed not installed (extra 'deepspeed')")
def test_deepspeed_config_conflicts_are_reported(tmp_path: Path) -> None:
    from sigmanens_dist.distributed.strategies.deepspeed import DeepSpeedStrategy

    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"gradient_clipping": 2.0, "zero_optimization": {"stage": 3, "overlap_comm": True}}))
    with pytest.raises(ValueError, match=r"gradient_clipping: ours 1\.0, strategy.deepspeed_config 2\.0\n"
                                         r"zero_optimization\.stage: ours 2, strategy.deepspeed_config 3"):
        DeepSpeedStrategy(DistEnv(0, 1, 0, torch.device("cpu")), zero_stage=2, config_file=file, clip_grad=1.0)
    file.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    strategy = DeepSpeedStrategy(DistEnv(0, 1, 0, torch.device("cpu")), zero_stage=2, config_file=file)
    assert strategy.config["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    # a ZeRO-3-only key under ZeRO-2 would be accepted and ignored by DeepSpeed: refused
    file.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 1000}}))
    with pytest.raises(ValueError, match=r"sets zero_optimization\.stage3_param_persistence_threshold, which only "
                                         r"ZeRO-3 reads, with strategy\.zero_stage=2"):
        DeepSpeedStrategy(DistEnv(0, 1, 0, torch.device("cpu")), zero_stage=2, config_file=file)
    assert DeepSpeedStrategy(DistEnv(0, 1, 0, torch.device("cpu")), zero_stage=3, config_file=file).zero_stage == 3


# -- one checkpoint policy for folders ---------------------------------------------------------------------------------
def _dcp_writer(value: float):
    import torch.distributed.checkpoint as dcp

    return lambda folder: dcp.save({"model": {"w": torch.full((3,), value)}}, checkpoint_id=str(folder))


def test_folder_checkpoints_follow_the_file_policy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step, nll in [(1, 0.9), (2, 0.5), (3, 0.7), (4, None)]:
        mgr.save_folder(_dcp_writer(step), {"position": {"step": step}, "format": "dcp"}, step, nll, is_main=True,
                        barrier=lambda: None)
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in mgr.checkpoints()] == ["step_00000003", "step_00000004"]
    assert torch.load(ckpts / "best" / "trainer.pt", weights_only=False)["position"]["step"] == 2
    (ckpts / "step_00000004" / ".metadata").unlink()  # the newest lost its shard index: skipped, reported
    (ckpts / ".step_00000005.tmp").mkdir()  # a write that never completed is not a checkpoint
    state, path = mgr.load("auto")
    assert path.name == "step_00000003" and state.position.step == 3
    assert "step_00000004 is unreadable" in caplog.text
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == [
        "best", "step_00000003", "step_00000004"]


# -- the strategy matrix: one launch per world size --------------------------------------------------------------------
def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _final(run: Path) -> Path:
    return [p for p in CheckpointManager(run).checkpoints()][-1]


def _launch(args: list[str], out: Path) -> None:
    proc = subprocess.run([*args, str(SCRIPT), *out], cwd=REPO, env={**env(), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("matrix")
    _launch([sys.executable], ["single", out])
    _launch(torchrun(2), ["two", out])
    _launch([sys.executable], ["elastic", out])
    _launch(torchrun(4), ["hsdp", out])
    return out


def _assert_same_run(out: Path, name: str, ref: str = "ref") -> None:
    a, b = _losses(out / name), _losses(out / ref)
    assert sorted(a) == sorted(b) == list(range(1, 7)), name
    for step in b:
        assert a[step] == pytest.approx(b[step], rel=1e-5), (name, step)
    sa, _ = consolidated_state_dict(_final(out / name))
    sb, _ = consolidated_state_dict(_final(out / ref))
    assert sa.keys() == sb.keys()
    for k in sb:
        if sb[k].is_floating_point():
            torch.testing.assert_close(sa[k].float(), sb[k].float(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k: f"{name} {k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_match_one_process_with_double_batch_and_resume_continues(matrix: Path, strategy: str) -> None:
    _assert_same_run(matrix, strategy)
    _assert_same_run(matrix, f"{strategy}_resumed", strategy)  # cut back to step 3 and resumed: the same run
    if strategy != "ddp":
        assert _final(matrix / strategy).is_dir()  # sharded strategies write folders


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp_2to1", "fsdp_2to1", "ref_1to2", "fsdp_w1_1to2"])
def test_elastic_resume_continues_at_the_same_global_sample(matrix: Path, name: str) -> None:
    source = name.rsplit("_", 1)[0]
    _assert_same_run(matrix, name, source)


@pytest.mark.slow
def test_compiled_model_under_fsdp_trains_like_eager(matrix: Path) -> None:
    _assert_same_run(matrix, "fsdp_compiled", "fsdp")


@pytest.mark.slow
def test_ema_under_every_strategy_is_the_same_average(matrix: Path) -> None:
    """DDP's EMA copy, FSDP2's sharded shadows (straight, and resumed from its DCP checkpoint) and ZeRO-2's copy hold
    the same averaged weights, differ from the raw ones, and the loop scored them alike."""
    names = ["ddp_ema", "fsdp_ema", "fsdp_ema_resumed", *(["zero2_ema"] if HAS_DEEPSPEED else [])]
    averages = {}
    for name in names:
        raw, state = consolidated_state_dict(_final(matrix / name))
        averages[name] = consolidated_ema(_final(matrix / name), state)
        assert averages[name] is not None and averages[name].keys() == raw.keys(), name
        assert not torch.equal(averages[name]["sigma.flat"], raw["sigma.flat"]), name
    metrics = {n: json.loads((matrix / n / "final_metrics.json").read_text()) for n in names}
    for name in names[1:]:
        for key, value in averages["ddp_ema"].items():
            if value.is_floating_point():
                torch.testing.assert_close(averages[name][key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
        assert metrics[name]["nll"] == pytest.approx(metrics["ddp_ema"]["nll"], rel=1e-5), name


@pytest.mark.slow
def test_pretrained_weights_are_read_on_rank_zero_only(matrix: Path) -> None:
    rank0, rank1 = (json.loads((matrix / f"pretrained_rank{r}.json").read_text()) for r in (0, 1))
    names = ["ddp", "fsdp", *(["zero3"] if HAS_DEEPSPEED else [])]
    assert (rank0["reads"], rank1["reads"]) == (len(names), 0)
    assert all(rank0[n] and rank1[n] for n in names), (rank0, rank1)  # every rank holds the file's weights


@pytest.mark.slow
def test_hsdp_on_a_two_by_two_mesh_matches_one_process(matrix: Path) -> None:
    """4 processes: parameters sharded over 2 ranks and replicated twice; the same losses and weights as one
    process with the whole global batch."""
    mesh = json.loads((matrix / "hsdp_mesh.json").read_text())
    assert mesh["mesh"] == [2, 2] and mesh["placements"] == ["R", "S(0)"]  # replicated × sharded on dim 0
    assert mesh["local_rows"] * 2 == mesh["rows"]
    _assert_same_run(matrix, "hsdp")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed not installed (extra 'deepspeed')")
def test_zero3_partitions_the_flat_sigma_parameter(matrix: Path) -> None:
    flat = json.loads((matrix / "zero3_flat.json").read_text())
    assert flat["local"] * 2 == flat["all"]


@pytest.mark.slow
def test_every_rank_keeps_rank_zeros_running_statistics(matrix: Path) -> None:
    saved = torch.load(matrix / "fsdp_bn_stats.pt")
    assert saved["units"] == ["backbone.layer1", "backbone.layer2", "backbone.layer3", "backbone.layer4"]
    rank0, rank1 = saved["stats"]
    assert rank0.abs().sum() > 0 and torch.equal(rank0, rank1)


@pytest.mark.slow
def test_eval_at_end_of_a_sharded_run_scores_its_checkpoint_on_every_rank(matrix: Path) -> None:
    """FSDP's end-of-training evaluation (both ranks, 45 test samples split unevenly) equals a 1-process
    `sigmanens eval` of the same DCP checkpoint, sub-ensembles k = 1..4 included."""
    two = json.loads((matrix / "fsdp_bn" / "eval" / "eval.json").read_text())["weights"]["raw"]
    assert eval_main(["--checkpoint", str(_final(matrix / "fsdp_bn")), "--no-mlflow",
                      "--out", str(matrix / "fsdp_bn_eval1")]) == 0
    one = json.loads((matrix / "fsdp_bn_eval1" / "eval.json").read_text())["weights"]["raw"]
    assert two["metrics"]["num_samples"] == one["metrics"]["num_samples"] == 45
    assert [r["k"] for r in two["sub_ensembles"]] == [1, 2, 3, 4]
    for a, b in zip(two["sub_ensembles"], one["sub_ensembles"], strict=True):
        assert (a["acc"], a["nll"]) == pytest.approx((b["acc"], b["nll"]), rel=1e-5), a["k"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_of_every_strategy_equals_the_trained_model(matrix: Path, strategy: str, tmp_path: Path) -> None:
    from sigmanens_dist.cli import main

    ckpt = _final(matrix / strategy)
    assert main(["export", str(ckpt), str(tmp_path / "ens.pt")]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "m1.pt"), "--member", "1"]) == 0
    trained = load_model(_final(matrix / "ref"))  # the uninterrupted 1-process run's own file checkpoint
    exported = load_model(ckpt)
    exported.load_state_dict(torch.load(tmp_path / "ens.pt"))
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(x), trained(x), rtol=1e-4, atol=1e-5)
        member = timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=16, patch_size=4, depth=2,
                                   embed_dim=48, num_heads=2)
        member.load_state_dict(torch.load(tmp_path / "m1.pt"))
        torch.testing.assert_close(member.eval()(x), trained(x)[1], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fsdp_bf16_casts_blocks_but_keeps_sigma_fp32(matrix: Path) -> None:
    seen = json.loads((matrix / "fsdp_bf16_dtypes.json").read_text())
    assert seen == {"flat": "torch.float32", "gate": "torch.float32", "block_weight": "torch.bfloat16",
                    "block_input": "torch.bfloat16", "div": "torch.float32"}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed")
def test_deepspeed_runs_and_resumes_on_one_process(tmp_path: Path) -> None:
    """One GPU (here: one CPU process, no torchrun) is where users start: ZeRO builds its engine on a process group
    of one, and a resumed run continues as the uninterrupted one."""
    from tests.helpers import SYNTHETIC, TINY_VIT, losses, run_train

    common = [*TINY_VIT, *SYNTHETIC, "train.batch_size=16", "optim.name=adamw", "optim.lr=0.002",
              "model.num_members=2", "strategy.name=deepspeed", "checkpoint.every_steps=3", "train.log_every_steps=1",
              "eval.at_end=false", "schedule.name=constant"]  # constant: stopping at 3 of 6 keeps the same rates
    run_train(tmp_path / "straight", *common, "train.max_steps=6")
    run_train(tmp_path / "resumed", *common, "train.max_steps=3")
    run_train(tmp_path / "resumed", *common, "train.max_steps=6", "--resume", "auto")
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-6), step


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed")
# each stage once and each direction once (shrinking, growing): the universal-checkpoint conversion is one code path,
# the stage only changes how the optimiser state is partitioned (the two other pairs, ZeRO-1 1→2 and ZeRO-2 2→1, cost
# ~3 min of CI for no code path of their own)
@pytest.mark.parametrize(("stage", "before", "after"), [(1, 2, 1), (2, 1, 2)])
def test_zero_resumes_on_another_world_size(tmp_path: Path, stage: int, before: int, after: int) -> None:
    """Elastic ZeRO: the step folder is converted once to DeepSpeed's universal checkpoint and loaded on the new world
    size with the global batch kept; a LayerNorm model continues as the uninterrupted run (to float precision)."""
    from tests.helpers import SYNTHETIC, TINY_VIT, losses, run_train

    per_rank = 16 // before
    common = [*TINY_VIT, *SYNTHETIC, f"train.batch_size={per_rank}", "optim.name=adamw", "optim.lr=0.002",
              "model.num_members=2", "strategy.name=deepspeed", f"strategy.zero_stage={stage}",
              "checkpoint.every_steps=3", "train.log_every_steps=1", "eval.at_end=false", "schedule.name=constant"]
    run_train(tmp_path / "straight", *common, "train.max_steps=6", nproc=before)
    run = tmp_path / "elastic"
    run_train(run, *common, "train.max_steps=3", nproc=before)
    proc = run_train(run, *common, "train.max_steps=6", "--resume", "auto", nproc=after)
    assert f"elastic resume: {after} ranks instead of {before}" in proc.stderr
    assert (run / "checkpoints" / "step_00000003" / "universal").is_dir()  # converted once, kept
    straight, resumed = losses(tmp_path / "straight"), losses(run)
    assert sorted(resumed) == list(range(1, 7))
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step
