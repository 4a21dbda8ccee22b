"""A program in MLflow's Model Registry, against a real tracking server (sqlite, started and stopped here):
``sigmanens export --register`` logs it into the run's own MLflow run and registers it under an alias;
``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` runs it where sigmanens_dist and timm (for ONNX: torch too) cannot
be imported, equal to the program; the pyfunc vets a .pt2 as predict does; ``mlflow models serve`` answers a batch
over HTTP and refuses bad requests with a 4xx; ``sigmanens compare --register-best`` registers the child best on
validation NLL, never on a test metric; ``sigmanens predict models:/NAME@ALIAS`` equals ``sigmanens predict FILE``."""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sigmanens_dist.cli import main
from sigmanens_dist.experiments.study import ROLE_TAG
from sigmanens_dist.export.program import export_program
from sigmanens_dist.models import load_trained
from sigmanens_dist.predict.backends import load_program
from sigmanens_dist.safe_load import load_file
from sigmanens_dist.training.tracking import PARENT_TAG, RUN_ID_FILE
from tests.helpers import (
    FIXTURE,
    env,
    free_port,
    import_blocking,
    mlflow_server,
    stop_process,
    untrained_run,
    wait_for_port,
)

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("onnxruntime")

CKPT = Path("checkpoints") / "step_00000002.pt"
# a test_resnet σN-Ens (BatchNorms) on 16 × 16 RGB images of 10 classes, as the fixture run's
BATCHNORM_RUN = ["model.name=test_resnet", "model.num_members=2", "data.dataset=synthetic", "data.img_size=16",
                 "train.batch_size=8", "data.num_workers=0", "tracking.enabled=false"]
FORMATS = {"pt2": ("sigmanens_dist", "timm"), "onnx": ("sigmanens_dist", "timm", "torch")}  # -> what is blocked

# Load the registered model by its URI and save its outputs for the batch given (after the blocking head).
LOAD_REGISTERED = """
import mlflow, numpy as np
model = mlflow.pyfunc.load_model(sys.argv[1])
np.savez(sys.argv[3], **model.predict(np.load(sys.argv[2])))
"""


def _run_dir(folder: Path, client: object, experiment_id: str, name: str, **tags: str) -> tuple[Path, str]:
    """A copy of the fixture run whose checkpoint and mlflow_run.txt name a FINISHED MLflow run of ``experiment_id``
    in the test's store, as a tracked trainer leaves them; returns the folder and the run id."""
    run = shutil.copytree(FIXTURE, folder)
    return run, _track(run, run / CKPT, client, experiment_id, name, **tags)


def _track(run: Path, checkpoint: Path, client: object, experiment_id: str, name: str, **tags: str) -> str:
    """Make ``run`` (its ``checkpoint``) a run tracked in a FINISHED MLflow run of the test's store, as a tracked
    trainer leaves it; returns the run id."""
    mlflow_run = client.create_run(experiment_id, run_name=name, tags=tags)
    run_id = mlflow_run.info.run_id
    state = load_file(checkpoint, "checkpoint")
    torch.save({**state, "mlflow_run_id": run_id}, checkpoint)
    (run / RUN_ID_FILE).write_text(f"{client.tracking_uri}\n{run_id}\n")
    client.log_param(run_id, "run_dir", str(run))
    client.set_terminated(run_id)
    return run_id


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the test server's sqlite file and its artifacts (``mlartifacts/``)."""
    return tmp_path_factory.mktemp("registry")


@pytest.fixture(scope="module")
def store(store_dir: Path) -> Iterator[str]:
    with mlflow_server(store_dir / "mlflow.db") as url:
        yield url


@pytest.fixture(scope="module")
def registered(store: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The fixture run, tracked in ``store``, exported as a .pt2 (with conformal sets: a bool output) and an .onnx,
    each registered by ``sigmanens export --register`` under its own name with the alias champion; format -> (the
    program file, the run id)."""
    client = mlflow.MlflowClient(store)
    run, run_id = _run_dir(tmp_path_factory.mktemp("registered") / "run", client,
                           client.create_experiment("registry-tests"), "run")
    for fmt in FORMATS:
        extra = ["--conformal", "0.2"] if fmt == "pt2" else []
        assert main(["export", str(run), "--program", str(run.parent / f"model.{fmt}"), *extra,
                     "--register", f"tiny-{fmt}", "--alias", "champion"]) == 0
    return {fmt: (run.parent / f"model.{fmt}", run_id) for fmt in FORMATS}


def _program_outputs(program: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    return load_program(program, torch.device("cpu"))(torch.from_numpy(x))


@pytest.mark.slow
def test_registered_program_loads_without_the_package(registered: dict[str, tuple[Path, str]], store: str,
                                                      tmp_path: Path) -> None:
    """Both formats: the version links to the run it was logged into (still FINISHED), carries the metadata as tags
    and description, and ``mlflow.pyfunc.load_model("models:/NAME@champion")`` in a process where sigmanens_dist
    and timm (for ONNX: torch) cannot be imported gives the program's own outputs."""
    x = np.random.default_rng(0).random((7, 3, 16, 16), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    client = mlflow.MlflowClient(store)
    procs = {}
    for fmt, blocked in FORMATS.items():
        procs[fmt] = subprocess.Popen([sys.executable, "-c", import_blocking(*blocked) + LOAD_REGISTERED,
                                       f"models:/tiny-{fmt}@champion", str(tmp_path / "x.npy"),
                                       str(tmp_path / f"{fmt}.npz")],
                                      env={**env(), "MLFLOW_TRACKING_URI": store}, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for fmt, (program, run_id) in registered.items():
        version = client.get_model_version_by_alias(f"tiny-{fmt}", "champion")
        assert version.run_id == run_id and client.get_run(run_id).info.status == "FINISHED"
        assert version.tags["sigmanens.run_id"] == run_id
        assert version.tags["sigmanens.program_format"] == {"pt2": "torch", "onnx": "onnx"}[fmt]
        assert json.loads(version.tags["sigmanens.members"]) == [0, 1] and "sigma (2 of 2 members" in \
            version.description
        output, _ = procs[fmt].communicate(timeout=300)
        assert procs[fmt].returncode == 0, output[-3000:]
        got, want = np.load(tmp_path / f"{fmt}.npz"), _program_outputs(program, x)
        assert sorted(got.files) == sorted(want) and ("conformal_set" in want) == (fmt == "pt2")
        np.testing.assert_allclose(got["probabilities"], want["probabilities"], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(got["prediction"], want["prediction"])


def test_the_pyfunc_vets_a_pt2_as_predict_does(registered: dict[str, tuple[Path, str]], store: str,
                                               tmp_path: Path) -> None:
    """A registered .pt2 swapped for one whose shape expression runs a shell command when torch.export.load reads
    it: loading the model refuses it in one line, and nothing runs."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    from sigmanens_dist.registry import fetch_program

    program = fetch_program("models:/tiny-pt2@champion", store, tmp_path)
    marker = tmp_path / "pwned"
    reader = torch._C.PyTorchFileReader(str(registered["pt2"][0]))
    text = reader.get_record("models/model.json").decode()
    size = re.search(r"\"Symbol\('s\d+', positive=True, integer=True\)\"", text)
    assert size, "no symbolic size to replace: the test would prove nothing"
    evil = f"__import__('os').system('touch {marker}') or {size.group(0)[1:-1]}"
    with PT2ArchiveWriter(str(program)) as writer:
        for name in reader.get_all_records():
            if not name.startswith(".data/"):
                data = reader.get_record(name)
                if name == "models/model.json":
                    data = text.replace(size.group(0), json.dumps(evil), 1).encode()
                writer.write_bytes(name, data)
    with pytest.raises(mlflow.exceptions.MlflowException, match="refused: it holds the shape expression"):
        mlflow.pyfunc.load_model(str(program.parent.parent))
    assert not marker.exists()


def test_the_pyfunc_refuses_a_program_of_a_later_format(registered: dict[str, tuple[Path, str]], store: str,
                                                         tmp_path: Path) -> None:
    """The pyfunc reads the metadata with the program_meta.py logged beside it, as predict does: a registered .onnx
    whose metadata says sigmanens-program/99 is refused at load in one line naming both versions."""
    import onnx

    from sigmanens_dist.registry import fetch_program

    program = fetch_program("models:/tiny-onnx@champion", store, tmp_path)
    model = onnx.load(program)
    prop = next(p for p in model.metadata_props if p.key == "sigmanens.json")
    prop.value = json.dumps(json.loads(prop.value) | {"format": "sigmanens-program/99"})
    onnx.save(model, program)
    with pytest.raises(mlflow.exceptions.MlflowException,
                       match=r"says format sigmanens-program/99, .* reads sigmanens-program/1 to sigmanens-program/1"):
        mlflow.pyfunc.load_model(str(program.parent.parent))


# the code files a registered model carries, imported by name from their folder as MLflow's code path gives them
IMPORT_CODE_FILES = import_blocking("sigmanens_dist", "timm") + """
sys.path.insert(0, sys.argv[1])
import program_meta
assert "torch" not in sys.modules and "numpy" not in sys.modules, "program_meta.py imported beyond the standard library"
import program_check
print(program_meta.FORMAT_VERSION, program_check.ZIP_MAGIC)
"""


def test_the_files_logged_beside_the_pyfunc_import_alone(tmp_path: Path) -> None:
    """program_check.py and the metadata's program_meta.py import where sigmanens_dist and timm cannot
    (program_meta.py with the standard library alone), as a served model imports them."""
    from sigmanens_dist.registry.register import CODE_FILES

    for path in CODE_FILES:
        shutil.copy(path, tmp_path)
    proc = subprocess.run([sys.executable, "-c", IMPORT_CODE_FILES, str(tmp_path)], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "1"


@contextlib.contextmanager
def _served(model: str, store: str, folder: Path) -> Iterator[str]:
    """``mlflow models serve -m MODEL`` from the test's store, started and stopped here (by its PID); yields the
    invocations URL once the server answers (its log in FOLDER/serve.log)."""
    port = free_port()
    log = folder / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", model, "--env-manager", "local",
                             "-h", "127.0.0.1", "-p", str(port)], env={**env(), "MLFLOW_TRACKING_URI": store},
                            cwd=folder, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        assert wait_for_port(port, proc, 180), log.read_text()[-3000:]
        yield f"http://127.0.0.1:{port}/invocations"
    finally:
        stop_process(proc)


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_batch_and_refuses_bad_requests(registered: dict[str, tuple[Path, str]],
                                                                      store: str, tmp_path: Path) -> None:
    """``mlflow models serve -m models:/tiny-pt2@champion --env-manager local``: a POST of 7 images gets the
    program's outputs, and one of 3 PNG files (16×16, 40×40, 23×23) base64 in a ``dataframe_split`` column what
    ``sigmanens predict`` gives for those files (issue 53); a wrong shape, a NaN, values above 1 or below 0, a value
    that is not a number, a row that is not an image or not base64 and more than 1024 images are each a 400 whose
    message ends with the reason (naming the rows at fault), and the server keeps serving."""
    import requests

    with _served("models:/tiny-pt2@champion", store, tmp_path) as url:
        x = np.random.default_rng(1).random((7, 3, 16, 16), dtype=np.float32)
        answer = requests.post(url, json={"inputs": x.tolist()}, timeout=60)
        assert answer.status_code == 200, answer.text[-2000:]
        got, want = answer.json()["predictions"], _program_outputs(registered["pt2"][0], x)
        assert set(got) == set(want)
        np.testing.assert_allclose(np.array(got["probabilities"]), want["probabilities"], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.array(got["conformal_set"]), want["conformal_set"])
        nan = x.copy()
        nan[3, 1, 2, 5] = np.nan
        # image files as clients have them: base64 in a dataframe_split column, as `sigmanens predict` reads them
        photos = tmp_path / "photos"
        photos.mkdir()
        files = [_png(10 + i, side) for i, side in enumerate((16, 40, 23))]
        for i, data in enumerate(files):
            (photos / f"{i}.png").write_bytes(data)
        table = {"dataframe_split": {"columns": ["image"], "data": [[base64.b64encode(f).decode()] for f in files]}}
        answer = requests.post(url, json=table, timeout=60)
        assert answer.status_code == 200, answer.text[-2000:]
        assert main(["predict", str(registered["pt2"][0]), str(photos), "--out", str(tmp_path / "preds")]) == 0
        rows = _rows(tmp_path / "preds")
        np.testing.assert_allclose(np.array(answer.json()["predictions"]["probabilities"]),
                                   [rows[f"{photos.as_posix()}/{i}.png"]["probabilities"] for i in range(3)],
                                   atol=1e-6, rtol=0)
        nan = x.copy()
        nan[3, 1, 2, 5] = np.nan
        broken = [[base64.b64encode(files[0]).decode()], [base64.b64encode(b"garbage").decode()], ["%%%"]]
        bad = {"images of shape (7, 3, 8, 16); the program takes (B, 3, 16, 16)": {"inputs": x[:, :, :8].tolist()},
               "1 of 5376 values are NaN or infinite": {"inputs": nan.tolist()},
               "values from 0 to 2; give images in [0, 1]": {"inputs": (2 * np.round(x)).tolist()},
               "values from -1 to -1; give images in [0, 1]": {"inputs": (0 * x - 1).tolist()},
               "values of type <U1; give float32 images": {"inputs": [[[["a"] * 16] * 16] * 3]},
               "2 of 3 images cannot be used, so none is predicted: row 1: cannot decode row 1": {
                   "dataframe_split": {"columns": ["image"], "data": broken}},
               "row 2: text that is not base64": {"dataframe_split": {"columns": ["image"], "data": broken}},
               "1025 images in one request; at most 1024": {
                   "dataframe_split": {"columns": ["image"], "data": [["x"]] * 1025}}}
        for reason, payload in bad.items():
            answer = requests.post(url, data=json.dumps(payload), headers={"Content-Type": "application/json"},
                                   timeout=60)
            assert 400 <= answer.status_code < 500, (reason, answer.status_code, answer.text[-500:])
            assert reason in answer.json()["message"].splitlines()[-1], answer.json()["message"][-500:]
            if "values" in reason:  # the pyfunc's own refusals repeat at most 200 characters of the request
                assert len(answer.json()["message"]) < 600, answer.json()["message"][:1000]
        assert requests.post(url, json={"inputs": x[:1].tolist()}, timeout=60).status_code == 200


def _study(client: object, tmp_path: Path, experiment: str, vals: list[dict[str, float]]) -> tuple[str, list[Path]]:
    """A study parent with one child per entry of ``vals`` (its logged validation metrics, and a test NLL ordered
    against them), each child a copy of the fixture run whose weights differ (child i's scaled by 1 + i/2), so that
    their programs differ; the parent's id and the children's run directories."""
    experiment_id = client.create_experiment(experiment)
    parent = client.create_run(experiment_id, run_name="study", tags={ROLE_TAG: "parent"}).info.run_id
    runs = []
    for seed, metrics in enumerate(vals):
        name = f"sigma-M2-tau0.25-lam0-s{seed}"
        run, run_id = _run_dir(tmp_path / name, client, experiment_id, name, **{PARENT_TAG: parent})
        state = load_file(run / CKPT, "checkpoint")
        state["model"] = {k: v * (1 + seed / 2) if v.is_floating_point() else v for k, v in state["model"].items()}
        torch.save(state, run / CKPT)
        for key, value in {"model.method": "sigma", "model.num_members": 2, "reg.tau": 0.25, "seed": seed}.items():
            client.log_param(run_id, key, value)
        for key, value in {**metrics, "eval/test/raw/nll": 1 - seed / 10, "eval/test/raw/acc": 0.5}.items():
            client.log_metric(run_id, key, value)
        runs.append(run)
    return parent, runs


def _registered_probabilities(name: str, store: str, tmp_path: Path, x: np.ndarray) -> np.ndarray:
    from sigmanens_dist.registry import fetch_program

    return _program_outputs(fetch_program(f"models:/{name}@champion", store, tmp_path), x)["probabilities"]


def test_register_best_picks_the_lower_validation_nll(store: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Two children of a study whose validation and test orders differ and whose weights differ: --register-best
    registers the one with the lower validation NLL (its program, not the other's), and with --by val/acc the one
    with the higher accuracy, tagged with the study and the choice; a test metric for --by is one line, exit 2,
    before anything is read or registered."""
    client = mlflow.MlflowClient(store)
    parent, runs = _study(client, tmp_path, "register-best", [{"val/nll": 0.9, "val/acc": 0.7},
                                                             {"val/nll": 0.4, "val/acc": 0.6}])
    for by in ("eval/test/raw/nll", "test/nll"):
        assert main(["compare", "--parent", parent, "--uri", store, "--out", str(tmp_path / "out"),
                     "--register-best", "best", "--by", by]) == 2
        err = capsys.readouterr().err.strip()
        assert "a test-set metric" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not client.search_registered_models("name = 'best'")
    x = np.random.default_rng(2).random((5, 3, 16, 16), dtype=np.float32)
    own = []
    for i, run in enumerate(runs):  # each child's own program, for the registered one to equal
        export_program(load_trained(run / CKPT), tmp_path / f"own{i}.pt2")
        own.append(_program_outputs(tmp_path / f"own{i}.pt2", x)["probabilities"])
    assert not np.allclose(own[0], own[1], atol=1e-3), "the children's programs agree: the test proves nothing"
    for name, by, winner, value in (("best", "val/nll", 1, 0.4), ("best-acc", "val/acc", 0, 0.7)):
        assert main(["compare", "--parent", parent, "--uri", store, "--out", str(tmp_path / f"out-{name}"),
                     "--register-best", name, "--by", by, "--alias", "champion"]) == 0
        version = client.get_model_version_by_alias(name, "champion")
        assert version.run_id == load_file(runs[winner] / CKPT, "checkpoint")["mlflow_run_id"]
        assert version.tags["sigmanens.chosen_by"] == by and version.tags["sigmanens.study"] == parent
        assert float(version.tags["sigmanens.chosen_value"]) == value
        np.testing.assert_allclose(_registered_probabilities(name, store, tmp_path / name, x), own[winner],
                                   rtol=0, atol=1e-6)


def test_register_best_never_picks_a_diverged_child(store: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 2: a child whose validation NLL is NaN (a diverged run) was chosen when listed first. A
    non-finite metric is never best, in any order: the finite best is registered and each skipped child is named;
    a study of diverged children only is one line, exit 2, nothing registered."""
    from sigmanens_dist.experiments.compare import RunRecord
    from sigmanens_dist.registry.best import _best

    def record(name: str, nll: float) -> RunRecord:
        return RunRecord(run_id=name, name=name, status="FINISHED", method="sigma", members=2, tau=0.25, lam=0.0,
                         seed=0, split_values={"val": {"nll": nll}})

    values = {"diverged": float("nan"), "worse": 0.9, "exploded": float("inf"), "best": 0.4}
    for order in itertools.permutations(values):
        best, value, among = _best([record(name, values[name]) for name in order], "val/nll")
        assert (best.name, value, among) == ("best", 0.4, 2), order
    capsys.readouterr()
    client = mlflow.MlflowClient(store)
    parent, runs = _study(client, tmp_path, "register-best-nan", [{"val/nll": float("nan")}, {"val/nll": 0.9}])
    assert main(["compare", "--parent", parent, "--uri", store, "--out", str(tmp_path / "out"),
                 "--register-best", "finite", "--alias", "champion"]) == 0
    assert "skipped sigma-M2-tau0.25-lam0-s0: its val/nll is nan (the run diverged)" in capsys.readouterr().out
    version = client.get_model_version_by_alias("finite", "champion")
    assert version.run_id == load_file(runs[1] / CKPT, "checkpoint")["mlflow_run_id"]
    parent, _ = _study(client, tmp_path / "all", "register-best-all-nan", [{"val/nll": float("nan")}])
    assert main(["compare", "--parent", parent, "--uri", store, "--out", str(tmp_path / "all" / "out"),
                 "--register-best", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --register-best: no compared run has a finite value of val/nll (logged by the training " \
        "loop's validation)"
    assert not client.search_registered_models("name = 'none'")


def test_register_of_a_run_not_in_the_store_is_refused_before_the_program_is_written(
        store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Review item 2: a checkpoint whose MLflow run the store does not hold is refused in one line, exit 2, before
    the program is exported (OUT not written, so a rerun needs no --force)."""
    run = shutil.copytree(FIXTURE, tmp_path / "run")
    state = load_file(run / CKPT, "checkpoint")
    torch.save({**state, "mlflow_run_id": "0" * 32}, run / CKPT)
    out = tmp_path / "model.pt2"
    assert main(["export", str(run), "--program", str(out), "--register", "tiny", "--tracking-uri", store]) == 2
    assert capsys.readouterr().err == (f"sigmanens export: error: --register: the run's MLflow run {'0' * 32} is "
                                       f"not in {store}; give the store it was tracked in (--tracking-uri)\n")
    assert not out.exists()


def _png(seed: int, side: int = 16) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def test_predict_a_registered_program_equals_predict_of_its_file(registered: dict[str, tuple[Path, str]],
                                                                  store: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``sigmanens predict models:/tiny-pt2@champion`` (and ``models:/tiny-pt2/1``) writes what ``sigmanens predict
    model.pt2`` writes for the same images, its manifest and summary naming the URI (not the temporary download,
    deleted after); a name the registry lacks is one line, exit 2, nothing written."""
    import pyarrow.parquet as pq

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(7):
        (photos / f"{i}.png").write_bytes(_png(i))
    rows = {}
    for label, program in {"file": str(registered["pt2"][0]), "alias": "models:/tiny-pt2@champion",
                           "version": "models:/tiny-pt2/1"}.items():
        uri = [] if label == "file" else ["--tracking-uri", store]
        assert main(["predict", program, str(photos), "--out", str(tmp_path / label), *uri]) == 0
        rows[label] = [row for part in sorted((tmp_path / label / "parts").glob("*.parquet"))
                       for row in pq.read_table(part).to_pylist()]
    assert len(rows["file"]) == 7 and rows["alias"] == rows["file"] == rows["version"]
    for label, named in (("alias", "models:/tiny-pt2@champion"), ("version", "models:/tiny-pt2/1")):
        for record in ("manifest.json", "summary.json"):  # the URI given, not the deleted temporary download
            assert json.loads((tmp_path / label / record).read_text())["program"]["path"] == named
    capsys.readouterr()
    assert main(["predict", "models:/nope@champion", str(photos), "--out", str(tmp_path / "nope"),
                 "--tracking-uri", store]) == 2
    err = capsys.readouterr().err.strip()
    assert "not in the registry" in err and len(err.splitlines()) == 1 and not (tmp_path / "nope").exists()


def _tracked_copy(tmp_path: Path, store: str, name: str) -> Path:
    client = mlflow.MlflowClient(store)
    return _run_dir(tmp_path / name, client, client.create_experiment(name), name)[0]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sigmanens export: error: "), err
    return err


def test_names_and_stores_mlflow_refuses_are_one_line_before_anything_is_written(
        store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, findings 4 and 5: a registered name MLflow refuses ('..'), a store of a scheme MLflow's registry
    lacks, a folder (MLflow's file store) and a sqlite file that is not there are each one line, exit 2, with the
    program not written and no database created; a name with '.' (MLflow takes it) registers and predicts."""
    run = _tracked_copy(tmp_path, store, "names")
    out = tmp_path / "model.pt2"
    typo = tmp_path / "no-such-folder" / "mlflow.db"
    for flags, reason in (
            (["--register", ".."], "--register '..': MLflow refuses it as a registered model's name"),
            (["--register", "ok", "--tracking-uri", "foo://bar"],
             "tracking store 'foo://bar': MLflow's Model Registry has no store of scheme 'foo'"),
            (["--register", "ok", "--tracking-uri", str(tmp_path)],
             f"tracking store {tmp_path}: a folder (MLflow's file store)"),
            (["--register", "ok", "--tracking-uri", f"sqlite:///{typo}"], f"no such sqlite file '{typo}'")):
        assert main(["export", str(run), "--program", str(out), *flags]) == 2, flags
        assert reason in _one_line(capsys)
        assert not out.exists() and not typo.parent.exists()
    assert main(["export", str(run), "--program", str(out), "--register", "fmnist.v2", "--alias", "champion"]) == 0
    x = np.random.default_rng(3).random((3, 3, 16, 16), dtype=np.float32)
    np.testing.assert_allclose(_registered_probabilities("fmnist.v2", store, tmp_path / "got", x),
                               _program_outputs(out, x)["probabilities"], rtol=0, atol=1e-6)


def test_a_server_that_goes_away_during_the_registration_is_one_line_exit_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 6: the tracking server stopping while ``export --register`` logs the model was a 214-line
    traceback. It is one line, exit 1 (a batch script retries it), saying what was left."""
    (tmp_path / "server").mkdir()
    with mlflow_server(tmp_path / "server" / "mlflow.db") as url:
        run = _tracked_copy(tmp_path, url, "gone")
        port = int(url.rpartition(":")[2])
        log = mlflow.models.Model.log

        def stop_then_log(*args: object, **kwargs: object) -> object:
            for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):  # the server, by its command line
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if b"server" in argv and str(port).encode() in argv:
                        os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    time.sleep(0.2)
                    continue
                break
            return log(*args, **kwargs)

        monkeypatch.setattr(mlflow.models.Model, "log", stop_then_log)
        assert main(["export", str(run), "--program", str(tmp_path / "model.pt2"), "--register", "gone"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"sigmanens export: error: the tracking server {url} does not answer") and \
        "(it stopped answering during the registration (nothing registered; maybe a logged model " \
        "'sigmanens-program' left PENDING in run" in err, err


def test_registering_leaves_mlflow_pointed_where_it_was(store: str, tmp_path: Path) -> None:
    """A registration points MLflow's global URI (and MLFLOW_TRACKING_URI, which subprocesses inherit) at its store
    only while it logs the model: a later trainer or Slurm job of the same process must not write there."""
    run = _tracked_copy(tmp_path, store, "globals")
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID")
    before = [os.environ.get(name) for name in names]
    assert main(["export", str(run), "--program", str(tmp_path / "model.pt2"), "--register", "globals"]) == 0
    assert [os.environ.get(name) for name in names] == before


def test_export_register_reads_the_checkpoint_once_and_asks_the_registry_once(store: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 54: ``export --register`` reads the checkpoint once (the registration's run id comes from the same
    read as the program) and checks the registration once, before the program is written."""
    from sigmanens_dist import models as load
    from sigmanens_dist import registry

    calls: dict[str, int] = {"load_trained": 0, "check_registration": 0}

    def counted(module: object, name: str) -> None:
        real = getattr(module, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(load, "load_trained")
    counted(registry, "check_registration")
    run = _tracked_copy(tmp_path, store, "once")
    assert main(["export", str(run), "--program", str(tmp_path / "model.pt2"), "--register", "once"]) == 0
    assert calls == {"load_trained": 1, "check_registration": 1}


def test_predict_of_a_version_whose_files_are_gone_is_one_line(store: str, store_dir: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 51, finding 7: a registered version whose artifacts were deleted from the store was a 29-line
    traceback ("No such artifact: 'MLmodel'") from ``predict models:/…``; it is one line, exit 2, nothing written."""
    run = _tracked_copy(tmp_path, store, "deleted")
    assert main(["export", str(run), "--program", str(tmp_path / "model.pt2"), "--register", "deleted",
                 "--alias", "champion"]) == 0
    version = mlflow.MlflowClient(store).get_model_version_by_alias("deleted", "champion")
    model_id = version.source.rpartition("/")[2]  # models:/m-…: the logged model's id
    folder = next(p.parent for p in (store_dir / "mlartifacts").rglob("MLmodel") if model_id in p.as_posix())
    shutil.rmtree(folder)
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.png").write_bytes(_png(0))
    capsys.readouterr()
    assert main(["predict", "models:/deleted@champion", str(photos), "--out", str(tmp_path / "out"),
                 "--tracking-uri", store]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its files are gone from the artifact store (no MLmodel there)" in err, err
    assert not (tmp_path / "out").exists()


def test_the_pyfunc_refuses_one_image_for_a_program_of_batch_statistics_alone(
        registered: dict[str, tuple[Path, str]], store: str, tmp_path: Path) -> None:
    """Issue 51, finding 1: served one image per request, a program of batch statistics alone (prior 0) answered
    the same for every image. The pyfunc refuses a request of one image (a 400 when served), and answers two as the
    program does."""
    from sigmanens_dist.registry import fetch_program

    run = untrained_run(tmp_path / "run", BATCHNORM_RUN)
    program = fetch_program("models:/tiny-onnx@champion", store, tmp_path / "model")
    export_program(load_trained(run / "checkpoints" / "step_00000000.pt"), program, fmt="onnx", norm_stats="batch")
    model = mlflow.pyfunc.load_model(str(program.parent.parent))
    x = np.random.default_rng(4).random((2, 3, 16, 16), dtype=np.float32)
    with pytest.raises(mlflow.exceptions.MlflowException, match=r"1 image in the request, and this program "
                                                                r"normalises each batch by that batch's own"):
        model.predict(x[:1])
    np.testing.assert_allclose(model.predict(x)["probabilities"], _program_outputs(program, x)["probabilities"],
                               rtol=0, atol=1e-6)


def _rows(out: Path) -> dict[str, dict]:
    """``sigmanens predict``'s rows in ``out``, by id."""
    import pyarrow.parquet as pq

    parts = sorted((out / "parts").glob("*.parquet"))
    return {row["id"]: row for part in parts for row in pq.read_table(part).to_pylist()}


@pytest.mark.parametrize(("recipe", "channels", "side"), [("grayscale", 1, 28), ("rgb", 3, 224)])
def test_the_pyfunc_takes_image_files_as_predict_does(registered: dict[str, tuple[Path, str]], store: str,
                                                      tmp_path: Path, recipe: str, channels: int, side: int) -> None:
    """Issue 53: a registered program of a 28 × 28 grayscale recipe and of a 224 × 224 RGB one takes a column of
    image files (bytes from pandas or Spark, base64 text from JSON) of any size and 8-bit mode and returns, in order,
    what ``sigmanens predict`` returns for the same files."""
    from sigmanens_dist.registry import fetch_program

    run = untrained_run(tmp_path / "run", [*BATCHNORM_RUN[:3], f"data.img_size={side}", f"model.in_chans={channels}",
                                           *BATCHNORM_RUN[4:]])
    program = fetch_program("models:/tiny-onnx@champion", store, tmp_path / "model")  # its code files, this program
    export_program(load_trained(run / "checkpoints" / "step_00000000.pt"), program, fmt="onnx")
    model = mlflow.pyfunc.load_model(str(program.parent.parent))
    rng = np.random.default_rng(side)
    photos = tmp_path / "photos"
    photos.mkdir()
    images = {"a.png": Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)),
              "b.jpg": Image.fromarray(rng.integers(0, 256, (side + 9, side // 2 + 5, 3), dtype=np.uint8)),
              "c.png": Image.fromarray(rng.integers(0, 256, (side // 2, side, 4), dtype=np.uint8), "RGBA"),
              "d.webp": Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8), "L")}
    for name, image in images.items():
        image.save(photos / name)
    files = [(photos / name).read_bytes() for name in images]
    import pandas as pd

    raw = model.predict(pd.DataFrame({"image": files}))
    text = model.predict(pd.DataFrame({"content": [base64.b64encode(f).decode() for f in files]}))
    assert main(["predict", str(program), str(photos), "--out", str(tmp_path / "preds")]) == 0
    rows = _rows(tmp_path / "preds")
    want = np.array([rows[f"{photos.as_posix()}/{name}"]["probabilities"] for name in images])
    np.testing.assert_allclose(raw["probabilities"], want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(text["probabilities"], want, rtol=0, atol=1e-6)
    assert raw["probabilities"].shape == (4, 10) and not np.allclose(want[0], want[1], atol=1e-4)


@pytest.mark.slow  # a local Spark session: about a minute
def test_spark_udf_over_a_folder_of_image_files_equals_predict(registered: dict[str, tuple[Path, str]], store: str,
                                                               tmp_path: Path) -> None:
    """Issue 53: offline scoring on an engine a user already has. ``mlflow.pyfunc.spark_udf`` of the registered
    program over a Spark DataFrame of 1,000 image files (``binaryFile``, sizes 16–20 × 16) gives, file by file, what
    ``sigmanens predict`` gives for the same folder."""
    pyspark = pytest.importorskip("pyspark")  # the spark extra: installed by launch/setup.sh
    from pyspark.sql import SparkSession

    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(9)
    for i in range(1000):
        Image.fromarray(rng.integers(0, 256, (16 + i % 5, 16, 3), dtype=np.uint8)).save(photos / f"{i:04d}.png")
    assert main(["predict", str(registered["pt2"][0]), str(photos), "--out", str(tmp_path / "preds")]) == 0
    rows = _rows(tmp_path / "preds")
    spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
    before = os.environ.get("MLFLOW_TRACKING_URI")  # set_tracking_uri exports it to every later subprocess
    try:
        mlflow.set_tracking_uri(store)
        udf = mlflow.pyfunc.spark_udf(spark, "models:/tiny-pt2@champion", env_manager="local",
                                      result_type="prediction long, confidence float, probabilities array<float>")
        frame = spark.read.format("binaryFile").load(str(photos))
        scored = frame.select("path", udf("content").alias("p")).select("path", "p.*").toPandas()
    finally:
        spark.stop()
        mlflow.set_tracking_uri(before)
    assert pyspark.__version__ and len(scored) == 1000
    got = {Path(path.removeprefix("file:")).as_posix(): row for path, row in zip(
        scored["path"], scored[["prediction", "confidence", "probabilities"]].to_dict("records"), strict=True)}
    assert sorted(got) == sorted(rows)
    for key, want in rows.items():
        assert got[key]["prediction"] == want["prediction"], key
        np.testing.assert_allclose(np.asarray(got[key]["probabilities"]), want["probabilities"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_served_one_image_per_request_gives_evals_mixed_numbers_at_batch_one(store: str, tmp_path: Path) -> None:
    """Issue 52: ``eval --shift-batches mixed --batch-size 1 --norm-stats batch --norm-stats-prior 16`` scores the
    stream as a service meets it, one image per prediction; the program of those statistics, registered and served
    by ``mlflow models serve``, given the stream's PNG files one per request (base64, in order), answers each as
    eval scored it: every cell, the stream's clean images and the overall."""
    import csv

    import requests

    from tests.helpers import FMNIST_RUN, MIXED_CELLS, MIXED_SUBSET, scored_cell

    client = mlflow.MlflowClient(store)
    run = untrained_run(tmp_path / "run", FMNIST_RUN, in_chans=1, spread=0.1)
    _track(run, run / "checkpoints" / "step_00000000.pt", client, client.create_experiment("mixed-serve"), "run")
    prior = ["--norm-stats", "batch", "--norm-stats-prior", "16"]
    assert main(["export", str(run), "--program", str(tmp_path / "prior16.pt2"), *prior, "--register", "mixed-prior",
                 "--alias", "champion"]) == 0
    stream = tmp_path / "stream"
    assert main(["eval", "--checkpoint", str(run), "--corruptions", ",".join(MIXED_CELLS), "--severities", "5", *prior,
                 "--shift-batches", "mixed", "--batch-size", "1", "--no-sub-ensembles", "--no-mlflow", "--data",
                 f"test_subset={MIXED_SUBSET}", "--stream-images", str(stream), "--out", str(tmp_path / "eval")]) == 0
    part = json.loads((tmp_path / "eval" / "eval.json").read_text())["weights"]["raw"]
    with open(stream / "stream.csv") as f:
        table = list(csv.DictReader(f))
    probabilities = []
    with _served("models:/mixed-prior@champion", store, tmp_path) as url, requests.Session() as session:
        for row in table:
            image = base64.b64encode((stream / row["file"]).read_bytes()).decode()
            answer = session.post(url, timeout=60,
                                  json={"dataframe_split": {"columns": ["image"], "data": [[image]]}})
            assert answer.status_code == 200, answer.text[-2000:]
            probabilities += answer.json()["predictions"]["probabilities"]
    log_probs = torch.tensor(probabilities, dtype=torch.float64).log()
    target = torch.tensor([int(row["label"]) for row in table])
    groups = [row["corruption"] for row in table]
    for name, want in (("overall", part["shift_stream"]["overall"]), ("", part["shift_stream"]["clean"]),
                       *((n, part["shift"][n]["5"]) for n in MIXED_CELLS)):
        rows = torch.tensor([name in ("overall", g) for g in groups])
        for key, value in scored_cell(log_probs[rows], target[rows]).items():
            assert want[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name or "clean", key)


@pytest.mark.slow
def test_curl_of_a_base64_file_to_a_served_224_rgb_program_gives_what_predict_gives(store: str,
                                                                                     tmp_path: Path) -> None:
    """Issue 53, over HTTP for a 224 × 224 RGB recipe's program (the 28 × 28 grayscale one: the test above): docs/
    deploy.md's ``curl`` of image files base64 in a ``dataframe_split`` column — a 224 × 224 PNG, a larger JPEG, an
    RGBA PNG and a grayscale WebP — to ``mlflow models serve`` of the registered program answers, row by row, what
    ``sigmanens predict`` gives for those files."""
    client = mlflow.MlflowClient(store)
    run = untrained_run(tmp_path / "run", [*BATCHNORM_RUN[:3], "data.img_size=224", *BATCHNORM_RUN[4:]], spread=0.1)
    _track(run, run / "checkpoints" / "step_00000000.pt", client, client.create_experiment("rgb-serve"), "run")
    program = tmp_path / "rgb224.onnx"
    assert main(["export", str(run), "--program", str(program), "--register", "rgb224", "--alias", "champion"]) == 0
    rng = np.random.default_rng(224)
    photos = tmp_path / "photos"
    photos.mkdir()
    images = {"a.png": Image.fromarray(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)),
              "b.jpg": Image.fromarray(rng.integers(0, 256, (300, 260, 3), dtype=np.uint8)),
              "c.png": Image.fromarray(rng.integers(0, 256, (120, 224, 4), dtype=np.uint8), "RGBA"),
              "d.webp": Image.fromarray(rng.integers(0, 256, (224, 224), dtype=np.uint8), "L")}
    for name, image in images.items():
        image.save(photos / name)
    assert main(["predict", str(program), str(photos), "--out", str(tmp_path / "preds")]) == 0
    rows = _rows(tmp_path / "preds")
    want = np.array([rows[f"{photos.as_posix()}/{name}"]["probabilities"] for name in images])
    column = [[base64.b64encode((photos / name).read_bytes()).decode()] for name in images]
    (tmp_path / "request.json").write_text(json.dumps({"dataframe_split": {"columns": ["image"], "data": column}}))
    with _served("models:/rgb224@champion", store, tmp_path) as url:
        answer = subprocess.run(["curl", "-sS", "--fail-with-body", url, "-H", "Content-Type: application/json",
                                 "-d", f"@{tmp_path / 'request.json'}"], capture_output=True, text=True, timeout=120,
                                check=False)
    assert answer.returncode == 0, answer.stdout[-2000:] + answer.stderr[-2000:]
    got = json.loads(answer.stdout)["predictions"]
    np.testing.assert_allclose(np.array(got["probabilities"]), want, rtol=0, atol=1e-6)
    assert [rows[f"{photos.as_posix()}/{name}"]["prediction"] for name in images] == got["prediction"]
    assert not np.allclose(want[0], want[1], atol=1e-4)  # the images are told apart: a row is not every row's answer
