"""``sigmanens_dist.predict.writer`` unit by unit, without a program or a model: part file names, the ``--out``
checks, claiming an output folder (resume, refusals, what ``--force`` deletes and what it never deletes), the part
files of both formats and the summary, each against manifests, parts and outputs built by hand here.

The end-to-end runs are in test_predict.py; these are fast enough for mutation testing of writer.py."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sigmanens_dist.errors import UsageError
from sigmanens_dist.predict.writer import (
    _own_manifest,
    _rows,
    check_claimable,
    check_out,
    claim,
    part_path,
    read_part,
    summarise,
    write_part,
)

PROGRAM = {"path": "model.pt2", "sha256": "ab" * 32}
UNITS = ("000000-images", "000001-s-0", "000002-s-1")


def _manifest(fmt: str = "parquet", units: tuple[str, ...] = UNITS, **changes: Any) -> dict[str, Any]:
    """A manifest as ``sigmanens predict`` writes it (run.py), with ``changes`` applied."""
    return {"format": "sigmanens-predictions/1", "program": dict(PROGRAM), "inputs": ["photos", "s-0.tar"],
            "inputs_sha256": "cd" * 32, "chunk_size": 2, "output_format": fmt,
            "units": [{"id": u, "images": "ef" * 32} for u in units]} | changes


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _put(root: Path, files: dict[str, bytes | str]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)


def _refused(call: Any, *args: Any) -> str:
    """The message of the UsageError (exactly that type) ``call(*args)`` raises."""
    with pytest.raises(UsageError) as err:
        call(*args)
    assert err.type is UsageError
    return str(err.value)


# part_path


@pytest.mark.parametrize(("unit", "fmt", "name"), [("000000-images", "parquet", "000000-images.parquet"),
                                                   ("000012-s-0.v2", "jsonl", "000012-s-0.v2.jsonl")])
def test_part_path_is_the_unit_id_and_format_under_parts(tmp_path: Path, unit: str, fmt: str, name: str) -> None:
    """A unit's part is ``OUT/parts/<unit id>.<format>``: the name resume and --force look for."""
    assert part_path(tmp_path / "out", unit, fmt) == tmp_path / "out" / "parts" / name


# check_out


@pytest.mark.parametrize("case", ["equal", "equal by another spelling", "equal by a link", "equal to a linked input",
                                  "inside", "deep inside", "inside a linked input", "holds the folder",
                                  "holds the file", "second input"])
def test_check_out_refuses_an_out_overlapping_an_input(tmp_path: Path, case: str) -> None:
    """An --out that is an input, lies inside an input folder or holds an input is refused in one line naming both
    as given (the comparison is of resolved paths), whichever input it overlaps."""
    photos, single = tmp_path / "work" / "photos", tmp_path / "work" / "x.png"
    _put(tmp_path, {"work/photos/a.png": b"png", "work/x.png": b"png", "elsewhere/b.png": b"png"})
    (tmp_path / "link").symlink_to(photos)
    inputs = [photos, single]
    out, path, relation = {
        "equal": (photos, photos, "is"),
        "equal by another spelling": (tmp_path / "elsewhere" / ".." / "work" / "photos", photos, "is"),
        "equal by a link": (tmp_path / "link", photos, "is"),
        "equal to a linked input": (photos, tmp_path / "link", "is"),
        "inside": (photos / "preds", photos, "is inside"),
        "deep inside": (photos / "a" / "b", photos, "is inside"),
        "inside a linked input": (photos / "preds", tmp_path / "link", "is inside"),
        "holds the folder": (tmp_path / "work", photos, "holds"),
        "holds the file": (tmp_path, photos, "holds"),
        "second input": (tmp_path / "work", single, "holds"),
    }[case]
    if case == "second input":
        inputs = [tmp_path / "elsewhere", single]
    elif "linked input" in case:
        inputs = [tmp_path / "elsewhere", tmp_path / "link"]
    assert _refused(check_out, out, inputs) == (
        f"--out {out} {relation} INPUT {path}: predict never writes among its inputs nor reads them from its output "
        "folder; give an --out outside every input")
    assert not (photos / "preds").exists() and not (photos / "a").exists()


@pytest.mark.parametrize("case", ["sibling", "prefix", "new and nested", "under a missing input", "no inputs"])
def test_check_out_accepts_an_out_apart_from_every_input(tmp_path: Path, case: str) -> None:
    """An --out beside the inputs (also one whose name merely starts like an input's, or below a path that is no
    folder yet: a missing input is refused later, by discover) passes and is not created."""
    _put(tmp_path, {"photos/a.png": b"png", "x.png": b"png"})
    inputs = [tmp_path / "photos", tmp_path / "x.png"]
    out = {"sibling": tmp_path / "out", "prefix": tmp_path / "photos2", "new and nested": tmp_path / "a" / "b" / "c",
           "under a missing input": tmp_path / "missing" / "out", "no inputs": tmp_path / "photos"}[case]
    if case == "under a missing input":
        inputs.append(tmp_path / "missing")
    elif case == "no inputs":
        inputs = []
    check_out(out, inputs)
    assert case == "no inputs" or not out.exists()


@pytest.mark.parametrize("case", ["a file", "under a file"])
def test_check_out_refuses_an_out_that_cannot_be_a_folder(tmp_path: Path, case: str) -> None:
    """An --out that is a file or lies under one is one line naming the option, before any overlap check."""
    afile = tmp_path / "afile"
    afile.write_text("a file")
    out = afile if case == "a file" else afile / "p" / "q"
    says = " is a file, not a folder" if case == "a file" else \
        f": a part of this path is a file, not a folder ({afile})"
    assert _refused(check_out, out, [afile]) == f"--out {out}{says}"
    assert afile.read_text() == "a file"


# check_claimable and _own_manifest


@pytest.mark.parametrize("contents", [None, {}, {".lock": "{}"}])
def test_check_claimable_accepts_a_new_or_empty_folder(tmp_path: Path, contents: dict[str, str] | None) -> None:
    """A folder that is not there, is empty or holds only predict's lock file is predict's to claim: no manifest."""
    out = tmp_path / "out"
    if contents is not None:
        out.mkdir()
        _put(out, contents)
    assert check_claimable(out) is None
    assert _own_manifest(out) is None


@pytest.mark.parametrize("contents", [{"notes.md": "mine"}, {".lock": "{}", "notes.md": "mine"},
                                      {"parts/report.txt": "mine"}, {"manifest.json/x": "a folder named so"},
                                      {"summary.json": "{}"}])
def test_check_claimable_refuses_a_folder_of_other_files(tmp_path: Path, contents: dict[str, str]) -> None:
    """A folder holding anything but the lock and no manifest.json (a folder named so is none) is refused, changed in
    nothing, and the refusal does not offer --force."""
    out = tmp_path / "out"
    _put(out, contents)
    before = _files(out)
    assert _refused(check_claimable, out) == (
        f"--out {out} is a folder of other files (no manifest.json of sigmanens predict); give a new or empty folder "
        "(predict, even with --force, never deletes files it did not write)")
    assert _files(out) == before


@pytest.mark.parametrize("manifest", [_manifest(), _manifest("jsonl"),
                                      _manifest(units=("000000-a", "000001-s-0.tar", "123456-my_shard.v2", "999999-.")),
                                      _manifest(units=()), _manifest(extra="kept")])
def test_check_claimable_returns_predicts_own_manifest(tmp_path: Path, manifest: dict[str, Any]) -> None:
    """A manifest.json of predict's (either format, any unit ids that are plain file names) is returned as read,
    whatever else the folder holds."""
    out = tmp_path / "out"
    _put(out, {"manifest.json": json.dumps(manifest), ".lock": "{}", "notes.md": "mine", "summary.json": "{}"})
    assert check_claimable(out) == manifest
    assert _own_manifest(out) == manifest


def _without(key: str) -> dict[str, Any]:
    m = _manifest()
    del m[key]
    return m


FOREIGN = {
    "not json": b"{",
    "not utf-8": b'{"format": "\xff"}',
    "a list": b"[]",
    "a string": b'"sigmanens-predictions/1"',
    "another tool's": b'{"project": "mine"}',
    "a later format": json.dumps(_manifest(format="sigmanens-predictions/2")).encode(),
    "no format": json.dumps(_without("format")).encode(),
    "an unknown output format": json.dumps(_manifest("csv")).encode(),
    "no output format": json.dumps(_without("output_format")).encode(),
    "a program that is a string": json.dumps(_manifest(program="model.pt2")).encode(),
    "a program without sha256": json.dumps(_manifest(program={"path": "model.pt2"})).encode(),
    "a program without path": json.dumps(_manifest(program={"sha256": "ab"})).encode(),
    "no program": json.dumps(_without("program")).encode(),
    "no inputs": json.dumps(_without("inputs")).encode(),
    "no inputs_sha256": json.dumps(_without("inputs_sha256")).encode(),
    "no chunk_size": json.dumps(_without("chunk_size")).encode(),
    "no units": json.dumps(_without("units")).encode(),
    "units a number": json.dumps(_manifest() | {"units": 5}).encode(),
    "a unit a string": json.dumps(_manifest() | {"units": ["000000-images"]}).encode(),
    "a unit without id": json.dumps(_manifest() | {"units": [{"images": "ef"}]}).encode(),
    "an id not a string": json.dumps(_manifest() | {"units": [{"id": 7}]}).encode(),
    **{f"the id {u!r}": json.dumps(_manifest(units=(u,))).encode()
       for u in ("../x", "000000-a/b", "000000-../../etc", "00000-a", "0000000", "000000-", "000000-a b", "a000000-x",
                 "000000-a\n")},
    "one bad id of two": json.dumps(_manifest(units=("000000-a", "000001-a/b"))).encode(),
}


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("case", list(FOREIGN))
def test_a_manifest_not_of_predict_is_refused_and_kept(tmp_path: Path, case: str, force: bool) -> None:
    """A manifest.json that is not predict's (not JSON, another tool's, a field missing, of another type or value,
    a unit id that is a path or not inputs.discover's) is refused by check_claimable and by claim, with --force too,
    and stays as it was."""
    out = tmp_path / "out"
    _put(out, {"manifest.json": FOREIGN[case], "parts/000000-a.parquet": b"theirs"})
    before = _files(out)
    said = (f"--out {out}: its manifest.json is not sigmanens predict's; give another --out (predict, even with "
            "--force, never replaces files it did not write)")
    assert _refused(check_claimable, out) == said
    assert _refused(claim, out, _manifest(), force) == said
    assert _files(out) == before


# claim


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("where", ["new", "nested new", "empty", "only the lock"])
def test_claim_makes_a_new_or_empty_folder_predicts(tmp_path: Path, where: str, fmt: str) -> None:
    """A new (even nested) or empty folder gets the manifest (JSON, indent 1) and an empty parts/; nothing is there
    yet."""
    out = tmp_path / "a" / "b" / "out" if where == "nested new" else tmp_path / "out"
    if where in ("empty", "only the lock"):
        out.mkdir()
    if where == "only the lock":
        _put(out, {".lock": "{}"})
    manifest = _manifest(fmt)
    assert claim(out, manifest, False) == 0
    assert _files(out) == {"manifest.json": json.dumps(manifest, indent=1).encode(),
                           **({".lock": b"{}"} if where == "only the lock" else {})}
    assert (out / "parts").is_dir() and not list((out / "parts").iterdir())


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("done", [0, 1, 3])
def test_claim_resumes_the_same_manifest_counting_its_parts(tmp_path: Path, fmt: str, done: int) -> None:
    """A rerun of the same manifest keeps every file (parts, summary, the user's) and returns how many of its units
    have a part in its format (a part in the other format or of another unit does not count)."""
    out = tmp_path / "out"
    assert claim(out, _manifest(fmt), False) == 0
    other = "jsonl" if fmt == "parquet" else "parquet"
    _put(out, {**{f"parts/{u}.{fmt}": f"part {u}" for u in UNITS[:done]}, f"parts/{UNITS[-1]}.{other}": "other",
               f"parts/000009-x.{fmt}": "stray", "summary.json": "{}", "notes.md": "mine", ".lock": "{}"})
    before = _files(out)
    assert claim(out, _manifest(fmt), False) == done
    assert _files(out) == before


STALE = {"parts/.000000-images.parquet.k3j9x.tmp": "a killed writer's", "parts/.000002-s-1.parquet.a_b.tmp": "too",
         "parts/.000000-images.jsonl.k3j9x.tmp": "another format's", "parts/.000009-x.parquet.k3j9x.tmp": "no unit",
         "parts/.draft.1.tmp": "mine", "parts/000000-images.parquet.k3j9x.tmp": "not hidden",
         ".000000-images.parquet.k3j9x.tmp": "not in parts"}


def test_claim_removes_only_the_temporaries_of_its_parts(tmp_path: Path) -> None:
    """The temporaries a killed writer left of this manifest's parts (``.<part name>.<random>.tmp`` in parts/) are
    removed on resume; every other file, temporary-looking or not, is kept."""
    out = tmp_path / "out"
    claim(out, _manifest(), False)
    _put(out, {**STALE, "parts/000001-s-0.parquet": "done"})
    assert claim(out, _manifest(), False) == 1
    kept = {k: v.encode() for k, v in STALE.items() if k not in ("parts/.000000-images.parquet.k3j9x.tmp",
                                                                  "parts/.000002-s-1.parquet.a_b.tmp")}
    assert _files(out) == {"manifest.json": json.dumps(_manifest(), indent=1).encode(),
                           "parts/000001-s-0.parquet": b"done", **kept}


def test_claim_tolerates_a_temporary_removed_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale temporary that is gone by the time claim removes it (listed twice here) is no error."""
    out = tmp_path / "out"
    claim(out, _manifest(), False)
    _put(out, {"parts/.000000-images.parquet.k3j9x.tmp": "stale"})
    glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern, *a, **k: [*glob(self, pattern, *a, **k)] * 2)
    assert claim(out, _manifest(), False) == 0
    assert not list((out / "parts").iterdir())


DIFFERENCES = [
    ({"program": {"path": "other.pt2", "sha256": "fe" * 32}},
     "another program (model.pt2, sha256 abababababab…; this one is fefefefefefe…)"),
    ({"inputs": ["photos"]}, "other inputs (photos s-0.tar)"),
    ({"inputs_sha256": "00"}, "other inputs (the same paths, but their files or contents changed)"),
    ({"chunk_size": 8}, "--chunk-size 2 (this run: 8)"),
    ({"output_format": "jsonl"}, "--format parquet (this run: jsonl)"),
]


@pytest.mark.parametrize(("change", "why"), DIFFERENCES)
def test_claim_refuses_other_predictions_without_force(tmp_path: Path, change: dict[str, Any], why: str) -> None:
    """A folder of another run's predictions is refused without --force, naming what differs and offering --force;
    nothing in it changes (its manifest, parts, summary, temporaries)."""
    out = tmp_path / "out"
    claim(out, _manifest(), False)
    _put(out, {"parts/000000-images.parquet": "part", "summary.json": "{}",
               "parts/.000001-s-0.parquet.k3j9x.tmp": "stale"})
    before = _files(out)
    assert _refused(claim, out, _manifest() | change, False) == (
        f"--out {out} holds predictions of {why}; give another --out, or pass --force to replace them (it deletes "
        "only the part files its manifest.json names)")
    assert _files(out) == before


USERS = {"notes.md": "keep", "parts/report.txt": "my notes", "parts/.draft.1.tmp": "mine too",
         "parts/000009-other.parquet": "a part no manifest names", "parts/000009-other.jsonl": "nor this",
         "sub/000000-images.parquet": "not in parts", ".lock": "{}"}


@pytest.mark.parametrize(("change", "why"), [*DIFFERENCES, ({}, "the same run")])
def test_force_deletes_only_the_old_manifests_parts_and_the_summary(tmp_path: Path, change: dict[str, Any],
                                                                    why: str) -> None:
    """--force deletes the part files the old manifest names (those written; one not yet written is no error), their
    temporaries and the summary, writes the new manifest and keeps every other file; nothing is left to resume."""
    out = tmp_path / "out"
    claim(out, _manifest(), False)
    _put(out, {**USERS, "parts/000000-images.parquet": "old", "parts/000002-s-1.parquet": "old",
               "parts/.000001-s-0.parquet.k3j9x.tmp": "stale", "summary.json": "{}"})
    new = _manifest() | change
    assert claim(out, new, True) == 0
    assert _files(out) == {"manifest.json": json.dumps(new, indent=1).encode(),
                           **{k: v.encode() for k, v in USERS.items()}}


def test_force_without_a_summary_or_any_part_starts_over(tmp_path: Path) -> None:
    """--force where the old run wrote no part and no summary yet is no error: the new manifest replaces it."""
    out = tmp_path / "out"
    claim(out, _manifest(), False)
    new = _manifest(chunk_size=8)
    assert claim(out, new, True) == 0
    assert _files(out) == {"manifest.json": json.dumps(new, indent=1).encode()}


def test_force_keeps_a_part_file_the_old_manifest_does_not_name(tmp_path: Path) -> None:
    """--force is refused, deleting nothing, where a part of the new manifest is there but the old manifest does not
    name it (in the old format it would be the old run's; in another it is not predict's); the first is named."""
    out = tmp_path / "out"
    claim(out, _manifest(units=UNITS[:1]), False)
    _put(out, {"parts/000000-images.parquet": "old", "parts/000001-s-0.jsonl": "not predict's",
               "parts/000002-s-1.jsonl": "nor this", "summary.json": "{}"})
    before = _files(out)
    assert _refused(claim, out, _manifest("jsonl"), True) == (
        f"--out {out} holds {out / 'parts' / '000001-s-0.jsonl'}, which its manifest.json does not name (predict did "
        "not write it); move it away or give another --out")  # the first in the new manifest's order
    assert _files(out) == before


@pytest.mark.parametrize("force", [False, True])
def test_claim_refuses_a_folder_of_other_files(tmp_path: Path, force: bool) -> None:
    """claim, with --force too, refuses a folder of files without predict's manifest and changes nothing."""
    out = tmp_path / "out"
    _put(out, {"parts/report.txt": "mine", "summary.json": "{}"})
    before = _files(out)
    assert "is a folder of other files" in _refused(claim, out, _manifest(), force)
    assert _files(out) == before


# _rows


IDS = ["photos/a.png", "photos/b.png", "photos/c.png"]
NAMES = ["cat", "dog", "eel"]


def _outputs(conformal: bool = True) -> dict[str, np.ndarray]:
    """A program's outputs for 3 images of 3 classes, every value exact in float32."""
    out = {"probabilities": np.array([[0.25, 0.75, 0.0], [0.5, 0.25, 0.25], [0.0, 0.0, 1.0]]),
           "prediction": np.array([1, 0, 2], np.int32), "confidence": np.array([0.75, 0.5, 1.0]),
           "entropy": np.array([0.5, 1.0, 0.0]), "mutual_information": np.array([0.125, 0.25, 0.0]),
           "disagreement": np.array([0.0, 0.5, 0.25])}
    if conformal:
        out["conformal_set"] = np.array([[0, 1, 0], [1, 1, 1], [0, 0, 1]], bool)
    return out


def _expected_rows(names: list[str] | None, conformal: bool) -> list[dict[str, Any]]:
    """The rows of the part of ``_outputs``, as JSON values, in their column order."""
    rows = [{"id": "photos/a.png", "unit": "000000-images", "prediction": 1, "confidence": 0.75, "entropy": 0.5,
             "mutual_information": 0.125, "disagreement": 0.0, "probabilities": [0.25, 0.75, 0.0]},
            {"id": "photos/b.png", "unit": "000000-images", "prediction": 0, "confidence": 0.5, "entropy": 1.0,
             "mutual_information": 0.25, "disagreement": 0.5, "probabilities": [0.5, 0.25, 0.25]},
            {"id": "photos/c.png", "unit": "000000-images", "prediction": 2, "confidence": 1.0, "entropy": 0.0,
             "mutual_information": 0.0, "disagreement": 0.25, "probabilities": [0.0, 0.0, 1.0]}]
    for row, name, members in zip(rows, ["dog", "cat", "eel"], [[1], [0, 1, 2], [2]], strict=True):
        if names is not None:
            row["class_name"] = name
        if conformal:
            row["conformal_set"] = members
    return rows


@pytest.mark.parametrize("conformal", [False, True])
@pytest.mark.parametrize("names", [None, NAMES])
def test_rows_are_every_column_in_its_type(names: list[str] | None, conformal: bool) -> None:
    """A part's columns, in order: id, unit, prediction (int64), the four scalars (float32), probabilities (float32),
    then class_name only with class names and conformal_set (class indices) only when the program has one."""
    outputs = _outputs(conformal)
    outputs["prediction"] = outputs["prediction"].astype(np.float64)  # whatever the program's dtype
    cols = _rows("000000-images", list(IDS), outputs, names)
    assert list(cols) == ["id", "unit", "prediction", "confidence", "entropy", "mutual_information", "disagreement",
                          "probabilities", *(["class_name"] if names else []),
                          *(["conformal_set"] if conformal else [])]
    assert cols["id"] == IDS and cols["unit"] == ["000000-images"] * 3
    assert cols["prediction"].dtype == np.int64 and cols["prediction"].tolist() == [1, 0, 2]
    expected = _expected_rows(names, conformal)
    for name in ("confidence", "entropy", "mutual_information", "disagreement"):
        assert cols[name].dtype == np.float32 and cols[name].tolist() == [r[name] for r in expected], name
    assert cols["probabilities"].dtype == np.float32 and cols["probabilities"].shape == (3, 3)
    assert cols["probabilities"].tolist() == [r["probabilities"] for r in expected]
    if names:
        assert cols["class_name"] == ["dog", "cat", "eel"]
    if conformal:
        assert cols["conformal_set"] == [[1], [0, 1, 2], [2]]
        assert all(type(i) is int for s in cols["conformal_set"] for i in s)


# write_part and read_part


@pytest.mark.parametrize("conformal", [False, True])
@pytest.mark.parametrize("names", [None, NAMES])
def test_a_jsonl_part_is_its_header_then_one_line_per_image(tmp_path: Path, names: list[str] | None,
                                                            conformal: bool) -> None:
    """A jsonl part: its header (unit, predicted, skipped inputs) on the first line, then one JSON object per image
    with every column in order, each line ending in a newline; published atomically (no temporary left)."""
    path = part_path(tmp_path, "000000-images", "jsonl")
    path.parent.mkdir()
    skipped = [{"id": "photos/d.png", "reason": "cannot decode png"}]
    write_part(path, "000000-images", list(IDS), _outputs(conformal), skipped, names)
    header = {"unit": "000000-images", "predicted": 3, "skipped": skipped}
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in
                                       [header, *_expected_rows(names, conformal)])
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.parametrize("conformal", [False, True])
@pytest.mark.parametrize("names", [None, NAMES])
def test_a_parquet_part_holds_every_column_and_its_header(tmp_path: Path, names: list[str] | None,
                                                          conformal: bool) -> None:
    """A parquet part: every column in order and type (probabilities a list of float32, conformal_set a list of
    int32), its header in the ``sigmanens.part`` metadata; published atomically (no temporary left)."""
    path = part_path(tmp_path, "000000-images", "parquet")
    path.parent.mkdir()
    skipped = [{"id": "photos/d.png", "reason": "cannot decode png"}]
    write_part(path, "000000-images", list(IDS), _outputs(conformal), skipped, names)
    table = pq.read_table(path)
    assert table.schema.metadata == {b"sigmanens.part": json.dumps(
        {"unit": "000000-images", "predicted": 3, "skipped": skipped}).encode()}
    types = {"id": pa.string(), "unit": pa.string(), "prediction": pa.int64(), "confidence": pa.float32(),
             "entropy": pa.float32(), "mutual_information": pa.float32(), "disagreement": pa.float32(),
             **({"class_name": pa.string()} if names else {}), "probabilities": pa.list_(pa.float32()),
             **({"conformal_set": pa.list_(pa.int32())} if conformal else {})}
    assert [(f.name, f.type) for f in table.schema] == list(types.items())
    order = list(types)
    assert table.to_pylist() == [{k: row[k] for k in order} for row in _expected_rows(names, conformal)]
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_read_part_gives_back_the_header_and_the_summarys_columns(tmp_path: Path, fmt: str) -> None:
    """read_part of a written part: its header (skipped inputs included) and exactly the prediction, confidence,
    entropy and mutual_information columns, with their values; a rewrite replaces the part whole."""
    path = part_path(tmp_path, "000001-s-0", fmt)
    path.parent.mkdir()
    write_part(path, "000001-s-0", ["old"], {k: v[:1] for k, v in _outputs().items()}, [], None)
    skipped = [{"id": "s-0.tar:0003", "reason": "cannot decode png"}, {"id": "s-0.tar:0004", "reason": "empty"}]
    write_part(path, "000001-s-0", list(IDS), _outputs(), skipped, NAMES)
    header, cols = read_part(path)
    assert header == {"unit": "000001-s-0", "predicted": 3, "skipped": skipped}
    assert sorted(cols) == ["confidence", "entropy", "mutual_information", "prediction"]
    assert cols["prediction"].dtype == np.int64 and cols["prediction"].tolist() == [1, 0, 2]
    assert cols["confidence"].tolist() == [0.75, 0.5, 1.0]
    assert cols["entropy"].tolist() == [0.5, 1.0, 0.0]
    assert cols["mutual_information"].tolist() == [0.125, 0.25, 0.0]
    if fmt == "parquet":
        assert {cols[n].dtype for n in ("confidence", "entropy", "mutual_information")} == {np.dtype(np.float32)}
    assert os.listdir(path.parent) == [path.name]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_part_of_skipped_inputs_only_round_trips(tmp_path: Path, fmt: str) -> None:
    """A unit whose every input was skipped still gets a part: no rows, its skipped inputs in its header."""
    path = part_path(tmp_path, "000002-s-1", fmt)
    path.parent.mkdir()
    outputs = {k: v[:0] for k, v in _outputs().items()}
    skipped = [{"id": "s-1.tar:0001", "reason": "the only readable image of its unit"}]
    write_part(path, "000002-s-1", [], outputs, skipped, NAMES)
    header, cols = read_part(path)
    assert header == {"unit": "000002-s-1", "predicted": 0, "skipped": skipped}
    assert {k: v.tolist() for k, v in cols.items()} == {k: [] for k in COLUMNS}
    if fmt == "jsonl":
        assert path.read_text() == json.dumps(header) + "\n"


def test_read_part_reads_only_the_columns_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_part of a parquet part asks pyarrow for the four columns the summary needs, not the probabilities."""
    path = part_path(tmp_path, "000000-images", "parquet")
    path.parent.mkdir()
    write_part(path, "000000-images", list(IDS), _outputs(), [], NAMES)
    asked = []
    read_table = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda p, **kw: asked.append(kw) or read_table(p, **kw))
    read_part(path)
    assert asked == [{"columns": ["prediction", "confidence", "entropy", "mutual_information"]}]


def test_a_failed_parquet_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A parquet part is written under a temporary name and published whole: a writer that fails midway leaves
    neither the part (which would read as a finished unit) nor its temporary."""
    path = part_path(tmp_path, "000000-images", "parquet")
    path.parent.mkdir()

    def fail(table: pa.Table, f: Any) -> None:
        f.write(b"PAR1 half")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", fail)
    with pytest.raises(OSError, match="disk full"):
        write_part(path, "000000-images", list(IDS), _outputs(), [], None)
    assert not list(path.parent.iterdir())


# summarise


@dataclass(frozen=True)
class _Meta:
    """The three things summarise reads of a program's metadata."""

    num_classes: int
    class_names: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": "sigmanens-program/1", "num_classes": self.num_classes, "class_names": self.class_names}


# the parts of UNITS, by hand: (header, rows of prediction, confidence, entropy, mutual_information)
PARTS = {
    "000000-images": ({"unit": "000000-images", "predicted": 2,
                       "skipped": [{"id": "photos/c.png", "reason": "cannot decode png"}]},
                      [(1, 0.5, 1.0, 0.25), (0, 0.75, 0.5, 0.125)]),
    "000001-s-0": ({"unit": "000001-s-0", "predicted": 3, "skipped": []},
                   [(1, 1.0, 0.0, 0.0), (1, 0.5, 0.25, 0.5), (3, 0.25, 2.0, 0.25)]),
    "000002-s-1": ({"unit": "000002-s-1", "predicted": 0,
                    "skipped": [{"id": "s-1.tar:0001", "reason": "the only readable image of its unit"}]}, []),
    "000003-stray": ({"unit": "000003-stray", "predicted": 1, "skipped": [{"id": "x", "reason": "y"}]},
                     [(2, 1.0, 1.0, 1.0)]),  # in parts/ but not in the manifest: not summarised
}
COLUMNS = ("prediction", "confidence", "entropy", "mutual_information")


def _write_parts(out: Path, fmt: str) -> None:
    """PARTS as part files of ``fmt``, written here with pyarrow or json (not write_part)."""
    (out / "parts").mkdir(parents=True)
    for unit, (header, rows) in PARTS.items():
        path = out / "parts" / f"{unit}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(line) + "\n" for line in
                                    [header, *({"id": f"i{i}", **dict(zip(COLUMNS, r, strict=True))}
                                               for i, r in enumerate(rows))]))
            continue
        cols = list(zip(*rows, strict=True)) or [(), (), (), ()]
        table = pa.table({"id": pa.array([f"i{i}" for i in range(len(rows))], pa.string()),
                          "prediction": pa.array(cols[0], pa.int64()),
                          **{n: pa.array(c, pa.float32()) for n, c in zip(COLUMNS[1:], cols[1:], strict=True)}})
        pq.write_table(table.replace_schema_metadata({"sigmanens.part": json.dumps(header)}), path)


RUNS = [{"rank": 0, "units": 2, "predicted": 3, "skipped": 1, "seconds": 1.23456},
        {"rank": 1, "units": 0, "predicted": 0, "skipped": 0, "seconds": 2.34567}]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("names", [None, ["cat", "dog", "eel", "fox"]])
def test_summary_of_every_part_of_the_manifest(tmp_path: Path, fmt: str, names: list[str] | None) -> None:
    """summary.json over the manifest's parts (this run's and earlier ones', not a stray part): counts, per-class
    predictions by name or index (a class never predicted included), means, skipped inputs in unit order, units
    done before, throughput over the ranks (the slowest rank's seconds), the program with its metadata; written
    as JSON (indent 1) and returned."""
    out = tmp_path / "out"
    _write_parts(out, fmt)
    manifest = _manifest(fmt)
    meta = _Meta(4, names)
    summary = summarise(out, manifest, meta, RUNS)
    keys = names or ["0", "1", "2", "3"]
    expected = {
        "format": "sigmanens-predictions/1", "predicted": 5, "skipped": 2,
        "per_class": dict(zip(keys, [1, 3, 0, 1], strict=True)),
        "mean": {"confidence": 3.0 / 5, "entropy": 3.75 / 5, "mutual_information": 1.125 / 5},
        "skipped_inputs": [{"id": "photos/c.png", "reason": "cannot decode png"},
                           {"id": "s-1.tar:0001", "reason": "the only readable image of its unit"}],
        "units": {"total": 3, "this_run": 2, "done_before": 1},
        "throughput": {"predicted_this_run": 3, "seconds": 2.346, "images_per_s": 1.28, "ranks": 2},
        "program": {"path": "model.pt2", "sha256": "ab" * 32,
                    "metadata": {"format": "sigmanens-program/1", "num_classes": 4, "class_names": names}},
        "inputs": ["photos", "s-0.tar"], "output_format": fmt,
    }
    assert summary == expected
    assert (out / "summary.json").read_text() == json.dumps(expected, indent=1)
    assert sorted(p.name for p in out.iterdir()) == ["parts", "summary.json"]


@pytest.mark.parametrize(("runs", "throughput", "this_run"), [
    ([], {"predicted_this_run": 0, "seconds": 0.0, "images_per_s": None, "ranks": 0}, 0),
    ([{"rank": 0, "units": 0, "predicted": 0, "skipped": 0, "seconds": 0.0}],
     {"predicted_this_run": 0, "seconds": 0.0, "images_per_s": None, "ranks": 1}, 0),
    ([{"rank": 0, "units": 1, "predicted": 2, "skipped": 0, "seconds": 0.5}],
     {"predicted_this_run": 2, "seconds": 0.5, "images_per_s": 4.0, "ranks": 1}, 1),
    ([{"rank": 0, "units": 1, "predicted": 2, "skipped": 0, "seconds": 3.0},
      {"rank": 1, "units": 1, "predicted": 3, "skipped": 0, "seconds": 0.0004}],
     {"predicted_this_run": 5, "seconds": 3.0, "images_per_s": 1.67, "ranks": 2}, 2),
])
def test_summary_throughput_and_units_of_this_run(tmp_path: Path, runs: list[dict[str, Any]],
                                                  throughput: dict[str, Any], this_run: int) -> None:
    """The throughput (no rate without seconds, nor without ranks) and the units this run did and found done."""
    out = tmp_path / "out"
    _write_parts(out, "jsonl")
    summary = summarise(out, _manifest("jsonl"), _Meta(4), runs)
    assert summary["throughput"] == throughput
    assert summary["units"] == {"total": 3, "this_run": this_run, "done_before": 3 - this_run}


def test_summary_of_nothing_predicted_has_no_means(tmp_path: Path) -> None:
    """A manifest whose parts predicted nothing (every input skipped) has means of None, counts of 0 for every
    class and still lists its skipped inputs."""
    out = tmp_path / "out"
    _write_parts(out, "parquet")
    summary = summarise(out, _manifest(units=("000002-s-1",)), _Meta(2, ["a", "b"]), [])
    assert (summary["predicted"], summary["skipped"], summary["per_class"], summary["mean"]) == (
        0, 1, {"a": 0, "b": 0}, {"confidence": None, "entropy": None, "mutual_information": None})
    assert summary["skipped_inputs"] == [{"id": "s-1.tar:0001", "reason": "the only readable image of its unit"}]
    assert summary["units"] == {"total": 1, "this_run": 0, "done_before": 1}
