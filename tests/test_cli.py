"""The ``sigmanens`` entry point."""

from __future__ import annotations

import pytest

from sigmanens_dist.cli import main


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
