"""The ``sigmanens`` entry point."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sigmanens_dist.cli import main
from tests.helpers import REPO, needs_fashion_mnist

# the smallest conversion: 20 Fashion-MNIST training images (4 carved for val) and 8 test images, about a second
CONVERT = ["data", "convert", "--dataset", "fashion_mnist", "--format", "webdataset", "--train-subset", "20",
           "--test-subset", "8", "--val-split", "4", "--num-workers", "1"]


def test_help_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert "sigmanens train" in capsys.readouterr().out
    assert main(["fly"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'fly'; choose one of: train, demo, params, data, eval, export, study, compare" in err


def test_params_prints_ratio_per_member_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["params", "resnet18", "--members", "1", "4"]) == 0
    out = capsys.readouterr().out
    assert "resnet18: 11,689,512 parameters" in out
    assert "σN-Ens M=4       11,737,512  = 1.0041x" in out  # + M·3·4800 σ values − 9600 source norm params


def test_demo_refuses_a_process_count_that_does_not_split_the_batch(tmp_path, capsys: pytest.CaptureFixture[str]
                                                                   ) -> None:
    assert main(["demo", "--nproc", "3", "--out", str(tmp_path / "demo")]) == 2
    assert "--nproc 3 must be ≥ 1 and divide the recipe's batch of 32" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # refused before the study wrote anything


def test_demo_refuses_a_bad_override_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--out", str(tmp_path / "demo"), "model.num_members=0"]) == 2
    # the refusal's one line, then the config's one problem on its own line (ConfigError's layout), nothing else
    assert capsys.readouterr().err.splitlines() == [
        f"error: {REPO / 'configs' / 'fmnist_small.yaml'}: 1 problem in the config:",
        "  - model.num_members: must be >= 1 (got 0)"]
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--dataset", "cifar10", "--root", "/nonexistent"], "data.root: /nonexistent does not exist"),
    (["--dataset", "fashion_mnist", "--train-subset", "100", "--val-split", "100"],
     "data.val_split=100 takes 100 of the 100 training samples"),
])
def test_data_convert_mistakes_are_one_line_and_exit_2(tmp_path, capsys: pytest.CaptureFixture[str], args: list[str],
                                                        message: str) -> None:
    assert main(["data", "convert", "--format", "webdataset", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sigmanens data convert: error: ") and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "classes.json").exists()


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _convert_error(capsys: pytest.CaptureFixture[str], out: Path, *args: str) -> str:
    capsys.readouterr()  # progress bars of earlier conversions
    assert main([*CONVERT, "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.removeprefix("sigmanens data convert: error: ").strip()


@needs_fashion_mnist
def test_data_convert_refuses_a_finished_conversion_unless_forced(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Converting again into a finished conversion with other options had deleted its shards and replaced its
    ``classes.json``."""
    out = tmp_path / "out"
    assert main([*CONVERT, "--out", str(out), "--max-count", "8"]) == 0
    before = _files(out)
    assert _convert_error(capsys, out, "--max-count", "4") == (
        f"--out {out} holds a finished conversion (classes.json); choose another --out, or pass --force to convert "
        f"over it")
    assert _files(out) == before
    assert main([*CONVERT, "--out", str(out), "--max-count", "4", "--force"]) == 0  # as before: converted again
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert [s["count"] for s in manifest["shards"]] == [4, 4, 4, 4]


@needs_fashion_mnist
def test_data_convert_refuses_a_folder_of_other_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    (out / "train").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "train" / "labels.csv").write_text("mine too")
    assert _convert_error(capsys, out) == (
        f"--out {out} is not empty and not an unfinished webdataset conversion: it holds notes.txt, train/labels.csv; "
        f"choose another --out, or pass --force to convert into it anyway")
    assert sorted(p.name for p in out.rglob("*")) == ["labels.csv", "notes.txt", "train"]
    assert main([*CONVERT, "--out", str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "classes.json").is_file()
    file = tmp_path / "file"
    file.write_text("")
    assert _convert_error(capsys, file, "--force") == f"--out {file} is a file, not a folder"


@needs_fashion_mnist
@pytest.mark.parametrize("content", ["{not json", '{"shards": "all"}', "[]"])
def test_data_convert_names_a_manifest_it_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        content: str) -> None:
    """A ``manifest.json`` that is not JSON had been a traceback (JSONDecodeError), one of another shape a KeyError."""
    manifest = tmp_path / "out" / "train" / "manifest.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(content)
    for force in ([], ["--force"]):  # refused up front, or by the writer when forced
        assert _convert_error(capsys, tmp_path / "out", *force).startswith(f"{manifest}: not ")
    assert manifest.read_text() == content


@needs_fashion_mnist
def test_data_convert_resumes_its_own_unfinished_conversion(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([*CONVERT, "--out", str(out), "--max-count", "8"]) == 0
    # as if killed while writing val: classes.json (written last) and val not there yet, a temporary file left over
    (out / "classes.json").unlink()
    shutil.rmtree(out / "val")
    (out / ".classes.json.k1ll3d.tmp").write_text("{")
    train = {p: p.stat().st_mtime_ns for p in (out / "train").iterdir()}
    assert main([*CONVERT, "--out", str(out), "--max-count", "8"]) == 0
    assert {p: p.stat().st_mtime_ns for p in train} == train  # train kept as written, not converted again
    assert (out / "val" / "manifest.json").is_file() and (out / "classes.json").is_file()
