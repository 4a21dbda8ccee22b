"""``sigmanens predict PROGRAM INPUTS --out DIR``: image files, folders, webdataset shards and FFCV files are each
predicted once, equal to calling the program directly; under torchrun every input is predicted exactly once across
ranks and a corrupt image is recorded as skipped; a run killed with SIGKILL continues on rerun with no duplicate and
no gap; wrong sizes, wrong channels, unknown inputs, another program in the same DIR and a hostile .pt2 (code to run,
or a size expression that never finishes) are one line and exit 2 before any part is written; --force deletes only
the part files predict's own manifest names, and an --out that overlaps an input or lies under a file is refused
before any work."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sigmanens_dist.cli import main
from sigmanens_dist.export.program import export_program
from sigmanens_dist.models import load_trained
from sigmanens_dist.training.run_lock import RunLock
from tests.helpers import FIXTURE, REPO, env, import_blocking, torchrun, untrained_run

CKPT = Path("checkpoints") / "step_00000002.pt"
# a test_resnet σN-Ens (BatchNorms whose last ones see a 1 × 1 map) on 16 × 16 RGB images, as the fixture's program
BATCHNORM_RUN = ["model.name=test_resnet", "model.num_members=2", "data.dataset=synthetic", "data.img_size=16",
                 "train.batch_size=8", "data.num_workers=0", "tracking.enabled=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shutil.copytree(FIXTURE, tmp_path_factory.mktemp("predict") / "run")


@pytest.fixture(scope="module")
def program(run: Path) -> Path:
    out = run.parent / "model.pt2"
    export_program(load_trained(run / CKPT), out)
    return out


@pytest.fixture(scope="module")
def batch_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program normalising each batch by its own BatchNorm statistics alone (``--norm-stats batch``, prior 0)."""
    run = untrained_run(tmp_path_factory.mktemp("batch") / "run", BATCHNORM_RUN)
    out = run.parent / "batch0.pt2"
    export_program(load_trained(run / "checkpoints" / "step_00000000.pt"), out, norm_stats="batch")
    return out


def _png(seed: int, size: int = 16, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3) if mode == "RGB" else (size, size))
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode).save(buf, format="PNG")
    return buf.getvalue()


def _images(folder: Path, names: list[str], seed: int = 0) -> list[Path]:
    paths = []
    for i, name in enumerate(names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_png(seed + i))
        paths.append(path)
    return paths


def _shard(path: Path, samples: dict[str, bytes]) -> Path:
    """A webdataset shard as this project writes them: ``KEY.png`` and ``KEY.cls`` per sample."""
    with tarfile.open(path, "w") as tar:
        for key, data in samples.items():
            for ext, payload in (("png", data), ("cls", b"0")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return path


def _direct(program: Path, images: list[np.ndarray]) -> np.ndarray:
    """The program called directly on ``images`` (H, W, 3 uint8): its probabilities."""
    x = torch.stack([torch.from_numpy(np.array(i)).permute(2, 0, 1).float() / 255 for i in images])
    with torch.no_grad():
        return torch.export.load(program).module()(x)["probabilities"].numpy()


def _parts(out: Path) -> dict[str, dict]:
    """id -> row over every part (an id seen twice fails)."""
    import pyarrow.parquet as pq

    rows: dict[str, dict] = {}
    for path in sorted((out / "parts").iterdir()):
        if path.suffix == ".jsonl":
            new = [json.loads(line) for line in path.read_text().splitlines()[1:]]
        else:
            new = pq.read_table(path).to_pylist()
        for row in new:
            assert row["id"] not in rows, f"{row['id']} predicted twice"
            rows[row["id"]] = row
    return rows


def test_folder_files_shards_and_ffcv_equal_the_program(program: Path, tmp_path: Path) -> None:
    from sigmanens_dist.data.ffcv_io import write_beton

    folder = tmp_path / "photos"
    _images(folder, ["b/2.png", "a.png", "b/1.png", "c/d/e.png"])
    singles = _images(tmp_path, ["x.png", "y.png"], seed=10)
    shards = [_shard(tmp_path / f"s-{i}.tar", {f"{i:03d}{j}": _png(20 + 3 * i + j) for j in range(3)})
              for i in range(2)]
    pixels = np.random.default_rng(5).integers(0, 256, (5, 16, 16, 3)).astype(np.uint8)
    beton = write_beton([(p, 0) for p in pixels], tmp_path / "x.beton", max_resolution=None, write_mode="raw",
                        num_workers=1)
    out = tmp_path / "out"
    inputs = [folder, *singles, *shards, beton]
    assert main(["predict", str(program), *map(str, inputs), "--out", str(out), "--chunk-size", "3",
                 "--batch-size", "4"]) == 0

    expected = {f"{folder.as_posix()}/{rel}": np.asarray(Image.open(folder / rel))
                for rel in ["a.png", "b/1.png", "b/2.png", "c/d/e.png"]}
    expected |= {p.as_posix(): np.asarray(Image.open(p)) for p in singles}
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".png"):
                    expected[f"{shard.as_posix()}:{member.name[:-4]}"] = np.asarray(
                        Image.open(io.BytesIO(tar.extractfile(member).read())))
    expected |= {f"{beton.as_posix()}:{i}": p for i, p in enumerate(pixels)}
    rows = _parts(out)
    assert list(rows) == list(expected)  # every input once, in the global order
    probs = _direct(program, list(expected.values()))
    np.testing.assert_allclose(np.array([r["probabilities"] for r in rows.values()]), probs, atol=1e-5, rtol=0)
    assert [r["prediction"] for r in rows.values()] == probs.argmax(-1).tolist()
    units = sorted(p.stem for p in (out / "parts").iterdir())
    assert units == ["000000-images", "000001-images", "000002-s-0", "000003-s-1", "000004-x", "000005-x"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted"] == len(expected) == 17 and summary["skipped"] == 0
    assert sum(summary["per_class"].values()) == 17
    assert summary["mean"]["confidence"] == pytest.approx(float(probs.max(-1).mean()), abs=1e-5)
    assert summary["units"] == {"total": 6, "this_run": 6, "done_before": 0}
    assert summary["program"]["metadata"]["input"]["shape"] == ["B", 3, 16, 16]


def test_jsonl_parts_hold_what_parquet_parts_hold(run: Path, tmp_path: Path) -> None:
    """Both formats, from a program with a conformal set: its column is the class indices the program's set holds."""
    program = tmp_path / "conformal.pt2"
    export_program(load_trained(run / CKPT), program, conformal=0.1)
    folder = tmp_path / "photos"
    paths = _images(folder, [f"{i}.png" for i in range(5)])
    for fmt in ("parquet", "jsonl"):
        assert main(["predict", str(program), str(folder), "--out", str(tmp_path / fmt), "--format", fmt,
                     "--chunk-size", "2"]) == 0
    parquet, jsonl = _parts(tmp_path / "parquet"), _parts(tmp_path / "jsonl")
    assert list(parquet) == list(jsonl) == [p.as_posix() for p in paths]
    x = torch.stack([torch.from_numpy(np.asarray(Image.open(p))).permute(2, 0, 1).float() / 255 for p in paths])
    with torch.no_grad():
        sets = torch.export.load(program).module()(x)["conformal_set"]
    for i, (key, row) in enumerate(parquet.items()):
        assert row["prediction"] == jsonl[key]["prediction"] and row["unit"] == jsonl[key]["unit"]
        np.testing.assert_allclose(row["probabilities"], jsonl[key]["probabilities"], atol=1e-6)
        assert row["conformal_set"] == jsonl[key]["conformal_set"] == torch.flatten(sets[i].nonzero()).tolist()
    header = json.loads((tmp_path / "jsonl" / "parts" / "000000-images.jsonl").read_text().splitlines()[0])
    assert header == {"unit": "000000-images", "predicted": 2, "skipped": []}


def _refusal(program: Path, inputs: list[Path], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["predict", str(program), *map(str, inputs), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sigmanens predict: error: "), err
    assert not list(out.glob("parts/*")), "a part was written"
    return err


def _without_transform(program: Path, tmp_path: Path) -> Path:
    """``program`` as one exported before ``input.crop_ratio`` was recorded: it takes its exact size only."""
    reader = torch._C.PyTorchFileReader(str(program))
    name = next(n for n in reader.get_all_records() if n.endswith("extra/sigmanens.json"))
    meta = json.loads(reader.get_record(name))
    meta["input"].pop("crop_ratio")
    return _rewrite(program, tmp_path / "exact.pt2", {name: json.dumps(meta).encode()})


def test_wrong_size_channels_or_type_is_one_line_before_any_work(program: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A program without an input transform (exported before ``input.crop_ratio``) takes its exact size and mode
    only; any program refuses what is not an image, and an image of 16-bit pixels."""
    exact = _without_transform(program, tmp_path)
    good = _images(tmp_path / "ok", ["a.png"])
    (tmp_path / "big.png").write_bytes(_png(0, size=20))
    err = _refusal(exact, [*good, tmp_path / "big.png"], tmp_path / "o1", capsys)
    assert "big.png: a 20×20 RGB image; the program takes 16×16 RGB images" in err
    (tmp_path / "gray.png").write_bytes(_png(0, mode="L"))
    err = _refusal(exact, [tmp_path / "gray.png"], tmp_path / "o2", capsys)
    assert "gray.png: a 16×16 L image; the program takes 16×16 RGB images" in err
    shard = _shard(tmp_path / "s.tar", {"000": b"not an image", "001": _png(1, size=8)})
    err = _refusal(exact, [shard], tmp_path / "o3", capsys)
    assert "s.tar:001 (the first image of" in err and "8×8 RGB" in err
    (tmp_path / "notes.txt").write_text("hello")
    err = _refusal(program, [*good, tmp_path / "notes.txt"], tmp_path / "o4", capsys)
    assert "notes.txt: not an image (.jpg" in err and "(.tar) or an FFCV file (.beton)" in err
    Image.fromarray(np.full((16, 16), 40000, np.uint16)).save(tmp_path / "deep.png")
    err = _refusal(program, [tmp_path / "deep.png"], tmp_path / "o5", capsys)
    assert "deep.png: a 16×16 I;16 image; the program takes RGB images of any size (centre 1 of the shorter side, " \
        "resized to 16×16)" in err


def test_images_of_any_size_and_mode_are_made_what_the_program_takes(program: Path, tmp_path: Path) -> None:
    """Issue 53: a program carries its input transform (``input.crop_ratio``); predict makes every image what the
    program takes with it: the centre square of the shorter side, resized bilinearly, the mode converted. Checked
    against PIL by hand."""
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(5)
    wide = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)  # 40×30: its centre 30×30, then 16×16
    Image.fromarray(wide).save(folder / "a_wide.png")
    Image.fromarray(wide).save(folder / "b_wide.jpg", quality=95)
    Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8), "L").save(folder / "c_gray.png")
    rgba = rng.integers(0, 256, (20, 20, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(folder / "d_rgba.png")
    assert main(["predict", str(program), str(folder), "--out", str(tmp_path / "out")]) == 0
    rows = _parts(tmp_path / "out")

    def by_hand(path: Path) -> np.ndarray:
        with Image.open(path) as image:
            image = image.convert("RGB")
            side = min(image.size)
            left, top = (image.size[0] - side) // 2, (image.size[1] - side) // 2
            image = image.crop((left, top, left + side, top + side))
            return np.asarray(image.resize((16, 16), Image.Resampling.BILINEAR) if side != 16 else image)

    paths = sorted(folder.iterdir())
    want = _direct(program, [by_hand(p) for p in paths])
    got = np.array([rows[p.as_posix()]["probabilities"] for p in paths])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.allclose(got[0], _direct(program, [wide[7:23, 12:28]])[0], atol=1e-4)  # resized, not cut


def test_another_program_in_the_same_dir_is_refused_unless_force(run: Path, program: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "photos"
    _images(folder, ["a.png", "b.png"])
    out = tmp_path / "out"
    assert main(["predict", str(program), str(folder), "--out", str(out)]) == 0
    other = tmp_path / "one.pt2"
    export_program(load_trained(run / CKPT), other, members=[0])
    before = sorted((out / "parts").iterdir())
    capsys.readouterr()
    assert main(["predict", str(other), str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds predictions of another program" in err and "--force" in err
    assert sorted((out / "parts").iterdir()) == before
    _images(folder, ["c.png"])
    assert main(["predict", str(program), str(folder), "--out", str(out)]) == 2
    assert "other inputs (the same paths, but their files or contents changed)" in capsys.readouterr().err
    assert main(["predict", str(other), str(folder), "--out", str(out), "--force"]) == 0
    assert len(_parts(out)) == 3


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_replaces_only_the_parts_its_manifest_names(program: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44, finding 1: --force in a folder of predict's replaces its parts and summary and keeps every file the
    user put there; a folder of other files or another tool's manifest.json is refused, --force or not, untouched,
    and the refusal does not suggest --force."""
    folder = tmp_path / "photos"
    _images(folder, ["a.png", "b.png"])
    out = tmp_path / "myproj"
    assert main(["predict", str(program), str(folder), "--out", str(out), "--chunk-size", "1"]) == 0
    users = {"parts/report.txt": b"my notes", "notes.md": b"keep", "parts/.draft.1.tmp": b"mine too"}
    for name, data in users.items():
        (out / name).write_bytes(data)
    assert main(["predict", str(program), str(folder), "--out", str(out), "--chunk-size", "2"]) == 2
    assert "holds predictions of other inputs" in capsys.readouterr().err  # other units: another chunking
    assert main(["predict", str(program), str(folder), "--out", str(out), "--chunk-size", "2", "--format", "jsonl",
                 "--force"]) == 0
    kept = _files(out)
    assert {name: kept[name] for name in users} == users
    assert sorted(kept) == sorted([*users, ".lock", "manifest.json", "summary.json", "parts/000000-images.jsonl"])
    assert len(kept["parts/000000-images.jsonl"].splitlines()) == 3  # its header and both images
    capsys.readouterr()

    for name, manifest in (("plain", None), ("foreign", b'{"project": "mine"}')):
        other = tmp_path / name
        (other / "parts").mkdir(parents=True)
        (other / "parts" / "report.txt").write_text("mine")
        if manifest is not None:
            (other / "manifest.json").write_bytes(manifest)
        before = _files(other)
        for force in ([], ["--force"]):
            assert main(["predict", str(program), str(folder), "--out", str(other), *force]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "never" in err and "did not write" in err, err
            assert "pass --force" not in err
            assert _files(other) == before


@pytest.mark.parametrize("case", ["equal", "inside", "holds"])
def test_out_overlapping_an_input_is_refused_before_any_work(program: Path, tmp_path: Path, case: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44, finding 2: `--out photos --force` deleted the inputs under photos/parts/. An --out equal to an
    input folder, inside it or holding an input is one line, exit 2, and nothing is written or deleted."""
    photos = tmp_path / "work" / "photos"
    _images(photos, ["a.png", "parts/000000-images.png"])
    out = {"equal": photos, "inside": photos / "preds", "holds": tmp_path / "work"}[case]
    before = _files(tmp_path)
    assert main(["predict", str(program), str(photos), "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    relation = {"equal": "is", "inside": "is inside", "holds": "holds"}[case]
    assert err == (f"sigmanens predict: error: --out {out} {relation} INPUT {photos}: predict never writes among its "
                   "inputs nor reads them from its output folder; give an --out outside every input\n")
    assert _files(tmp_path) == before and not (photos / "preds").exists()


def test_out_under_a_file_is_one_line(program: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44, finding 8: `--out afile/p` was a NotADirectoryError traceback."""
    photos = tmp_path / "photos"
    _images(photos, ["a.png"])
    afile = tmp_path / "afile"
    afile.write_text("a file")
    for out, says in ((afile / "p" / "q", f": a part of this path is a file, not a folder ({afile})"),
                      (afile, " is a file, not a folder")):
        assert main(["predict", str(program), str(photos), "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"sigmanens predict: error: --out {out}{says}\n"
    assert afile.read_text() == "a file"


def _rewrite(src: Path, dst: Path, change: dict[str, bytes]) -> Path:
    """A copy of the program ``src`` with the records in ``change`` replaced."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    reader = torch._C.PyTorchFileReader(str(src))
    with PT2ArchiveWriter(str(dst)) as writer:
        for name in reader.get_all_records():
            if not name.startswith(".data/"):
                writer.write_bytes(name, change.get(name, reader.get_record(name)))
    return dst


@pytest.mark.parametrize("route", ["pickled weight", "shape expression"])
def test_a_hostile_program_is_refused_before_it_runs(program: Path, tmp_path: Path, route: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """torch.export.load would run the file's code (shown first); predict refuses it in one line, and nothing ran."""
    marker = tmp_path / "pwned"
    reader = torch._C.PyTorchFileReader(str(program))
    if route == "pickled weight":  # torch.load(weights_only=False) of a payload marked use_pickle
        config = json.loads(reader.get_record("data/weights/model_weights_config.json"))
        first = next(iter(config["config"].values()))
        first["use_pickle"] = True
        payload = b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."
        change = {"data/weights/model_weights_config.json": json.dumps(config).encode(),
                  f"data/weights/{first['path_name']}": payload}
    else:  # sympy.sympify (an eval) of a symbolic size
        text = reader.get_record("models/model.json").decode()
        evil = f"__import__('os').system('touch {marker}') or Symbol('s77', positive=True, integer=True)"
        text = text.replace('"Symbol(\'s77\', positive=True, integer=True)"', json.dumps(evil), 1)
        change = {"models/model.json": text.encode()}
    hostile = _rewrite(program, tmp_path / "hostile.pt2", change)
    with contextlib.suppress(Exception):  # whatever torch makes of the rest, the code has run by then
        torch.export.load(hostile).module()
    assert marker.exists(), "the crafted file did not run code: the test proves nothing"
    marker.unlink()
    capsys.readouterr()  # torch's own log of that load
    folder = tmp_path / "photos"
    _images(folder, ["a.png"])
    err = _refusal(hostile, [folder], tmp_path / "out", capsys)
    assert "refused: it holds" in err and "could run any code" in err
    assert not marker.exists()


def test_a_program_of_a_later_format_is_refused_in_one_line(program: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A program whose metadata says ``sigmanens-program/99`` (a later sigmanens's layout) is not read as if it were
    this one's: one line naming both versions, exit 2, before any input is read."""
    reader = torch._C.PyTorchFileReader(str(program))
    name = next(n for n in reader.get_all_records() if n.endswith("extra/sigmanens.json"))
    meta = json.loads(reader.get_record(name)) | {"format": "sigmanens-program/99"}
    later = _rewrite(program, tmp_path / "later.pt2", {name: json.dumps(meta).encode()})
    folder = tmp_path / "photos"
    _images(folder, ["a.png"])
    err = _refusal(later, [folder], tmp_path / "out", capsys)
    assert f"PROGRAM {later}: its sigmanens.json says format sigmanens-program/99" in err
    assert "this one reads sigmanens-program/1 to sigmanens-program/1" in err


# predict in a fresh interpreter where the evaluation code cannot be imported, nor pydantic (the config's) and timm:
# deploying needs none of them (the GPU image that runs programs has no pydantic)
PREDICT_WITHOUT_EVALUATION = import_blocking("sigmanens_dist.evaluation", "pydantic", "timm") + """
from sigmanens_dist.cli import main
code = main(["predict", sys.argv[1], sys.argv[2], "--out", sys.argv[3], "--format", "jsonl"])
assert "sigmanens_dist.export.program" not in sys.modules, "predict imported the exporter"
sys.exit(code)
"""


def test_predict_runs_without_the_evaluation_code(program: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    _images(folder, ["a.png", "b.png"])
    proc = subprocess.run([sys.executable, "-c", PREDICT_WITHOUT_EVALUATION, str(program), str(folder),
                           str(tmp_path / "out")], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(_parts(tmp_path / "out")) == [f"{folder.as_posix()}/{n}" for n in ("a.png", "b.png")]


HUGE = "Pow(Integer(10), Integer(100000000))"  # sympy computes it: 10**100000000 never comes back


@pytest.mark.slow  # a child process that loads torch and is given seconds to hang: about 15 s
@pytest.mark.timeout(120)
def test_a_program_whose_size_expression_never_ends_is_refused_in_seconds(program: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44, finding 3: a size expression that sympy computes for ever hung torch.export.load, and predict with
    it (shown first, in a child process given seconds). predict refuses the file in one line within seconds."""
    text = torch._C.PyTorchFileReader(str(program)).get_record("models/model.json").decode()
    size = re.search(r"Mul\(Integer\(\d+\), (Symbol\('s\d+'[^)]*\))\)", text)
    assert size is not None, "no symbolic size to edit in the program"
    edited = text.replace(size.group(0), f"Mul({HUGE}, {size.group(1)})")
    hostile = _rewrite(program, tmp_path / "hang.pt2", {"models/model.json": edited.encode()})
    script = "import sys, torch\nfor path in sys.argv[1:]:\n    torch.export.load(path)\n    print(path, flush=True)\n"
    proc = subprocess.Popen([sys.executable, "-c", script, str(program), str(hostile)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == str(program)  # the program as exported loads...
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=4)  # ...the edited one does not, in seconds
    finally:
        proc.kill()
        proc.wait()
    _images(tmp_path / "photos", ["a.png"])
    started = time.monotonic()
    err = _refusal(hostile, [tmp_path / "photos"], tmp_path / "out", capsys)
    assert time.monotonic() - started < 10
    assert "refused: it holds the shape expression" in err and f"Mul({HUGE}, Symbol(" in err
    assert "sympy would eval and compute while loading" in err


def test_a_size_of_a_huge_precision_is_refused_in_seconds(program: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 9: ``Float(Rational(1, 3), 300000000)`` in a size passed the magnitude bound and then hung
    torch.export.load (sympy computes a 10**9-bit mantissa); predict refuses it in one line within seconds."""
    text = torch._C.PyTorchFileReader(str(program)).get_record("models/model.json").decode()
    size = re.search(r"Mul\(Integer\(\d+\), (Symbol\('s\d+'[^)]*\))\)", text)
    assert size is not None, "no symbolic size to edit in the program"
    edited = text.replace(size.group(0), f"Mul(Float(Rational(1, 3), 300000000), {size.group(1)})")
    hostile = _rewrite(program, tmp_path / "precise.pt2", {"models/model.json": edited.encode()})
    _images(tmp_path / "photos", ["a.png", "b.png"])
    started = time.monotonic()
    err = _refusal(hostile, [tmp_path / "photos"], tmp_path / "out", capsys)
    assert time.monotonic() - started < 10
    assert "refused: it holds the shape expression \"Mul(Float(Rational(1, 3), 300000000), Symbol(" in err


SIZE = "Symbol('s77', positive=True, integer=True)"


@pytest.mark.parametrize(("expression", "ok"), [
    # what torch.export writes for the batch size of this project's programs (test_resnet, ViT, every method)
    (SIZE, True),
    (f"Mul(Integer(10), {SIZE})", True),
    (f"Mul({SIZE}, Min(Integer(768), Mul(Integer(768), {SIZE})))", True),
    (f"Add(FloorDiv({SIZE}, Integer(2)), Mod({SIZE}, Integer(-3)), Max(Integer(1), {SIZE}))", True),
    # each form refused: only the forms above are read, whatever else sympy could be made to compute or run
    (HUGE, False),  # Pow: 10**100000000
    ("Float(Rational(1, 3), 300000000)", False),  # issue 51: a 10**9-bit mantissa, str() alone takes minutes
    (f"Mul(Float(Rational(1, 3), 300000000), {SIZE})", False),
    (f"Mul(Rational(1, 3), {SIZE})", False),
    ("10**100000000", False),  # operators, not constructors
    (f"{SIZE} + 1", False),
    ("s77", False),  # a bare name: sympify makes any name a call or a symbol
    (f"Integer({2**63})", False),  # beyond a 64-bit size
    ("Integer(1.5)", False),
    ("Integer('1')", False),
    ("Symbol('os')", False),  # not a size symbol's name
    ("Symbol('s77', evaluate=Pow(Integer(10), Integer(100000000)))", False),  # a keyword that is computed
    ("Symbol('s77', positive=1)", False),
    ("Mul(Integer(2))", False),  # an operation of one argument
    (f"Mul(Integer(2), {SIZE}, evaluate=False)", False),
    (f"LShift(Integer(1), {SIZE})", False),  # an operation not listed
    (f"Eq({SIZE}, Integer(1))", False),
    ("__import__('os').system('true')", False),
    ("Add(" + ", ".join(["Integer(1)"] * 300) + ")", False),  # longer than a shape expression needs
    ("Mul(Integer(2), ", False),  # not even Python
])
def test_only_the_size_expressions_torch_export_writes_pass(expression: str, ok: bool) -> None:
    """Issue 51, finding 9: the vetting lists what passes (the forms the exporter writes), so a new way to make
    sympy compute is refused without being foreseen."""
    from sigmanens_dist.program_check import _size_expression

    assert _size_expression(expression) is ok


def test_an_integer_beyond_64_bits_is_refused(program: Path, tmp_path: Path) -> None:
    from sigmanens_dist.safe_load import RefusedFileError, check_program_file

    text = torch._C.PyTorchFileReader(str(program)).get_record("models/model.json").decode()
    edited = text.replace('"min_val": 1', f'"min_val": {2**64 + 1}', 1)
    assert edited != text
    with pytest.raises(RefusedFileError, match="beyond the 64 bits"):
        check_program_file(_rewrite(program, tmp_path / "big.pt2", {"models/model.json": edited.encode()}))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_predicts_every_input_once_and_skips_the_corrupt_one(program: Path, tmp_path: Path) -> None:
    shards = []
    for i in range(5):
        samples = {f"{i}{j:03d}": _png(10 * i + j) for j in range(4)}
        if i == 2:
            samples["2001"] = b"\x89PNG\r\n\x1a\n" + b"broken" * 20  # a PNG signature, then garbage
        shards.append(_shard(tmp_path / f"test-{i:06d}.tar", samples))
    out = tmp_path / "out"
    proc = subprocess.run([*torchrun(2), "-m", "sigmanens_dist.cli", "predict", str(program), *map(str, shards),
                           "--out", str(out), "--device", "cpu"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = _parts(out)
    corrupt = f"{shards[2].as_posix()}:2001"
    assert set(rows) == {f"{s.as_posix()}:{i}{j:03d}" for i, s in enumerate(shards) for j in range(4)} - {corrupt}
    assert {r["unit"] for r in rows.values()} == {f"{i:06d}-test-{i:06d}" for i in range(5)}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted"] == 19 and summary["skipped"] == 1
    assert summary["skipped_inputs"][0]["id"] == corrupt and "cannot decode png" in summary["skipped_inputs"][0][
        "reason"]
    assert summary["throughput"]["ranks"] == 2
    assert f"skipping {corrupt}: cannot decode png" in proc.stderr


@pytest.mark.timeout(600)
def test_a_run_killed_mid_way_continues_with_no_duplicate_and_no_gap(program: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    n = 160
    _images(folder, [f"{i:04d}.png" for i in range(n)])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "sigmanens_dist.cli", "predict", str(program), str(folder), "--out", str(out),
           "--chunk-size", "2", "--batch-size", "2", "--format", "jsonl", "--device", "cpu"]
    log = tmp_path / "first.stderr"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)
    deadline = time.time() + 300
    while not list(out.glob("parts/*.jsonl")):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "no part file appeared"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    first = len(list(out.glob("parts/*.jsonl")))
    assert 0 < first < n // 2, f"{first} of {n // 2} units were done before the kill: it was not mid-way"
    again = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=540, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    rows = _parts(out)  # fails on an id seen twice
    assert list(rows) == [f"{folder.as_posix()}/{i:04d}.png" for i in range(n)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted"] == n and summary["units"]["done_before"] >= first
    assert not list(out.glob("parts/.*"))  # no temporary file left behind


def test_onnx_program_predicts_what_the_pt2_predicts(run: Path, program: Path, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    onnx = tmp_path / "model.onnx"
    export_program(load_trained(run / CKPT), onnx, fmt="onnx")
    folder = tmp_path / "photos"
    _images(folder, [f"{i}.png" for i in range(3)])
    for name, prog in (("pt2", program), ("onnx", onnx)):
        assert main(["predict", str(prog), str(folder), "--out", str(tmp_path / name)]) == 0
    a, b = _parts(tmp_path / "pt2"), _parts(tmp_path / "onnx")
    assert list(a) == list(b)
    np.testing.assert_allclose([r["probabilities"] for r in a.values()], [r["probabilities"] for r in b.values()],
                               atol=1e-5, rtol=0)


def test_a_batch_statistics_program_never_predicts_an_image_alone(batch_program: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 1: called on one image, a program of batch statistics alone answers the same for every
    image (shown first). predict never hands it one: a unit's last image alone is predicted beside the batch before
    it, the only image of a unit is skipped with its reason, and inputs of one image in all are refused."""
    folder = tmp_path / "photos"
    paths = _images(folder, [f"{i}.png" for i in range(5)])
    pixels = [np.array(Image.open(p)) for p in paths]
    alone = np.concatenate([_direct(batch_program, [p]) for p in pixels])
    np.testing.assert_allclose(alone, np.broadcast_to(alone[:1], alone.shape), atol=1e-6)  # the hazard
    assert main(["predict", str(batch_program), str(folder), "--out", str(tmp_path / "out"), "--batch-size", "2"]) == 0
    rows = _parts(tmp_path / "out")
    got = np.array([rows[f"{folder.as_posix()}/{i}.png"]["probabilities"] for i in range(5)])
    want = np.concatenate([_direct(batch_program, pixels[0:2]), _direct(batch_program, pixels[2:4]),
                           _direct(batch_program, pixels[3:5])[1:]])  # the fifth among the batch before it
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert not np.allclose(got[4], alone[4], atol=1e-3)

    assert main(["predict", str(batch_program), str(folder), "--out", str(tmp_path / "units"), "--batch-size", "2",
                 "--chunk-size", "2"]) == 0  # units of 2, 2 and 1 image
    summary = json.loads((tmp_path / "units" / "summary.json").read_text())
    assert summary["predicted"] == 4 and [s["id"] for s in summary["skipped_inputs"]] == [f"{folder.as_posix()}/4.png"]
    assert "the only readable image of its unit" in summary["skipped_inputs"][0]["reason"]
    assert sorted(_parts(tmp_path / "units")) == [f"{folder.as_posix()}/{i}.png" for i in range(4)]

    capsys.readouterr()
    err = _refusal(batch_program, [paths[0]], tmp_path / "one", capsys)
    assert f"INPUTS: one image in all, and PROGRAM {batch_program} normalises each batch" in err
    assert not (tmp_path / "one").exists()


def test_a_second_predict_into_a_busy_out_is_refused_with_or_without_force(program: Path, batch_program: Path,
                                                                            tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 3: predict owns its --out while it runs. Another predict there, of another program with
    --force or of the same one without, is refused in one line naming the holder, and changes nothing."""
    folder = tmp_path / "photos"
    _images(folder, ["a.png", "b.png", "c.png"])
    out = tmp_path / "out"
    assert main(["predict", str(program), str(folder), "--out", str(out), "--chunk-size", "1"]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    with RunLock(out, "sigmanens predict", flag="--out "):  # a predict still writing into out (this process)
        for other, force in ((batch_program, ["--force"]), (program, [])):
            assert main(["predict", str(other), str(folder), "--out", str(out), "--chunk-size", "1", *force]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"--out {out} is in use by sigmanens predict PID {os.getpid()} on " \
                "host" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"} == \
        {p: b for p, b in before.items() if p.name != ".lock"}
    assert main(["predict", str(batch_program), str(folder), "--out", str(out), "--chunk-size", "1", "--force"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert manifest["program"]["path"] == summary["program"]["path"] == str(batch_program)


def test_class_names_that_are_not_k_strings_are_refused_before_any_input(program: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 8: metadata whose class_names is not null or K strings crashed predict after the work and
    left its --out claimed; the metadata is refused on read, in one line, and --out is not created."""
    reader = torch._C.PyTorchFileReader(str(program))
    name = next(n for n in reader.get_all_records() if n.endswith("extra/sigmanens.json"))
    meta = json.loads(reader.get_record(name))
    folder = tmp_path / "photos"
    _images(folder, ["a.png", "b.png"])
    for i, names in enumerate((["a", "b"], "abcdefghij", [1] * meta["num_classes"])):
        bad = _rewrite(program, tmp_path / f"names{i}.pt2", {name: json.dumps(meta | {"class_names": names}).encode()})
        err = _refusal(bad, [folder], tmp_path / f"out{i}", capsys)
        assert f"class_names {str(names)[:80]!r}: null or a list of num_classes={meta['num_classes']} strings" in err
        assert not (tmp_path / f"out{i}").exists()


def test_a_rerun_into_the_same_out_names_what_differs() -> None:
    """What ``predict`` says when ``--out`` holds another run's parts (without ``--force``): each difference of the
    manifests in its own words — the program (its path and both hashes, 12 characters), the inputs (the old paths, at
    most 200 characters, or that the same paths changed), ``--chunk-size``, ``--format`` — first one wins; none for
    the same run."""
    from sigmanens_dist.predict.writer import _difference

    old = {"program": {"path": "a.pt2", "sha256": "0123456789abcdef"}, "inputs": ["p/1.png", "p/2.png"],
           "inputs_sha256": "aa", "chunk_size": 64, "output_format": "parquet"}
    assert _difference(old, {**old}) is None
    cases = [({"program": {"path": "b.pt2", "sha256": "fedcba9876543210"}},
              "another program (a.pt2, sha256 0123456789ab…; this one is fedcba987654…)"),
             ({"inputs": ["q"]}, "other inputs (p/1.png p/2.png)"),
             ({"inputs_sha256": "bb"}, "other inputs (the same paths, but their files or contents changed)"),
             ({"chunk_size": 8}, "--chunk-size 64 (this run: 8)"),
             ({"output_format": "jsonl"}, "--format parquet (this run: jsonl)")]
    for change, said in cases:
        assert _difference(old, {**old, **change}) == said, change
    many = {**old, "inputs": [f"photos/{i:03d}.png" for i in range(40)]}
    assert _difference(many, {**old, "inputs": ["q"]}) == f"other inputs ({' '.join(many['inputs'])[:200]})"
    assert len(_difference(many, {**old, "inputs": ["q"]})) == len("other inputs ()") + 200
    both = {**old, "chunk_size": 8, "output_format": "jsonl", "program": {"path": "b", "sha256": "ff"}}
    assert _difference(old, both).startswith("another program")  # the program is named first
    assert _difference(old, {**old, "chunk_size": 8, "output_format": "jsonl"}).startswith("--chunk-size")
