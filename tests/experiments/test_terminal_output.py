"""What ``sigmanens compare`` and ``sigmanens eval`` print (issue 29 item 3): tables a person reads in a terminal of
100 columns, while the files keep every column. The compare store is built with MLflow's client, as the trainer and
``sigmanens eval`` log it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from scipy import stats

from sigmanens_dist.catalog.corruption_table import CORRUPTIONS
from sigmanens_dist.cli.compare import main as compare_main
from sigmanens_dist.evaluation.summary import summary
from sigmanens_dist.experiments import terminal
from sigmanens_dist.experiments.compare import build_report
from sigmanens_dist.methods import METHODS
from sigmanens_dist.training.tracking import PARENT_TAG
from tests.helpers import run_record

mlflow = pytest.importorskip("mlflow")

ACC = {"single": [0.80, 0.82, 0.81], "sigma": [0.85, 0.88, 0.90], "deep": [0.86, 0.87, 0.88]}
MEMBERS = {"single": 1, "sigma": 4, "deep": 4}


def _study(tmp_path: Path) -> tuple[str, str]:
    """A parent run and its nine children (three methods × three seeds), finished, with what compare reads."""
    tmp_path.mkdir(parents=True)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("terminal", artifact_location=(tmp_path / "mlartifacts").as_uri())
    parent = client.create_run(exp, run_name="study").info.run_id
    for method, accs in ACC.items():
        m = MEMBERS[method]
        for seed, acc in enumerate(accs):
            name = f"{method}-M{m}-s{seed}"
            run = client.create_run(exp, run_name=name, tags={PARENT_TAG: parent, "sigmanens.method": method,
                                                              "num_members": str(m)}).info.run_id
            params = {"model.method": method, "model.num_members": str(m), "seed": str(seed)}
            params |= {"reg.tau": "0.5", "reg.lambda": "0.001"} if method == "sigma" else {}
            for key, value in params.items():
                client.log_param(run, key, value)
            metrics = {"eval/test/raw/acc": acc, "eval/test/raw/nll": 0.6 - acc / 2, "eval/test/raw/ece": 0.03,
                       "eval/test/raw/brier": 0.3 - acc / 4, "eval/test/raw/disagreement": 0.05 * (m > 1),
                       "eval/test/raw/ood_digits/entropy/auroc": 0.7 + acc / 10,
                       "final/params": {"single": 373_370.0, "sigma": 384_570.0, "deep": 1_493_480.0}[method],
                       "final/train_images": 25_600.0, "final/train_img_per_s": 3000.0 / m,
                       "eval/test/raw/k1/ms_per_image": 0.1 * m}
            for key, value in metrics.items():
                client.log_metric(run, key, value)
            client.set_terminated(run)
    client.set_terminated(parent)
    return uri, parent


def test_three_methods_print_within_100_columns_with_the_paired_difference(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    uri, parent = _study(tmp_path / "runs" / "study")
    monkeypatch.chdir(tmp_path)  # the study below the working directory, as `sigmanens study` puts it (runs/…)
    out = tmp_path / "runs" / "compare"
    assert compare_main(["--parent", parent, "--uri", uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.txt").write_text(printed)
    lines = printed.splitlines()
    assert max(len(line) for line in lines) <= terminal.WIDTH, "\n".join(x for x in lines if len(x) > 100)
    # metrics as rows, the methods as columns under the names people know
    header = next(line for line in lines if "Deep Ensemble" in line)
    assert "single model" in header and "σN-Ens" in header and "Deep Ensemble" in header and "sigma" not in header
    # the paired difference of σN-Ens against the single model with the half width of its 95% t interval
    d = [s - r for s, r in zip(ACC["sigma"], ACC["single"], strict=True)]
    mean, sd = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    acc_rows = lines[next(i for i, line in enumerate(lines) if line.strip().startswith("accuracy")):][:2]
    assert acc_rows[1].strip().startswith("Δ ± 95% CI") and f"{mean:+.4f} ± {half:.4f}" in acc_rows[1]
    assert re.search(r"—", acc_rows[1])  # the reference's own column
    # the seed caveat once; counts in human units; the warning on choosing by test scores kept
    assert printed.count("mean ± std over 3 seeds") == 1 and "(1 seed)" not in printed
    assert "373k" in printed and "385k (1.03×)" in printed and "1.49M (4×)" in printed and "25.6k" in printed
    assert "e+0" not in printed
    assert "Selection on the test set" in printed
    # where the files are, and the MLflow UI's runs view
    assert "in runs/compare/: table.md, table.csv, runs.csv" in printed.replace("\n  ", " ")
    assert re.search(r"#/experiments/\d+/runs\?workflowType=machine_learning", printed)
    # the files keep every column, as before
    table = (out / "table.md").read_text()
    head = table.splitlines()[0]
    for column in ("params", "train compute (img×M)", "inference ms/img", "acc", "NLL", "ECE", "Brier", "OOD AUROC",
                   "disagreement", "Δacc vs single [95% CI]", "Δood_auroc vs single [95% CI]"):
        assert f"| {column} |" in head, column
    assert f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]" in table
    assert "**Selection on the test set:** this table compares 3 configurations" in table
    csv_head = (out / "table.csv").read_text().splitlines()[0]
    assert "diff_acc_vs_single_mean" in csv_head and "train_compute_mean" in csv_head


def test_many_configurations_print_the_headline_scores_within_100_columns() -> None:
    records = []
    for seed in range(3):
        for method, m, tau in (("single", 1, None), ("sigma", 4, 0.25), ("sigma", 16, 0.25), ("deep", 4, None),
                               ("packed", 4, None), ("batch", 4, None)):
            r = run_record(method, m, tau, seed, 0.8 + 0.01 * seed)
            r.values.update({"nll": 0.5, "ece": 0.03, "params": 1e6 * m})
            records.append(r)
    text = terminal.render(build_report(records, None), [])
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= terminal.WIDTH
    assert "6 configurations" in text and "table.md" in text
    header = next(line for line in lines if line.startswith("configuration"))
    assert "Δ NLL" in header and "parameters" not in text  # the rest is in the files
    assert sum(line.startswith(("σN-Ens", "single model", "Deep Ensemble", "Packed", "BatchEnsemble"))
               for line in lines) == 6


def test_every_method_has_a_display_name_and_counts_read_in_units() -> None:
    assert all(spec.display for spec in METHODS.values())
    assert terminal.display_name("sigma") == "σN-Ens" and terminal.display_name("newmethod") == "newmethod"
    assert [terminal.human(x) for x in (384_000, 25_600, 1_493_480, 999.6, 950, 0.5, 2.4e9)] == [
        "384k", "25.6k", "1.49M", "1k", "950", "0.5", "2.4G"]


def test_one_seed_is_said_once_and_not_in_every_cell() -> None:
    records = [run_record(method, m, tau, 0, acc) for method, m, tau, acc in
               (("single", 1, None, 0.8), ("sigma", 4, 0.5, 0.83), ("deep", 4, None, 0.84))]
    text = terminal.render(build_report(records, None), [])
    assert text.count("one seed") == 1 and "(1 seed)" not in text and "95% CI" not in text
    assert "+0.0300" in text and "+0.0400" in text


def test_eval_summary_of_16_members_and_every_corruption_fits_100_columns() -> None:
    """eval.md's shift table (acc / NLL / ECE per severity and corruption) is 150+ columns: the terminal shows the
    mean over corruptions per severity, and every other table as in the file."""
    members = 16
    scores = {"acc": 0.9, "nll": 0.3, "ece": 0.02, "aece": 0.03, "brier": 0.15, "aurc": 0.01}
    metrics = {"num_samples": 10000.0, "disagreement": 0.05, "mutual_information": 0.01, "entropy": 0.4, **scores}
    metrics |= {f"{p}{k}": v for p in [*(f"member{i}/" for i in range(members)), "member_mean/"]
                for k, v in scores.items()}
    shift = {name: {str(s): {"acc": 0.5, "nll": 1.5, "ece": 0.1} for s in range(1, 6)} for name in (*CORRUPTIONS,
                                                                                                     "mean")}
    ood = {"set": "svhn", "num_out": 26032, "num_in": 10000,
           **{s: {"auroc": 0.9, "aupr_in": 0.8, "aupr_out": 0.95, "fpr95": 0.3} for s in ("msp", "entropy",
                                                                                          "mutual_information")}}
    part = {"metrics": metrics, "sub_ensembles": [{"k": k, **scores, "ms_per_image": 0.123} for k in range(1, 17)],
            "shift": shift, "ood": ood, "sharing": {"all": 3.2}}
    report = {"checkpoint": "/scratch/a/rather/long/path/to/runs/cifar100_wrn-123456/checkpoints/best.pt",
              "step": 39000, "method": "sigma", "dataset": "cifar100", "split": "test", "members": members,
              "num_members": members, "notes": ["a note " * 30], "weights": {"raw": part, "ema": part}}
    text = summary(report)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= terminal.WIDTH, "\n".join(x for x in lines if len(x) > 100)
    assert "σN-Ens, 16 of 16 members, cifar100 test split" in " ".join(lines)
    assert sum(line.startswith("member ") for line in lines) == 2 * members  # raw and EMA
    assert f"mean over {len(CORRUPTIONS)} corruption(s)" in text and "jpeg_compression" not in text
    assert "0.9000" in text and "26032 OOD vs 10000 in-distribution" in text
