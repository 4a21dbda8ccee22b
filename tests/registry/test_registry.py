"""A program in MLflow's Model Registry, against a real tracking server (sqlite, started and stopped here):
``sigmanens export --register`` logs it into the run's own MLflow run and registers it under an alias;
``mlflow.pyfunc.load_model("models:/NAME@ALIAS")`` runs it where sigmanens_dist and timm (for ONNX: torch too) cannot
be imported, equal to the program; the pyfunc vets a .pt2 as predict does; ``mlflow models serve`` answers a batch
over HTTP and refuses bad requests with a 4xx; ``sigmanens compare --register-best`` registers the child best on
validation NLL, never on a test metric; ``sigmanens predict models:/NAME@ALIAS`` equals ``sigmanens predict FILE``."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sigmanens_dist.cli import main
from sigmanens_dist.experiments.study import ROLE_TAG
from sigmanens_dist.predict.backends import load_program
from sigmanens_dist.safe_load import load_file
from sigmanens_dist.training.tracking import PARENT_TAG, RUN_ID_FILE
from tests.helpers import FIXTURE, env, free_port, import_blocking, mlflow_server, stop_process, wait_for_port

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("onnxruntime")

CKPT = Path("checkpoints") / "step_00000002.pt"
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
    mlflow_run = client.create_run(experiment_id, run_name=name, tags=tags)
    run_id = mlflow_run.info.run_id
    state = load_file(run / CKPT, "checkpoint")
    torch.save({**state, "mlflow_run_id": run_id}, run / CKPT)
    (run / RUN_ID_FILE).write_text(f"{client.tracking_uri}\n{run_id}\n")
    client.log_param(run_id, "run_dir", str(run))
    client.set_terminated(run_id)
    return run, run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("registry") / "mlflow.db") as url:
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
    """The pyfunc reads the metadata with the format.py logged beside it, as predict does: a registered .onnx whose
    metadata says sigmanens-program/99 is refused at load in one line naming both versions."""
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
import format
assert "torch" not in sys.modules and "numpy" not in sys.modules, "format.py imported more than the standard library"
import program_check
print(format.FORMAT_VERSION, program_check.ZIP_MAGIC)
"""


def test_the_files_logged_beside_the_pyfunc_import_alone(tmp_path: Path) -> None:
    """program_check.py and the metadata's format.py import where sigmanens_dist and timm cannot (format.py with
    the standard library alone), as a served model imports them."""
    from sigmanens_dist.registry.register import CODE_FILES

    for path in CODE_FILES:
        shutil.copy(path, tmp_path)
    proc = subprocess.run([sys.executable, "-c", IMPORT_CODE_FILES, str(tmp_path)], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == "1"


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_batch_and_refuses_bad_requests(registered: dict[str, tuple[Path, str]],
                                                                      store: str, tmp_path: Path) -> None:
    """``mlflow models serve -m models:/tiny-pt2@champion --env-manager local``: a POST of 7 images gets the
    program's outputs; a wrong shape, a NaN and a value that is not a number are each a 400 whose message ends with
    the reason, and the server keeps serving."""
    import requests

    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/tiny-pt2@champion",
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                            env={**env(), "MLFLOW_TRACKING_URI": store}, cwd=tmp_path, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        assert wait_for_port(port, proc, 180), log.read_text()[-3000:]
        url = f"http://127.0.0.1:{port}/invocations"
        x = np.random.default_rng(1).random((7, 3, 16, 16), dtype=np.float32)
        answer = requests.post(url, json={"inputs": x.tolist()}, timeout=60)
        assert answer.status_code == 200, answer.text[-2000:]
        got, want = answer.json()["predictions"], _program_outputs(registered["pt2"][0], x)
        assert set(got) == set(want)
        np.testing.assert_allclose(np.array(got["probabilities"]), want["probabilities"], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.array(got["conformal_set"]), want["conformal_set"])
        nan = x.copy()
        nan[3, 1, 2, 5] = np.nan
        bad = {"Shape of input (7, 3, 8, 16) does not match": {"inputs": x[:, :, :8].tolist()},
               "1 of 5376 values are NaN or infinite": {"inputs": nan.tolist()},
               "could not convert string to float": {"inputs": [[[["a"] * 16] * 16] * 3]}}
        for reason, payload in bad.items():
            answer = requests.post(url, data=json.dumps(payload), headers={"Content-Type": "application/json"},
                                   timeout=60)
            assert 400 <= answer.status_code < 500, (reason, answer.status_code, answer.text[-500:])
            assert reason in answer.json()["message"].splitlines()[-1], answer.json()["message"][-500:]
        assert requests.post(url, json={"inputs": x[:1].tolist()}, timeout=60).status_code == 200
    finally:
        stop_process(proc)


def test_register_best_picks_the_lower_validation_nll(store: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Two children of a study whose validation and test orders differ: --register-best registers the one with the
    lower validation NLL, tagged with the study and the choice; a test metric for --by is one line, exit 2, before
    anything is read or registered."""
    client = mlflow.MlflowClient(store)
    experiment = client.create_experiment("register-best")
    parent = client.create_run(experiment, run_name="study", tags={ROLE_TAG: "parent"}).info.run_id
    children = {}
    for seed, (val_nll, test_nll) in enumerate([(0.9, 0.3), (0.4, 0.8)]):
        name = f"sigma-M2-tau0.25-lam0-s{seed}"
        _, run_id = _run_dir(tmp_path / name, client, experiment, name, **{PARENT_TAG: parent})
        for key, value in {"model.method": "sigma", "model.num_members": 2, "reg.tau": 0.25, "seed": seed}.items():
            client.log_param(run_id, key, value)
        for key, value in {"val/nll": val_nll, "val/acc": 0.5, "eval/test/raw/nll": test_nll,
                           "eval/test/raw/acc": 0.5}.items():
            client.log_metric(run_id, key, value)
        children[seed] = run_id
    for by in ("eval/test/raw/nll", "test/nll"):
        assert main(["compare", "--parent", parent, "--uri", store, "--out", str(tmp_path / "out"),
                     "--register-best", "best", "--by", by]) == 2
        err = capsys.readouterr().err.strip()
        assert "a test-set metric" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not client.search_registered_models("name = 'best'")
    assert main(["compare", "--parent", parent, "--uri", store, "--out", str(tmp_path / "out"),
                 "--register-best", "best", "--alias", "champion"]) == 0
    version = client.get_model_version_by_alias("best", "champion")
    assert version.run_id == children[1], "the lower validation NLL (the higher test NLL) wins"
    assert version.tags["sigmanens.chosen_by"] == "val/nll" and version.tags["sigmanens.study"] == parent
    assert float(version.tags["sigmanens.chosen_value"]) == 0.4


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


def _png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (16, 16, 3)).astype(np.uint8)
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
