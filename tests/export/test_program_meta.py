"""A program's metadata as one typed, versioned record (sigmanens_dist/program_meta.py): what the exporter writes
reads back as the same record; every program this project wrote in format version 1 reads, the oldest layout with
the defaults it implied; a later version, another file's metadata, a missing output or input shape are refused in
one line saying what."""

from __future__ import annotations

import json

import pytest

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
