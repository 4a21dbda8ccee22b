"""A program's metadata as one typed, versioned record (sigmanens_dist/program_meta.py): what the exporter writes
reads back as the same record; every program this project wrote in format version 1 reads, the oldest layout with
the defaults it implied; a later version, another file's metadata, a missing output or input shape are refused in
one line saying what."""

from __future__ import annotations

import json
import math

import pytest

from sigmanens_dist import program_meta
from sigmanens_dist.program_meta import (
    CONFORMAL_OUTPUT,
    OUTPUTS,
    ConformalFit,
    LaterFormatError,
    Normalisation,
    NormStats,
    ProgramInput,
    ProgramMeta,
    ProgramMetaError,
)

META = ProgramMeta(
    num_classes=3, input=ProgramInput(shape=["B", 1, 8, 8], channels=1, size=8),
    normalisation=Normalisation([0.5], [0.25]), members=[0, 2], trained_members=4, method="sigma", tau=0.1,
    run_id="abc", step=7, dataset="fashion_mnist",
    package_version="0.3.0", calibration="temperature", temperature=1.3, outputs=[*OUTPUTS, CONFORMAL_OUTPUT],
    program_format="onnx", class_names=["a", "b", "c"], weights="ema", norm_stats=NormStats("batch", 2.0),
    fitted_on="val", num_fit=16, val_nll_before=0.9, val_nll_after=0.8,
    conformal=ConformalFit(alpha=0.1, score="aps", qhat=None, fitted_on="val", num_calibration=16, val_coverage=1.0,
                           val_set_size=3.0, qhat_fitted=None))

# the metadata of the first programs (sigmanens-program/1 as first written): no program format, class names, input
# name, weights or BatchNorm statistics yet
FIRST = {"format": "sigmanens-program/1", "num_classes": 10,
         "input": {"shape": ["B", 3, 32, 32], "dtype": "float32", "range": [0.0, 1.0]},
         "normalisation": {"mean": [0.5] * 3, "std": [0.25] * 3}, "members": [0, 1], "trained_members": 2,
         "method": "sigma", "tau": None, "run_id": None, "step": 100, "dataset": "cifar10",
         "package_version": "0.1.0", "calibration": "none", "temperature": 1.0, "outputs": list(OUTPUTS)}


def test_what_is_written_reads_back_as_the_same_record() -> None:
    text = META.to_json()
    assert ProgramMeta.from_json(text) == META
    written = json.loads(text)
    assert written["format"] == "sigmanens-program/1" and written["norm_stats"] == {"mode": "batch", "prior": 2.0}
    assert written["conformal"]["qhat"] is None and written["fitted_on"] == "val"
    plain = ProgramMeta.from_json(json.dumps(FIRST))
    assert "fitted_on" not in plain.to_dict() and "conformal" not in plain.to_dict()  # written only when fitted


def test_the_first_layout_reads_with_the_defaults_it_implied() -> None:
    meta = ProgramMeta.from_json(json.dumps(FIRST))
    assert (meta.program_format, meta.weights, meta.norm_stats, meta.class_names) == ("torch", "raw", NormStats(), None)
    assert (meta.input.name, meta.input.chw, meta.input.channels, meta.input.size) == ("images", (3, 32, 32), 3, 32)


@pytest.mark.parametrize(("change", "message"), [
    ({"format": "sigmanens-program/99"}, "its sigmanens.json says format sigmanens-program/99, written by a later "
                                         "sigmanens; this one reads sigmanens-program/1 to sigmanens-program/1"),
    ({"format": "sigmanens-program/0"}, "not a sigmanens program: its sigmanens.json lacks format"),
    ({"format": None}, "not a sigmanens program: its sigmanens.json lacks format"),
    ({"outputs": list(OUTPUTS[:-1])}, "not a sigmanens program: its sigmanens.json lacks disagreement"),
    ({"input": {"dtype": "float32"}}, "not a sigmanens program: its sigmanens.json lacks input.shape"),
    ({"input": {"shape": ["B", 0, 8, 8]}}, "not a sigmanens program: its sigmanens.json lacks input.shape"),
    ({"input": {"shape": ["B", 1, 0, 8]}}, "not a sigmanens program: its sigmanens.json lacks input.shape"),
    ({"input": {"shape": ["B", 1, 8, 0]}}, "not a sigmanens program: its sigmanens.json lacks input.shape"),
    ({"input": {"shape": ["B", 1, 8, 8], "channels": "one"}},
     "not a sigmanens program: its sigmanens.json holds a value of another type"),
    ({"input": {"shape": ["B", 1, 8, 8], "size": "eight"}},
     "not a sigmanens program: its sigmanens.json holds a value of another type"),
    ({"step": None}, "not a sigmanens program: its sigmanens.json holds a value of another type"),
])
def test_other_metadata_is_refused_saying_why(change: dict, message: str) -> None:
    raw = {key: value for key, value in (FIRST | change).items() if value is not None or key == "step"}
    with pytest.raises(ProgramMetaError) as caught:
        ProgramMeta.from_json(json.dumps(raw))
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert isinstance(caught.value, LaterFormatError) == ("99" in message)


@pytest.mark.parametrize("text", [None, "", "{not json", "[1, 2]"])
def test_a_file_without_metadata_is_not_a_program(text: str | None) -> None:
    with pytest.raises(ProgramMetaError, match="not a sigmanens program"):
        ProgramMeta.from_json(text)


def test_an_old_program_lacking_the_input_details_reads_with_the_defaults_of_version_1() -> None:
    """The oldest programs may record only ``input.shape`` and no calibration: the reader fills what version 1
    implied (channels and size from the shape, "images", float32 in [0, 1], no crop ratio, no calibration)."""
    raw = {key: value for key, value in FIRST.items() if key != "calibration"} | {"input": {"shape": ["B", 3, 32, 32]}}
    meta = ProgramMeta.from_dict(raw)
    assert meta.input == ProgramInput(shape=["B", 3, 32, 32], channels=3, size=32, name="images", dtype="float32",
                                      range=(0.0, 1.0), crop_ratio=None)
    assert (meta.calibration, meta.format_version) == ("none", 1)


def test_every_input_detail_a_program_records_is_read_as_written() -> None:
    """A program's own input name, dtype, range and crop ratio are read, not replaced by the defaults."""
    given = {"name": "pixels", "shape": ["B", 1, 28, 28], "channels": 1, "size": 28, "dtype": "float16",
             "range": [-1, 1], "crop_ratio": 0.875}
    meta = ProgramMeta.from_dict(FIRST | {"input": given})
    assert meta.input == ProgramInput(shape=["B", 1, 28, 28], channels=1, size=28, name="pixels", dtype="float16",
                                      range=(-1.0, 1.0), crop_ratio=0.875)


@pytest.mark.parametrize("crop", [1, 1.0, 0.875, 0.01])
def test_a_crop_ratio_in_the_half_open_unit_interval_is_read(crop: float) -> None:
    """Every crop ratio in (0, 1], 1 (the whole shorter side) included, is accepted and kept."""
    meta = ProgramMeta.from_dict(FIRST | {"input": FIRST["input"] | {"crop_ratio": crop}})
    assert meta.input.crop_ratio == crop


def test_the_record_keeps_the_version_its_metadata_was_written_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's ``format_version`` is the metadata's, not this code's default: with the reader raised to
    version 2, a version-2 program reads as version 2 and writes back as version 2."""
    monkeypatch.setattr(program_meta, "FORMAT_VERSION", 2)
    meta = ProgramMeta.from_dict(FIRST | {"format": "sigmanens-program/2"})
    assert meta.format_version == 2 and json.loads(meta.to_json())["format"] == "sigmanens-program/2"


@pytest.mark.parametrize(("change", "holds"), [
    ({"class_names": ["a", "b"]},
     "class_names \"['a', 'b']\": null or a list of num_classes=10 strings is allowed"),
    ({"class_names": "abcdefghij"}, "class_names 'abcdefghij': null or a list of num_classes=10 strings is allowed"),
    ({"class_names": list(range(10))},
     "class_names '[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]': null or a list of num_classes=10 strings is allowed"),
    ({"input": FIRST["input"] | {"crop_ratio": 0}}, "input.crop_ratio 0: null or a number in (0, 1] is allowed"),
    ({"input": FIRST["input"] | {"crop_ratio": -0.5}}, "input.crop_ratio -0.5: null or a number in (0, 1] is allowed"),
    ({"input": FIRST["input"] | {"crop_ratio": 1.5}}, "input.crop_ratio 1.5: null or a number in (0, 1] is allowed"),
    ({"input": FIRST["input"] | {"crop_ratio": True}}, "input.crop_ratio True: null or a number in (0, 1] is allowed"),
    ({"input": FIRST["input"] | {"crop_ratio": "x"}}, "input.crop_ratio 'x': null or a number in (0, 1] is allowed"),
    ({"norm_stats": {"mode": "eval"}}, "norm_stats.mode 'eval': one of train, batch is allowed"),
    ({"norm_stats": {"mode": "batch", "prior": math.inf}}, "norm_stats.prior inf: a finite number ≥ 0 is allowed"),
    ({"norm_stats": {"mode": "batch", "prior": -1}}, "norm_stats.prior -1: a finite number ≥ 0 is allowed"),
    ({"norm_stats": {"mode": "batch", "prior": True}}, "norm_stats.prior True: a finite number ≥ 0 is allowed"),
    ({"norm_stats": {"mode": "batch", "prior": "x"}}, "norm_stats.prior 'x': a finite number ≥ 0 is allowed"),
])
def test_a_value_a_reader_would_trip_over_is_refused_naming_it(change: dict, holds: str) -> None:
    """Class names of the wrong length or type, a crop ratio outside (0, 1] or not a number (a bool included), an
    unknown BatchNorm statistics mode, and a prior that is negative, infinite or not a number are each refused on
    read, in one line naming the bad value and what is allowed."""
    with pytest.raises(ProgramMetaError) as caught:
        ProgramMeta.from_dict(FIRST | change)
    assert str(caught.value) == f"not a sigmanens program: its sigmanens.json holds {holds}"
