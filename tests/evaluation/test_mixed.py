"""``sigmanens eval --shift-batches mixed`` (issue 52): one shuffled stream of every corruption × severity and the
clean images; every image answered once, its cells and overall the same predictions regrouped (checked against the
member logits the model returned), training statistics independent of the batch size, batch statistics not, the
lone last image predicted beside the batch before it; the stream written as PNG files and given to ``sigmanens
predict`` gives eval's numbers; the refusals come before any work."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from sigmanens_dist.cli import main
from sigmanens_dist.config import EvalConfig
from sigmanens_dist.evaluation import run as run_module
from sigmanens_dist.evaluation import run_eval
from sigmanens_dist.evaluation.mixed import stream_batches
from sigmanens_dist.export.program import export_program
from sigmanens_dist.inference.scores import ensemble_log_probs
from sigmanens_dist.models import load_trained
from sigmanens_dist.training.run_lock import LOCK_FILE, RunLock
from tests.helpers import FMNIST_RUN, MIXED_CELLS, MIXED_SUBSET, scored_cell, untrained_run


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = untrained_run(tmp_path_factory.mktemp("mixed") / "run", FMNIST_RUN, in_chans=1, spread=0.1)
    return run / "checkpoints" / "step_00000000.pt"


def _options(**kwargs: object) -> EvalConfig:
    return EvalConfig(corruptions=MIXED_CELLS, severities=[5], sub_ensembles=False, shift_batches="mixed", **kwargs)


def _eval(checkpoint: Path, options: EvalConfig, out: Path) -> dict:
    loaded = load_trained(checkpoint, [f"data.test_subset={MIXED_SUBSET}"])
    return run_eval(loaded.cfg, loaded.model, options=options, out_dir=out)["weights"]["raw"]


def _close(got: dict, want: dict, what: object) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, key)


def test_stream_batches_answer_every_position_once_and_keep_a_lone_image_company() -> None:
    for n, size, least in ((81, 8, 2), (81, 8, 1), (80, 8, 2), (5, 1, 1), (9, 4, 2), (2, 8, 2)):
        answered: list[int] = []
        batches = list(stream_batches(n, size, least))
        for positions, company in batches:
            assert len(positions) >= least and len(positions) <= size, (n, size, least)
            answered += positions[company:].tolist()
        assert answered == list(range(n)), (n, size, least)
    (last, company), (before, _) = batches_of(81, 8, 2)[-1], batches_of(81, 8, 2)[-2]
    assert company == 7 and last.tolist() == [*before[1:].tolist(), 80]  # the lone image beside the batch before
    assert batches_of(81, 8, 1)[-1][0].tolist() == [80]  # with a prior, one image is a batch


def batches_of(n: int, size: int, least: int) -> list[tuple[torch.Tensor, int]]:
    return list(stream_batches(n, size, least))


def test_the_mixed_stream_regroups_the_predictions_of_every_image_once(checkpoint: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each cell, the stream's clean images and the overall are the accuracy, NLL and ECE of the logits the model
    returned for that group's images (recorded at the model's output, each image once); the batches mix the groups;
    eval.json and eval.md record the protocol."""
    recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = run_module.score_stream

    def recording(*args: object) -> None:
        *head, update = args

        def spy(logits: torch.Tensor, target: torch.Tensor, group: torch.Tensor) -> None:
            recorded.append((logits.double(), target, group))
            update(logits, target, group)

        real(*head, spy)

    monkeypatch.setattr(run_module, "score_stream", recording)
    part = _eval(checkpoint, _options(batch_size=8), tmp_path / "o")
    logits, target, group = (torch.cat(parts, dim) for parts, dim in zip(zip(*recorded, strict=True), (1, 0, 0),
                                                                         strict=True))
    assert len(target) == 3 * MIXED_SUBSET and [int((group == g).sum()) for g in range(3)] == [MIXED_SUBSET] * 3
    assert min(len(g.unique()) for _, _, g in recorded[:-1]) >= 2  # the batches mix the groups
    log_probs = ensemble_log_probs(logits)
    _close(part["shift_stream"]["overall"], scored_cell(log_probs, target), "overall")
    _close(part["shift_stream"]["clean"], scored_cell(log_probs[group == 0], target[group == 0]), "clean")
    for g, name in enumerate(MIXED_CELLS, start=1):
        _close(part["shift"][name]["5"], scored_cell(log_probs[group == g], target[group == g]), name)
    report = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert report["shift_batches"] == {"composition": "mixed", "batch_size": 8, "images": 81, "order_seed": 0}
    md = (tmp_path / "o" / "eval.md").read_text()
    assert "Mixed stream (81 images" in md and "| overall |" in md and "| clean (stream) |" in md


def test_training_statistics_do_not_depend_on_the_batch_but_batch_statistics_do(checkpoint: Path,
                                                                                 tmp_path: Path) -> None:
    """The stream holds the same images at any batch size; with the training statistics a prediction is the image's
    alone, so batches of 8 or of 5 give the same cells.
    With each batch's statistics the cells depend on what the batches hold: mixed differs from per-corruption."""
    eight, five = (_eval(checkpoint, _options(batch_size=b), tmp_path / f"b{b}") for b in (8, 5))
    for name in MIXED_CELLS:
        _close(five["shift"][name]["5"], {k: eight["shift"][name]["5"][k] for k in ("acc", "nll", "ece")}, name)
    mixed = _eval(checkpoint, _options(batch_size=8, norm_stats="batch"), tmp_path / "mixed")
    alone = _eval(checkpoint, _options(batch_size=8, norm_stats="batch").model_copy(
        update={"shift_batches": "per-corruption"}), tmp_path / "alone")
    assert "shift_stream" not in alone
    for name in MIXED_CELLS:
        assert abs(mixed["shift"][name]["5"]["nll"] - alone["shift"][name]["5"]["nll"]) > 1e-3, name


def _rows(out: Path) -> dict[str, list[float]]:
    import pyarrow.parquet as pq

    return {Path(row["id"]).name: row["probabilities"] for path in sorted((out / "parts").iterdir())
            for row in pq.read_table(path).to_pylist()}


@pytest.mark.slow
def test_predict_over_the_written_stream_gives_evals_mixed_numbers(checkpoint: Path, tmp_path: Path) -> None:
    """``eval --shift-batches mixed --stream-images DIR`` writes the stream as PNG files; a program of the same
    statistics (each batch's alone, prior 0) given DIR through ``sigmanens predict --batch-size 8`` answers each
    image as eval scored it: every cell, the clean images and the overall, the lone last image included."""
    stream = tmp_path / "stream"
    assert main(["eval", "--checkpoint", str(checkpoint), "--corruptions", ",".join(MIXED_CELLS), "--severities", "5",
                 "--shift-batches", "mixed", "--batch-size", "8", "--norm-stats", "batch", "--no-sub-ensembles",
                 "--no-mlflow", "--data", f"test_subset={MIXED_SUBSET}", "--stream-images", str(stream),
                 "--out", str(tmp_path / "eval")]) == 0
    part = json.loads((tmp_path / "eval" / "eval.json").read_text())["weights"]["raw"]
    export_program(load_trained(checkpoint), tmp_path / "batch.pt2", norm_stats="batch")
    assert main(["predict", str(tmp_path / "batch.pt2"), str(stream), "--batch-size", "8",
                 "--out", str(tmp_path / "pred")]) == 0
    probabilities = _rows(tmp_path / "pred")
    with open(stream / "stream.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["file"] for row in table] == sorted(probabilities) and len(table) == 3 * MIXED_SUBSET
    log_probs = torch.tensor([probabilities[row["file"]] for row in table], dtype=torch.float64).log()
    target = torch.tensor([int(row["label"]) for row in table])
    groups = [row["corruption"] for row in table]
    _close(part["shift_stream"]["overall"], scored_cell(log_probs, target), "overall")
    for name, want in (("", part["shift_stream"]["clean"]), *((n, part["shift"][n]["5"]) for n in MIXED_CELLS)):
        rows = torch.tensor([g == name for g in groups])
        _close(want, scored_cell(log_probs[rows], target[rows]), name or "clean")


@pytest.mark.parametrize(("args", "match"), [
    (["--corruptions", "contrast", "--stream-images", "{tmp}/s"],
     r"--stream-images .*/s: writes the stream of --shift-batches mixed \(this run: per-corruption\)"),
    (["--shift-batches", "mixed"], r"--shift-batches mixed mixes the corruptions asked for with the clean images: "
                                   r"give --corruptions"),
    (["--norm-stats", "batch", "--batch-size", "1"], r"--batch-size 1 with --norm-stats batch and prior 0: one image "
                                                     r"normalised by its own statistics"),
    (["--shift-batches", "mixed", "--corruptions", "fog", "--stream-images", "{tmp}/full"],
     r"--stream-images .*/full: the folder is not empty"),
])
def test_refusals_are_one_line_before_any_work(checkpoint: Path, tmp_path: Path, args: list[str], match: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.png").write_bytes(b"not the stream's")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["eval", "--checkpoint", str(checkpoint), "--no-mlflow", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()
    assert (tmp_path / "full" / "mine.png").read_bytes() == b"not the stream's"


def test_a_stream_folder_another_evaluation_is_writing_is_refused(checkpoint: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Two evaluations started at once into one new ``--stream-images`` folder both found it empty: the folder is
    locked while its stream is written, so the second is one line naming the first and writes nothing there; once
    the first is done, the folder it filled is refused as not empty, and its lock file alone is no content."""
    stream = tmp_path / "stream"
    other = RunLock(stream, "eval --stream-images", flag="--stream-images ").acquire()  # the first evaluation
    args = ["eval", "--checkpoint", str(checkpoint), "--no-mlflow", "--shift-batches", "mixed", "--corruptions",
            "fog", "--severities", "5", "--no-sub-ensembles", "--data", f"test_subset={MIXED_SUBSET}",
            "--stream-images", str(stream)]
    try:
        assert main([*args, "--out", str(tmp_path / "second")]) == 2
    finally:
        other.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"--stream-images .*/stream .*eval --stream-images", err[0]), err
    assert [p.name for p in stream.iterdir()] == [LOCK_FILE]  # the lock's file, nothing of the stream
    assert main([*args, "--out", str(tmp_path / "first")]) == 0  # an empty folder but for a lock file: written
    assert (stream / "stream.csv").exists()
    assert main([*args, "--out", str(tmp_path / "again")]) == 2
    assert "the folder is not empty" in capsys.readouterr().err
