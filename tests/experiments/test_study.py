"""``sigmanens study`` and ``sigmanens compare``: a mini study end to end through a sqlite store and a real ``mlflow
server``, a partial study, resuming, and clear errors for bad input."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from scipy import stats

from sigmanens_dist.cli.compare import main as compare_main
from sigmanens_dist.cli.study import main as study_main
from sigmanens_dist.errors import UsageError
from sigmanens_dist.experiments.compare import (
    CompareError,
    RunRecord,
    build_report,
    group_runs,
    load_runs,
    paired_difference,
    read_records,
    reference_for,
    select_split,
    write_report,
)
from sigmanens_dist.experiments.study import (
    ROLE_TAG,
    ChildSpec,
    StudyError,
    build_definition,
    child_state,
    read_definition,
    run_one,
    save_definition,
    write_definition,
)
from sigmanens_dist.experiments.study.running import _command
from tests.helpers import REPO, SYNTHETIC, TINY_VIT, mlflow_server, run_record

mlflow = pytest.importorskip("mlflow")

BASE = [*TINY_VIT, *SYNTHETIC, "train.batch_size=16", "train.max_steps=2", "train.log_every_steps=1",
        "optim.name=adamw", "optim.lr=0.002", "tracking.experiment=study-tests", "reg.lambda=0.001"]
STUDY_V1 = REPO / "tests" / "fixtures" / "study_v1"  # written by release 0.3.0's `sigmanens study --prepare`
GRID = ["m-scaling", "--members", "1,2", "--taus", "0.25,1", "--seeds", "0"]
NAMES = ["sigma-M1-tau0.25-lam0.001-s0", "sigma-M1-tau1-lam0.001-s0", "sigma-M2-tau0.25-lam0.001-s0",
         "sigma-M2-tau1-lam0.001-s0"]


def _table_rows(path: Path) -> list[list[str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("| sigma")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines]


@pytest.mark.slow
def test_mini_study_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the study's own store: <out>/mlflow.db
    out = tmp_path / "study"
    uri = f"sqlite:///{out}/mlflow.db"
    # 1. Prepared as for a Slurm array: definition and parent run, no child yet; then one array element.
    assert study_main([*GRID, "--out", str(out), "--prepare", *BASE]) == 0
    definition = yaml.safe_load((out / "study.yaml").read_text())
    assert [c["name"] for c in definition["children"]] == NAMES
    parent = definition["tracking"]["parent_run_id"]
    assert run_one(out / "study.yaml", 2) == 0
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("study-tests")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.artifact_location == (out / "mlartifacts").as_uri()  # beside the sqlite store

    # 2. compare on the partial study: the finished child in the table, the others listed as missing.
    assert compare_main(["--parent", parent, "--uri", uri, "--out", str(tmp_path / "partial")]) == 0
    partial = (tmp_path / "partial" / "table.md").read_text()
    assert len(_table_rows(tmp_path / "partial" / "table.md")) == 1
    for name in (NAMES[0], NAMES[1], NAMES[3]):
        assert f"{name}: missing (not started)" in partial

    # 3. The whole study: the finished child is skipped, the others run.
    capsys.readouterr()
    assert study_main([*GRID, "--out", str(out), *BASE]) == 0
    printed = capsys.readouterr().out
    assert f"{NAMES[2]}: finished, skipped" in printed
    assert printed.count(": starting") == 3
    # within 100 columns, commands folded so that they stay pasteable: only a single word longer than a line (this
    # test's deep temporary paths) may pass the edge, on a line of its own
    wide = [line for line in printed.splitlines() if len(line) > 100 and len(line.strip(" \\").split()) > 1]
    assert not wide, wide
    assert "\\\n    " in printed  # each child's command folded with shell continuations
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")
    assert sorted(r.info.run_name for r in children) == NAMES
    child = next(r for r in children if r.info.run_name == NAMES[3])
    assert child.data.params["model.num_members"] == "2" and child.data.params["reg.tau"] == "1.0"
    assert child.data.tags["sigmanens.method"] == "sigma" and child.data.tags["sigmanens.grid.tau"] == "1.0"
    assert child.inputs.dataset_inputs[0].dataset.name == "synthetic"
    assert {"final/params", "final/train_img_per_s", "val/nll"} <= child.data.metrics.keys()
    assert child.data.metrics["final/steps"] == 2 and child.data.metrics["final/train_images"] == 2 * 16
    assert client.get_run(parent).info.status == "FINISHED"
    assert client.get_run(parent).data.params["study.lambda_policy"] == "fixed"

    # 4. compare the whole study: every child in the table, plots written and logged to the parent run.
    report = tmp_path / "report"
    assert compare_main(["--parent", parent, "--uri", uri, "--out", str(report)]) == 0
    rows = _table_rows(report / "table.md")
    assert sorted((r[1], r[2]) for r in rows) == [("1", "0.25"), ("1", "1"), ("2", "0.25"), ("2", "1")]
    assert "Incomplete" not in (report / "table.md").read_text()
    for plot in ("metric_vs_members.png", "acc_vs_ece.png", "nll_vs_cost.png"):
        assert (report / plot).stat().st_size > 10_000, plot
    assert len((report / "runs.csv").read_text().splitlines()) == 1 + len(NAMES)
    logged = {a.path for a in client.list_artifacts(parent, "compare")}
    assert {"compare/table.md", "compare/table.csv", "compare/metric_vs_members.png"} <= logged

    # 5. Re-running the finished study launches nothing.
    assert study_main([*GRID, "--out", str(out), *BASE]) == 0
    printed = capsys.readouterr().out
    assert printed.count("finished, skipped") == 4 and ": starting" not in printed
    assert len(client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'")) == 4
    # ... and neither does continuing it from its saved definition (the folder or its study.yaml)
    assert study_main(["resume", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"resuming 4 children from {out / 'study.yaml'}" in printed and printed.count("finished, skipped") == 4

    # 6. The same comparison read through a real tracking server on that store.
    with mlflow_server(out / "mlflow.db") as url:
        assert compare_main(["--parent", parent, "--uri", url, "--out", str(tmp_path / "server")]) == 0
        assert compare_main(["--experiment", "study-tests", "--uri", url, "--out", str(tmp_path / "exp")]) == 0
    assert _table_rows(tmp_path / "server" / "table.md") == rows
    assert _table_rows(tmp_path / "exp" / "table.md") == rows


def test_invalid_grid_is_refused_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    status = study_main(["tau-sweep", "--taus", "0.5,-1", "--methods", "sigma,foo", "--out", str(out), *BASE,
                         "reg.tau=2"])
    assert status == 2
    err = capsys.readouterr().err
    assert "--taus: -1.0 is not a number > 0" in err
    assert "unknown method 'foo'; available: sigma, single, deep, batch, packed, film" in err
    assert "override 'reg.tau=2': reg.tau is set by the study" in err
    assert not out.exists()
    # every child goes through the trainer's own validation; its problems come back named by child
    with pytest.raises(StudyError, match=r"packed-M2-s0:\n.*model.method: packed supports the timm ResNet family"):
        build_definition("methods", None, {"methods": ["sigma", "packed"], "members": [2], "seeds": [0]}, BASE, out)
    assert not out.exists()


def test_a_methods_own_knob_is_a_valid_study_override_for_that_method_only(tmp_path: Path) -> None:
    knob = [*BASE, "model.name=resnet10t", "model.packed_alpha=3"]
    definition = build_definition("methods", None, {"methods": ["packed"], "members": [4, 8], "seeds": [0]}, knob,
                                  tmp_path / "a3")
    assert [c.name for c in definition.children] == ["packed-M4-s0", "packed-M8-s0"]
    with pytest.raises(StudyError, match=r"sigma-M4.*\n.*model.packed_alpha: applies to model.method=packed only"):
        build_definition("methods", None, {"methods": ["packed", "sigma"], "members": [4], "seeds": [0]}, knob,
                         tmp_path / "mixed")


def test_changed_grid_in_the_same_folder_is_an_error(tmp_path: Path) -> None:
    first = build_definition("m-scaling", None, {"members": [1, 2], "seeds": [0]}, BASE, tmp_path / "s")
    write_definition(first, None)
    again = build_definition("m-scaling", None, {"members": [1, 2], "seeds": [0]}, BASE, tmp_path / "s")
    assert write_definition(again, None) == tmp_path / "s" / "study.yaml"  # the same study: resumed
    other = build_definition("m-scaling", None, {"members": [1, 4], "seeds": [0]}, BASE, tmp_path / "s")
    with pytest.raises(StudyError, match=rf"defines a different study .*`sigmanens study resume {tmp_path / 's'}`"):
        write_definition(other, None)
    assert study_main(["resume", str(tmp_path / "nowhere")]) == 2  # no definition there: one line, exit 2


def test_grid_collapses_axes_a_method_does_not_have_and_keeps_the_global_batch(tmp_path: Path) -> None:
    d = build_definition("methods", None, {"members": [2, 8], "seeds": [0, 1], "methods": ["sigma", "single"]},
                         [*BASE, "train.batch_size=16"], tmp_path / "s", lambda_policy="per-member",
                         max_backbone_batch=32)
    names = [c.name for c in d.children]
    assert names == ["sigma-M2-tau0.5-lam0.001-s0", "sigma-M2-tau0.5-lam0.001-s1", "sigma-M8-tau0.5-lam0.001-s0",
                     "sigma-M8-tau0.5-lam0.001-s1", "single-s0", "single-s1"]
    m8 = d.children[2].overrides
    assert "reg.lambda=0.000125" in m8  # per-member policy: λ / M
    assert "train.batch_size=4" in m8 and "train.grad_accum=4" in m8  # 16 × 8 > 32 images: split, same global batch
    assert "model.method=single" in d.children[4].overrides
    assert not any(o.startswith(("reg.", "model.num_members")) for o in d.children[4].overrides)
    d.nproc, d.base_config, d.tracking.parent_run_id = 2, "base_config.yaml", "abc"
    cmd = _command(d, d.children[0], tmp_path / "s" / "study.yaml")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[5:9] == ["-m", "sigmanens_dist.train", "--config", str(tmp_path / "s" / "base_config.yaml")]
    assert cmd[-2:] == ["tracking.parent_run_id=abc", "checkpoint.resume=auto"]


def test_budget_axis_multiplies_the_steps_for_equal_compute(tmp_path: Path) -> None:
    d = build_definition("methods", None, {"methods": ["single"], "budgets": [1, 4], "seeds": [0]}, BASE,
                         tmp_path / "s")
    assert [c.name for c in d.children] == ["single-s0", "single-x4-s0"]
    assert "train.max_steps=8" in d.children[1].overrides  # BASE trains 2 steps
    assert not any(o.startswith("train.max_steps") for o in d.children[0].overrides)
    with pytest.raises(StudyError, match=r"--budgets 1,2: multiplies train.max_steps, which the base config does not "
                                         r"set \(it trains train.epochs=1\)"):
        build_definition("methods", None, {"methods": ["single"], "budgets": [1, 2]},
                         [*BASE, "train.max_steps=null", "train.epochs=1"], tmp_path / "t")
    with pytest.raises(StudyError, match="--budgets: 0 is not a whole number >= 1"):
        build_definition("methods", None, {"methods": ["single"], "budgets": [0]}, BASE, tmp_path / "u")


def test_child_state_skips_finished_and_resumes_interrupted(tmp_path: Path) -> None:
    definition = read_definition(STUDY_V1 / "study.yaml").model_copy(update={"out": str(tmp_path)})
    for name in ("done", "cut", "new"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
    (tmp_path / "done" / "final_metrics.json").write_text("{}")
    (tmp_path / "cut" / "checkpoints" / "step_00000004.pt").write_bytes(b"x")

    def child(name: str) -> ChildSpec:
        return ChildSpec(index=0, name=name, point={}, overrides=[])

    states = {n: child_state(definition, child(n), set()) for n in ("done", "cut", "new")}
    assert states == {"done": "finished", "cut": "resume", "new": "start"}
    assert child_state(definition, child("new"), {"new"}) == "finished"  # FINISHED in MLflow (another node)


def test_paired_difference_is_a_t_interval_over_seeds() -> None:
    records = [run_record("single", 1, None, s, a) for s, a in enumerate([0.80, 0.82, 0.81])]
    records += [run_record("sigma", 4, 0.5, s, a) for s, a in enumerate([0.90, 1.02, 1.11])]  # diffs .1 .2 .3
    records += [run_record("sigma", 4, 1.0, s, 0.85) for s in (0, 2)]
    groups = group_runs(records)
    sigma = next(g for g in groups if g.method == "sigma" and g.tau == 0.5)
    ref = reference_for(sigma, groups, "single")
    assert ref is not None and ref.method == "single"
    mean, lo, hi, n = paired_difference(sigma, ref, "acc")
    half = stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3)
    assert n == 3 and mean == pytest.approx(0.2) and (lo, hi) == pytest.approx((0.2 - half, 0.2 + half))
    other = next(g for g in groups if g.tau == 1.0)
    assert paired_difference(other, ref, "acc")[3] == 2  # only seeds 0 and 2 pair
    assert reference_for(ref, groups, "sigma") is None  # two σN-Ens groups: no single reference for `single`


def test_pairing_at_equal_epochs_or_equal_compute(tmp_path: Path) -> None:
    records = [run_record("single", 1, None, s, 0.80) for s in range(3)]
    records += [run_record("single", 1, None, s, 0.84 + 0.01 * s, budget=4) for s in range(3)]  # 4× the steps
    records += [run_record("sigma", 4, 0.5, s, 0.83) for s in range(3)]
    groups = group_runs(records)
    sigma = next(g for g in groups if g.method == "sigma")
    assert reference_for(sigma, groups, "single", "epochs").budget == 1
    assert reference_for(sigma, groups, "single", "compute").budget == 4  # same images × members
    write_report(records, [], tmp_path, "single", pair="compute")
    table = (tmp_path / "table.md").read_text()
    assert "| single | 1 |  |  | 4× | 3 |" in table and "| sigma | 4 | 0.5 | 0.001 | 1× | 3 |" in table
    assert "-0.0200 [" in table and "the same training compute" in table  # 0.83 − (0.84, 0.85, 0.86)
    with pytest.raises(CompareError, match="--pair 'flops': choose one of epochs, compute"):
        write_report(records, [], tmp_path, "single", pair="flops")
    with pytest.raises(CompareError, match=r"--split test: 9 run\(s\) have no test-set evaluation"):
        write_report(records, [], tmp_path, "single", split="test")
    assert "Selection on the test set" not in table  # validation scores
    for r in records:
        r.split_values["test"] = {"acc": r.values["acc"]}
    write_report(records, [], tmp_path, "single", pair="compute", split="test")
    assert "**Selection on the test set:** this table compares 3 configurations" in (tmp_path / "table.md").read_text()


def test_pairing_with_the_next_smaller_m(tmp_path: Path) -> None:
    """``--pair members``: each configuration against itself at the next smaller M present (a gap is skipped, another
    method or τ is never the reference), so an M-scaling table says what each step up in M bought."""
    from sigmanens_dist.experiments import terminal

    acc = {1: 0.80, 2: 0.85, 4: 0.87, 16: 0.86}
    records = [run_record("sigma", m, 0.5, s, a + 0.001 * s * m) for m, a in acc.items() for s in range(3)]
    records += [run_record("sigma", 8, 1.0, s, 0.9) for s in range(3)]  # another τ: its own line, nothing smaller
    records += [run_record("packed", m, None, s, 0.7 + 0.01 * m) for m in (2, 4) for s in range(3)]
    groups = group_runs(records)

    def at(method: str, m: int, tau: float | None = 0.5) -> Any:
        return next(g for g in groups if (g.method, g.members, g.tau) == (method, m, tau))

    assert reference_for(at("sigma", 16), groups, "sigma", "members") is at("sigma", 4)  # M=8 has another τ
    assert reference_for(at("sigma", 1), groups, "sigma", "members") is None
    assert reference_for(at("sigma", 8, 1.0), groups, "sigma", "members") is None
    assert reference_for(at("packed", 2, None), groups, "sigma", "members") is None  # not σN-Ens M=1
    assert reference_for(at("packed", 4, None), groups, "sigma", "members") is at("packed", 2, None)
    write_report(records, [], tmp_path, None, pair="members")
    table = (tmp_path / "table.md").read_text()
    assert "Δacc vs smaller M [95% CI]" in table and "at the next smaller M" in table
    row16 = next(line for line in table.splitlines() if line.startswith("| sigma | 16 |"))
    assert "| +0.0020 [" in row16  # per seed s: 0.86 + 0.016 s − (0.87 + 0.004 s), s = 0, 1, 2
    assert "diff_acc_vs_smaller_M_mean" in (tmp_path / "table.csv").read_text().splitlines()[0]
    text = terminal.render(build_report(records, None, pair="members"), [])
    assert "Δ: the difference to the same configuration at the next smaller M" in " ".join(text.split())
    with pytest.raises(CompareError, match="--reference 'sigma' plays no part with --pair members"):
        build_report(records, "sigma", pair="members")


def test_compare_errors_name_what_is_wrong(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(CompareError, match="no such sqlite file"):
        load_runs(uri, experiment="x")
    client = mlflow.MlflowClient(uri)
    client.create_experiment("empty")
    with pytest.raises(CompareError, match=r"'empty' in .* has no runs"):
        load_runs(uri, experiment="empty")
    with pytest.raises(CompareError, match=r"'nope': no such experiment .* \(it has: Default, empty\)"):
        load_runs(uri, experiment="nope")
    with pytest.raises(CompareError, match="--parent 0123456789abcdef0123456789abcdef: no such run"):
        load_runs(uri, parent="0123456789abcdef0123456789abcdef")


def test_report_has_ood_and_severity_when_runs_log_them(tmp_path: Path) -> None:
    records = []
    for seed in (0, 1, 2):
        for method, m, tau, shift in (("single", 1, None, 0.0), ("sigma", 4, 0.5, 0.01 * (seed + 1))):
            r = run_record(method, m, tau, seed, 0.8 + shift)
            r.values.update({"nll": 0.5 - shift, "ece": 0.03, "ood_auroc": 0.7 + shift, "params": 1e6 * (1 + m / 100),
                             "train_compute": 1e5 * m})
            r.severity_ece = {s: 0.02 * s + shift for s in range(1, 6)}
            records.append(r)
    files = {p.name for p in write_report(records, ["sigma-M8-s0: missing (not started)"], tmp_path, None)}
    assert {"table.md", "table.csv", "runs.csv", "acc_vs_ece.png", "nll_vs_cost.png", "ece_vs_severity.png"} <= files
    assert "metric_vs_members.png" in files  # M = 1 and 4
    assert (tmp_path / "ece_vs_severity.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    assert "OOD AUROC" in table and "Δood_auroc vs single [95% CI]" in table
    assert "| sigma | 4 | 0.5 | 0.001 | 3 |" in table and "+0.0200 [" in table  # mean shift .01,.02,.03
    assert "- sigma-M8-s0: missing (not started)" in table
    runs = (tmp_path / "runs.csv").read_text().splitlines()
    assert runs[0].endswith(",ece_severity1,ece_severity2,ece_severity3,ece_severity4,ece_severity5")
    single0 = next(line for line in runs if ",single-1-None-x1-0," in line)
    assert single0.endswith(",0.02,0.04,0.06,0.08,0.1")  # 0.02 × severity
    with pytest.raises(CompareError, match="--reference 'deep': no finished runs of that method; methods here: "
                                           "sigma, single"):
        write_report(records, [], tmp_path, "deep")


def test_run_record_reads_what_train_and_eval_log() -> None:
    from types import SimpleNamespace

    from sigmanens_dist.experiments.compare.records import _record

    metrics = {"val/acc": 0.8, "final/params": 1000.0, "final/train_images": 320.0, "final/train_img_per_s": 50.0,
               "eval/test/raw/ood_digits/entropy/auroc": 0.9, "eval/test/raw/ood_digits/msp/auroc": 0.1,
               "eval/test/ema/ood_digits/entropy/auroc": 0.2, "eval/test/raw/shift/blur/s1/ece": 0.1,
               "eval/test/raw/shift/noise/s1/ece": 0.3, "eval/test/raw/shift/noise/s2/ece": 0.5,
               "eval/test/ema/shift/noise/s1/ece": 9.0, "eval/test/raw/k2/ms_per_image": 0.5,
               "eval/test/raw/k4/ms_per_image": 0.9}
    run = SimpleNamespace(info=SimpleNamespace(run_id="r", run_name="deep-M4-s1", status="FINISHED"),
                          data=SimpleNamespace(params={"model.method": "deep", "model.num_members": "4", "seed": "1",
                                                       "reg.tau": "0.5", "reg.lambda": "0.001"},
                                               tags={"num_members": "4", "sigmanens.grid.budget": "2"},
                                               metrics=metrics))
    r = _record(run)
    assert (r.method, r.members, r.tau, r.lam, r.seed, r.budget) == ("deep", 4, None, None, 1, 2)  # no τ, λ
    assert select_split([r], "auto") == "val"  # no test-set evaluation of acc: the validation split
    assert r.values["ood_auroc"] == 0.9 and r.values["train_compute"] == 320 * 4 and r.values["acc"] == 0.8
    assert r.values["ms_per_image"] == 0.9  # the full ensemble's forward time
    metrics["eval/test/raw/acc"] = 0.7
    r = _record(run)
    assert select_split([r], "auto") == "test" and r.values["acc"] == 0.7
    assert r.severity_ece == pytest.approx({1: 0.2, 2: 0.5})  # mean over corruptions, raw weights only


def test_a_methods_own_knobs_away_from_default_make_a_variant_that_compare_keeps_apart() -> None:
    from types import SimpleNamespace

    from sigmanens_dist.experiments.compare import method_variant
    from sigmanens_dist.experiments.compare.records import _record

    def run(name: str, seed: int, acc: float, **params: str) -> RunRecord:
        info = SimpleNamespace(run_id=f"{name}{seed}", run_name=f"{name}-s{seed}", status="FINISHED")
        data = SimpleNamespace(params={"model.method": "packed", "model.num_members": "4", "seed": str(seed),
                                       "model.packed_alpha": "2.0", "model.packed_gamma": "1", **params},
                               tags={}, metrics={"val/acc": acc})
        return _record(SimpleNamespace(info=info, data=data))

    records = [run("a2", s, 0.8) for s in (0, 1)] + [run("a3", s, 0.9, **{"model.packed_alpha": "3.0"}) for s in (0, 1)]
    records += [run("a3g2", 0, 0.7, **{"model.packed_alpha": "3", "model.packed_gamma": "2"})]
    assert [r.variant for r in records] == ["", "", "α=3", "α=3", "α=3 γ=2"]  # defaults (2, 1) are no variant
    select_split(records, "val")
    # one child name in two studies of different variants: both kept, each the newest of its own variant
    from sigmanens_dist.experiments.compare.records import _pick_runs

    def raw(seed: int, alpha: str, start: int) -> SimpleNamespace:
        return SimpleNamespace(info=SimpleNamespace(run_id=f"{alpha}{start}", run_name=f"packed-M4-s{seed}",
                                                    status="FINISHED", start_time=start),
                               data=SimpleNamespace(params={"model.method": "packed", "model.num_members": "4",
                                                            "seed": str(seed), "model.packed_alpha": alpha},
                                                    tags={}, metrics={"val/acc": 0.5}))

    picked, _ = _pick_runs([raw(0, "2", 1), raw(0, "3", 2), raw(0, "2", 3)], None)
    assert sorted((r.variant, r.run_id) for r in picked) == [("", "23"), ("α=3", "32")]
    groups = group_runs(records)
    assert [(g.label(), len(g.runs)) for g in groups] == [("Packed-Ensembles M=4", 2),
                                                         ("Packed-Ensembles (α=3) M=4", 2),
                                                         ("Packed-Ensembles (α=3 γ=2) M=4", 1)]
    assert groups[1].mean("acc") == pytest.approx(0.9)
    # the method as reference: each variant is paired against its defaults (the defaults with themselves: no Δ)
    assert [reference_for(g, groups, "packed") for g in groups] == [groups[0]] * 3
    assert paired_difference(groups[1], groups[0], "acc")[:1] == pytest.approx((0.1,))
    words = {"model.method": "sigma", "model.member_batches": "shared", "optim.sigma_lr_scale": "num_members"}
    assert method_variant("sigma", words) == "batches=shared"  # a word knob; a word default is no variant
    # the affine start: what auto resolves to is no variant (plain from scratch, divide from a source)
    assert method_variant("sigma", {"model.affine_init": "plain"}) == ""
    assert method_variant("sigma", {"model.affine_init": "divide", "model.init_from": "runs/x"}) == ""
    assert method_variant("sigma", {"model.affine_init": "perturb", "model.init_from": "runs/x"}) == "affine=perturb"
    assert method_variant("sigma", {"model.affine_init": "divide"}) == "affine=divide"


@pytest.mark.slow
def test_local_m_scaling_script_runs_the_study_and_compares(tmp_path: Path) -> None:
    """launch/m_scaling_local.sh: slurm/m_scaling.sh's study on this machine, ending in the comparison."""
    base = tmp_path / "base.yaml"
    base.write_text("seed: 0\n")
    env = {**os.environ, "SIGMANENS_CONFIG": str(base), "SIGMANENS_MEMBERS": "1 2", "SIGMANENS_PYTHON": sys.executable,
           "SIGMANENS_STUDY_DIR": str(tmp_path / "ms"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(["bash", str(REPO / "launch" / "m_scaling_local.sh"), *BASE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "ms" / "compare" / "table.md").read_text()
    assert "| sigma | 1 |" in table and "| sigma | 2 |" in table, table


def test_tau_sweep_refuses_lambda_zero_and_brings_its_strength(tmp_path: Path) -> None:
    """λ = 0 turns L_div off, so a τ sweep at λ = 0 would train the same model at every τ: refused, naming the fix;
    without --lambdas a τ sweep of a recipe with λ = 0 uses the documented strength."""
    with pytest.raises(StudyError, match=r"--taus 0\.1,1\.0 with λ = 0: L_div is off, so τ changes nothing .*"
                                         r"give --lambdas 0\.01"):
        build_definition("tau-sweep", None, {"taus": [0.1, 1.0], "lambdas": [0.0], "seeds": [0]}, BASE,
                         tmp_path / "a")
    definition = build_definition("tau-sweep", None, {"taus": [0.1, 1.0], "seeds": [0]}, [*BASE, "reg.lambda=0"],
                                  tmp_path / "b")
    assert definition.axes["lambdas"] == [0.01]
    assert [c.name for c in definition.children] == ["sigma-M4-tau0.1-lam0.01-s0", "sigma-M4-tau1-lam0.01-s0"]
    # a λ sweep keeps its unregularised reference point
    no_lambda = [o for o in BASE if not o.startswith("reg.lambda=")]
    lam = build_definition("lambda-sweep", None, {"lambdas": [0.0, 0.01], "seeds": [0]}, no_lambda, tmp_path / "c")
    assert len(lam.children) == 2


def test_frontier_and_sharing_plots_from_a_tau_sweep(tmp_path: Path) -> None:
    """acc_vs_ece.png draws the frontier in both panels (clean and under shift); sharing_vs_step.png shows every τ's
    importance trajectory; the ECE and NLL under shift are columns with paired differences."""
    from sigmanens_dist.experiments.compare.plots import _frontier

    assert _frontier([(0.1, 0.8), (0.05, 0.7), (0.2, 0.9), (0.15, 0.75)]) == [(0.05, 0.7), (0.1, 0.8), (0.2, 0.9)]
    records = []
    for seed in (0, 1):
        single = run_record("single", 1, None, seed, 0.8)
        single.values.update({"ece": 0.03, "ece_shift": 0.3, "nll_shift": 2.0})
        records.append(single)
        for tau, on in ((0.1, 1.1), (1.0, 3.9)):
            r = run_record("sigma", 4, tau, seed, 0.78 + tau / 10)
            r.values.update({"ece": 0.02 + tau / 100, "ece_shift": 0.2 + tau / 10, "nll_shift": 1.5, "sharing": on})
            r.sharing_history = {step: (on, [0.5, *[0.0] * 8, 0.5]) for step in (100, 200, 300)}
            records.append(r)
    files = {p.name for p in write_report(records, [], tmp_path, None)}
    assert {"acc_vs_ece.png", "sharing_vs_step.png"} <= files
    assert (tmp_path / "sharing_vs_step.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    assert "ECE shift s3,s5" in table and "Δece_shift vs single [95% CI]" in table
    assert "Δnll_shift vs single [95% CI]" in table


def test_run_record_reads_shift_scores_and_history() -> None:
    from types import SimpleNamespace

    from sigmanens_dist.experiments.compare.records import _record as record_of

    metrics = {"val/acc": 0.8, "eval/test/raw/shift/noise/s3/ece": 0.2, "eval/test/raw/shift/noise/s5/ece": 0.4,
               "eval/test/raw/shift/blur/s3/ece": 0.4, "eval/test/raw/shift/blur/s5/ece": 0.6,
               "eval/test/raw/shift/noise/s3/nll": 1.0, "eval/test/raw/shift/noise/s5/nll": 3.0}
    run = SimpleNamespace(info=SimpleNamespace(run_id="r", run_name="sigma-M4-s0", status="FINISHED"),
                          data=SimpleNamespace(params={"model.method": "sigma", "model.num_members": "4", "seed": "0",
                                                       "reg.tau": "0.5", "reg.lambda": "0.01"}, tags={},
                                               metrics=metrics))
    r = record_of(run)
    assert r.values["ece_shift"] == pytest.approx(0.4)  # mean over corruptions, then over severities 3 and 5
    assert r.values["nll_shift"] == pytest.approx(2.0)
    assert r.severity_nll == pytest.approx({3: 1.0, 5: 3.0})


def test_ui_hint_opens_the_runs_view() -> None:
    """MLflow 3 opens a fresh browser in its GenAI overview; the printed link goes to the experiment's runs."""
    from sigmanens_dist.training.tracking import ui_hint

    assert ui_hint("http://h:5055/", "7") == "MLflow UI: http://h:5055/#/experiments/7/runs?workflowType=machine_learning"
    assert ui_hint("sqlite:///r/mlflow.db", "3") == ("MLflow UI: mlflow ui --backend-store-uri sqlite:///r/mlflow.db  "
                                                     "then open http://127.0.0.1:5000/#/experiments/3/runs?"
                                                     "workflowType=machine_learning")


def test_histories_keep_the_newest_value_of_a_step_logged_twice() -> None:
    """After a crash and resume MLflow holds the re-trained steps twice (it only appends): compare's readers keep
    the newest value per step."""
    from types import SimpleNamespace

    from sigmanens_dist.experiments.compare.records import _sharing_history
    from sigmanens_dist.methods.sigma import IMPORTANCE_BINS

    def metric(step: int, value: float, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(step=step, value=value, timestamp=timestamp)

    class Client:
        def get_metric_history(self, run_id: str, key: str) -> list[SimpleNamespace]:
            # step 250 logged by the crashed attempt (t=2) and again after the resume (t=5); listed out of order
            return [metric(500, 3.0, 6), metric(250, 3.5, 2), metric(0, 4.0, 1), metric(250, 2.5, 5)]

    history = _sharing_history(Client(), "r")
    assert sorted(history) == [0, 250, 500]
    assert history[250] == (2.5, [2.5] * IMPORTANCE_BINS)


def test_records_files_compare_like_the_store_they_came_from(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A store that is not kept (a machine that is gone) loses nothing compare needs: the records file written beside
    every table gives the same table, split by split, alone or merged with another study's."""
    def runs(method: str, m: int, tau: float | None, seeds: range) -> list[RunRecord]:
        made = []
        for seed in seeds:
            r = run_record(method, m, tau, seed, 0.0)
            r.values = {"params": 1e5 * m, "train_compute": 1e3 * m, "ood_auroc": 0.9 + seed / 100}
            r.split_values = {"val": {"acc": 0.8 + m / 100 + seed / 50, "nll": 0.5 - m / 100 + seed / 90},
                              "test": {"acc": 0.7 + m / 100 - seed / 70, "nll": 0.6 - m / 100 + seed / 40}}
            r.severity_ece, r.severity_nll = {3: 0.1 * m + seed, 5: 0.2 * m}, {3: 1.0 + seed, 5: 2.0}
            if tau is not None:
                r.sharing_history = {250: (1.5, [0.5, 0.5]), 500: (1.25 + seed, [0.25, 0.75])}
            made.append(r)
        return made

    single, sigma = runs("single", 1, None, range(3)), runs("sigma", 4, 0.5, range(3))
    write_report(single, [], tmp_path / "a", None)
    write_report(sigma, [], tmp_path / "b", None)
    for split in ("val", "test"):
        expected = tmp_path / f"store-{split}"
        write_report(runs("single", 1, None, range(3)) + runs("sigma", 4, 0.5, range(3)), [], expected, None,
                     split=split)
        out = tmp_path / f"records-{split}"
        assert compare_main(["--records", str(tmp_path / "a/records.jsonl"), str(tmp_path / "b/records.jsonl"),
                             "--split", split, "--out", str(out)]) == 0
        for name in ("table.md", "table.csv", "runs.csv", "records.jsonl"):
            assert (out / name).read_text() == (expected / name).read_text(), name
    printed = capsys.readouterr().out
    assert "Scores on the validation split" in printed and "Scores on the test set" in printed
    assert "the runs for --records: records.jsonl" in printed

    # the same grid point and seed in a later file: that run counts, and the table says so
    newer = runs("sigma", 4, 0.5, range(1))
    newer[0].run_id, newer[0].split_values["val"]["acc"] = "newer", 0.99
    write_report(newer, [], tmp_path / "c", None)
    records, notes = read_records([tmp_path / "b/records.jsonl", tmp_path / "c/records.jsonl"])
    assert next(r for r in records if r.seed == 0).run_id == "newer"
    assert notes == ["sigma-4-0.5-x1-0: replaced by the newer run sigma-4-0.5-x1-0 of the same grid point and seed"]

    (tmp_path / "bad.jsonl").write_text('{"run_id": "x"}\n')
    for argv, message in ((["--records", str(tmp_path / "nope.jsonl")], "nope.jsonl: cannot read it"),
                          (["--records", str(tmp_path / "bad.jsonl")], "bad.jsonl, line 1: not a run record")):
        assert compare_main([*argv, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err


# -- the definition record ------------------------------------------------------------------------------------------


def test_a_version_1_definition_still_loads_and_drives_its_children(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The study.yaml of 0.3.0 (no version key) reads as version 1 and gives each child the trainer arguments it
    gave then; rewritten by this code it says version 1 and reads back equal."""
    definition = read_definition(STUDY_V1 / "study.yaml")
    assert definition.version == 1 and definition.kind == "methods" and definition.global_batch == 32
    assert [c.name for c in definition.children] == ["sigma-M2-tau0.5-lam0.01-s0", "single-s0"]
    assert study_main(["run-one", "--definition", str(STUDY_V1 / "study.yaml"), "--index", "1", "--print-args"]) == 0
    assert capsys.readouterr().out.split() == [
        "--config", str(STUDY_V1 / "base_config.yaml"), "tracking.enabled=false", "train.max_steps=20",
        "model.method=single", "seed=0", "run_dir=/tmp/sigmanens-study-v1/single-s0", "tracking.run_name=single-s0",
        "checkpoint.resume=auto"]
    save_definition(tmp_path / "study.yaml", definition)
    assert yaml.safe_load((tmp_path / "study.yaml").read_text())["version"] == 1
    assert read_definition(tmp_path / "study.yaml") == definition


@pytest.mark.parametrize(("edit", "match"), [
    ({"version": 2}, r"a study definition of version 2, written by a later sigmanens-dist; this one reads versions "
                     r"1 to 1: upgrade it"),
    ({"nproc": "two"}, r"is not a study definition of version 1 \(nproc: Input should be a valid integer"),
    ({"surprise": 1}, r"is not a study definition of version 1 \(surprise: Extra inputs are not permitted"),
])
def test_a_definition_of_a_later_version_or_a_broken_one_is_one_line(tmp_path: Path, edit: dict[str, Any],
                                                                      match: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    raw = yaml.safe_load((STUDY_V1 / "study.yaml").read_text())
    (tmp_path / "study.yaml").write_text(yaml.safe_dump({**raw, **edit}))
    for argv in (["resume", str(tmp_path)], ["run-one", "--definition", str(tmp_path / "study.yaml"), "--index", "0"]):
        assert study_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(match, err[0]), err


def test_compare_takes_the_children_a_version_1_definition_names_and_refuses_a_later_one(tmp_path: Path) -> None:
    """Issue 54: ``compare --parent`` reads the study definition logged to the parent run: 0.3.0's (version 1)
    names its children, so the one without a finished run is noted missing; one of a later version is one line,
    not a comparison that silently expects no child."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("v1", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(experiment, tags={ROLE_TAG: "parent"}).info.run_id
    client.log_artifact(parent, str(STUDY_V1 / "study.yaml"))
    with pytest.raises(CompareError, match=r"no finished runs to compare yet:\nsigma-M2-tau0.5-lam0.01-s0: missing "
                                           r"\(not started\)\nsingle-s0: missing \(not started\)"):
        load_runs(uri, parent=parent)  # the two children it names, neither run yet
    later = client.create_run(experiment, tags={ROLE_TAG: "parent"}).info.run_id
    raw = yaml.safe_load((STUDY_V1 / "study.yaml").read_text())
    (tmp_path / "later").mkdir()
    (tmp_path / "later" / "study.yaml").write_text(yaml.safe_dump({**raw, "version": 2}))
    client.log_artifact(later, str(tmp_path / "later" / "study.yaml"))
    with pytest.raises(UsageError, match=rf"the study.yaml logged to run {later}: a study definition of version 2, "
                                         r"written by a later sigmanens-dist"):
        load_runs(uri, parent=later)
    bare = client.create_run(experiment).info.run_id  # a parent run sigmanens study did not make
    with pytest.raises(CompareError, match=f"--parent {bare}: the run has no child runs"):
        load_runs(uri, parent=bare)
