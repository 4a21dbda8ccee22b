"""Shared helpers for the end-to-end tests: launching training the way users do, reading what it wrote."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from sigmanens_dist.catalog.datasets import FASHION_MNIST_ROOT

if TYPE_CHECKING:
    from sigmanens_dist.experiments.compare.records import RunRecord

REPO = Path(__file__).resolve().parent.parent
# A run written by release 0.1.0 (config, checkpoint, the logits it predicted): it must keep loading the same.
FIXTURE = REPO / "tests" / "fixtures" / "run_v0_1_0"

# A tiny LayerNorm ViT on generated 16x16 images: fast on 2 CPU cores and free of batch statistics, so runs that
# split the same global batch differently across ranks must agree.
TINY_VIT = ["model.name=vit_tiny_patch16_224", "model.kwargs.img_size=16", "model.kwargs.patch_size=4",
            "model.kwargs.depth=2", "model.kwargs.embed_dim=48", "model.kwargs.num_heads=2"]
SYNTHETIC = ["data.dataset=synthetic", "data.img_size=16", "data.train_subset=512", "data.val_subset=128",
             "data.num_workers=0"]
# A few real Fashion-MNIST images (Debian's dataset-fashion-mnist, which launch/setup.sh installs), for tests of the
# real reader; they skip where the files are missing.
FMNIST = ["data.dataset=fashion_mnist", "data.train_subset=120", "data.val_split=20", "data.num_workers=0"]
needs_fashion_mnist = pytest.mark.skipif(not FASHION_MNIST_ROOT.is_dir(),
                                         reason="needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")


def parse_source(path: Path) -> ast.Module:
    """``ast.parse`` of a source file, tried again on CPython 3.11's spurious "SystemError: AST constructor recursion
    depth mismatch": the constructor keeps its depth counter per interpreter, not per thread, so another conversion
    running at the same moment (a thread an earlier test left, a finalizer) unbalances it (cpython#106905; seen in
    full runs only, in the main thread and in a fresh one alike). Any other error, and a fifth mismatch, is raised."""
    text = path.read_text(encoding="utf-8")
    for _ in range(4):
        try:
            return ast.parse(text, str(path))
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
    return ast.parse(text, str(path))


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(db: Path) -> Iterator[str]:
    """A real MLflow tracking server on the sqlite file ``db`` (its artifacts in ``mlartifacts/`` beside it), one
    worker, job execution off (what the README recommends for small machines); yields its URL, stopped by its PID."""
    port = free_port()
    log = db.parent / "server.log"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{db}",
                             "--artifacts-destination", str(db.parent / "mlartifacts")], env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("mlflow server did not start:\n" + log.read_text()[-3000:])
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def import_blocking(*modules: str) -> str:
    """The head of a script for a fresh interpreter in which importing ``modules`` (packages, or a package's part
    such as ``sigmanens_dist.evaluation``), and anything under them, fails (checked at once)."""
    return f"""
import importlib.abc, json, sys
BLOCKED = {modules!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
for name in BLOCKED:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(name + " was importable")
"""


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port())]


def train_cmd(run_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    """``python -m sigmanens_dist.train`` (one process) or under ``torchrun`` (several)."""
    launcher = [*torchrun(nproc), "-m"] if nproc > 1 else [sys.executable, "-m"]
    return [*launcher, "sigmanens_dist.train", f"run_dir={run_dir}", "tracking.enabled=false", *overrides]


def run_train(run_dir: Path, *overrides: str, nproc: int = 1, expect: int = 0, timeout: int = 600
              ) -> subprocess.CompletedProcess:
    proc = subprocess.run(train_cmd(run_dir, *overrides, nproc=nproc), cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{proc.stdout[-3000:]}\n" \
                                      f"{proc.stderr[-6000:]}"
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    """Train loss per step from metrics.jsonl; a step logged twice (re-done after a kill) keeps its last value."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/loss" in row:
            out[row["step"]] = row["train/loss"]
    return out


def final_state(run_dir: Path, part: str = "model") -> dict[str, torch.Tensor]:
    """``part`` (model, ema, …) of the newest checkpoint."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    return torch.load(ckpts[-1], map_location="cpu", weights_only=False)[part]


def interrupted(run: Path, overrides: list[str], sig: int, after_ckpt: str, nproc: int = 1) -> int:
    """Start training, send ``sig`` once ``after_ckpt`` exists, return the exit status."""
    log = run.parent / f"{run.name}.stderr"  # a file, not a pipe: an unread pipe could fill and stall the run
    with log.open("w") as f:
        proc = subprocess.Popen(train_cmd(run, *overrides, nproc=nproc), cwd=REPO, env=env(),
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
    deadline = time.time() + 300
    while not (run / "checkpoints" / after_ckpt).exists():
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.time() < deadline, "checkpoint never appeared"
        time.sleep(0.02)
    if sig == signal.SIGKILL:
        os.killpg(proc.pid, signal.SIGKILL)
    elif nproc == 1:
        proc.send_signal(sig)
    else:  # like a signal that reached one worker only: the others must follow
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert workers, "no torchrun workers found"
        subprocess.run(["kill", f"-{sig.name[3:]}", workers[-1]], check=True)
    proc.wait(timeout=300)
    err = log.read_text()
    if sig != signal.SIGKILL:
        assert "checkpointed at step" in err or proc.returncode != 0, err[-3000:]
    return proc.returncode


def wait_for_port(port: int, proc: subprocess.Popen, seconds: float = 20) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port`` within ``seconds`` while ``proc`` lives."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s: a server this test session started (by its PID)."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Nginx:
    """Debian's nginx in the foreground with its own config, serving ``root`` on 127.0.0.1; formats as its base URL. A
    test may stop it (by PID) and start it again on the same port. tests/data/test_remote_shards.py,
    tests/distributed/test_slurm.py."""

    def __init__(self, root: Path, conf_dir: Path) -> None:
        self.conf_dir, self.port, self.proc = conf_dir, free_port(), None
        self.access_log = conf_dir / "access.log"
        user = "user root;" if os.geteuid() == 0 else ""  # workers must read pytest's 0700 folders
        temp = " ".join(f"{kind}_temp_path {conf_dir / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                            "uwsgi", "scgi"))
        (conf_dir / "nginx.conf").write_text(
            f"daemon off; {user} worker_processes 1; pid {conf_dir / 'nginx.pid'}; error_log "
            f"{conf_dir / 'error.log'};\nevents {{ worker_connections 64; }}\n"
            f"http {{ access_log {self.access_log}; {temp}\n"
            f"  server {{ listen 127.0.0.1:{self.port}; root {root}; }} }}\n")

    def __str__(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        exe = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.access(exe, os.X_OK):
            pytest.skip("nginx is not installed (launch/setup.sh installs Debian's nginx)")
        with (self.conf_dir / "stderr").open("w") as err:
            self.proc = subprocess.Popen([exe, "-p", str(self.conf_dir), "-e", str(self.conf_dir / "error.log"),
                                          "-c", str(self.conf_dir / "nginx.conf")], stdout=err, stderr=err)
        if not wait_for_port(self.port, self.proc):
            self.stop()
            pytest.skip(f"nginx could not start: {(self.conf_dir / 'stderr').read_text().strip()[-300:]}")

    def stop(self) -> None:
        stop_process(self.proc)


# SST-2 in GLUE format, generated: the text tests (tests/data/test_sst2.py, tests/data/test_sst2_formats.py)
POSITIVE = ["good", "great", "wonderful", "delightful", "brilliant"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "dreadful"]
FILLER = ["the", "movie", "film", "plot", "acting", "was", "really", "quite", "a", "story", "and", "it", "felt",
          "so", "cast", "ending", "this", "very", "overall", "script", "naïve"]  # real SST-2 has accented words
TINY_BERT = ["model.source=hf", "model.name=bert", "model.kwargs.hidden_size=32", "model.kwargs.num_hidden_layers=1",
             "model.kwargs.num_attention_heads=2", "model.kwargs.intermediate_size=64",
             "model.kwargs.max_position_embeddings=32"]


def write_sst2(root: Path, n_train: int = 400, n_dev: int = 100, seed: int = 0) -> Path:
    """A GLUE-format SST-2 whose label is the sentiment word in each sentence (with quotes, as GLUE has)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randint(0, 1)
            words = rng.choices(FILLER, k=rng.randint(3, 8))
            words.insert(rng.randint(0, len(words)), rng.choice(POSITIVE if label else NEGATIVE))
            rows.append(f"{' '.join(words)} 's \"\t{label}")
        (root / name).write_text("\n".join(rows) + "\n")
    return root


def run_record(method: str, m: int, tau: float | None, seed: int, acc: float, budget: int = 1) -> RunRecord:
    """A finished run's record for the comparison's statistics (tests/experiments/test_study.py,
    tests/experiments/test_terminal_output.py)."""
    from sigmanens_dist.experiments.compare.records import RunRecord

    return RunRecord(f"{method}{m}{tau}{seed}x{budget}", f"{method}-{m}-{tau}-x{budget}-{seed}", "FINISHED", method, m,
                     tau, None if tau is None else 0.001, seed, budget,
                     values={"acc": acc, "train_compute": m * budget})


# The official CIFAR python-pickle layout, written small by write_cifar_batches (tests/data: the raw reader, the
# converter). name → (torchvision class name, folder, train files, test file, meta file, label key, label-names key,
# classes)
CIFAR_LAYOUT = {
    "cifar10": ("CIFAR10", "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], "test_batch",
                "batches.meta", "labels", "label_names", 10),
    "cifar100": ("CIFAR100", "cifar-100-python", ["train"], "test", "meta", "fine_labels", "fine_label_names", 100),
}
CIFAR_PER_FILE, CIFAR_TEST = 6, 8


def write_cifar_batches(root: Path, name: str, monkeypatch: pytest.MonkeyPatch
                        ) -> dict[str, tuple[np.ndarray, list[int]]]:
    """Writes the batches, points torchvision's md5 table at them; returns {split: (HWC uint8 images, labels)}.
    torchvision checks each official file against its md5, which generated files cannot match."""
    import hashlib
    import pickle

    from torchvision import datasets

    def md5(path: Path) -> str:
        return hashlib.md5(path.read_bytes()).hexdigest()

    cls_name, folder, train_files, test_file, meta_file, label_key, names_key, classes = CIFAR_LAYOUT[name]
    cls = getattr(datasets, cls_name)
    base = root / folder
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written: dict[str, list] = {"train": [[], []], "test": [[], []]}
    table: dict[str, list[list[str]]] = {"train": [], "test": []}
    for split, files, n in (("train", train_files, CIFAR_PER_FILE), ("test", [test_file], CIFAR_TEST)):
        for file in files:
            images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            labels = rng.integers(0, classes, n).tolist()
            # The official layout: each row is 1024 red, then 1024 green, then 1024 blue values, row-major.
            batch = {"data": images.transpose(0, 3, 1, 2).reshape(n, 3072), label_key: labels,
                     "batch_label": file}
            (base / file).write_bytes(pickle.dumps(batch))
            table[split].append([file, md5(base / file)])
            written[split][0].append(images)
            written[split][1].extend(labels)
    (base / meta_file).write_bytes(pickle.dumps({names_key: [f"class_{c}" for c in range(classes)]}))
    monkeypatch.setattr(cls, "train_list", table["train"])
    monkeypatch.setattr(cls, "test_list", table["test"])
    monkeypatch.setattr(cls, "meta", {"filename": meta_file, "key": names_key, "md5": md5(base / meta_file)})
    return {split: (np.concatenate(images), labels) for split, (images, labels) in written.items()}


def untrained_run(run: Path, overrides: list[str], in_chans: int = 3, spread: float = 0.0) -> Path:
    """A run directory holding one checkpoint of a freshly built model of ``overrides``, as the trainer writes it.
    ``spread`` > 0 moves every parameter by that much noise (seeded) and sets the BatchNorm running statistics from
    a few batches of noise: members that disagree, confident answers and running statistics unlike any batch of
    images, as a trained model has, in no time."""
    from sigmanens_dist.catalog.datasets import DATASETS
    from sigmanens_dist.config import load_config
    from sigmanens_dist.models import build_model

    cfg = load_config(None, [*overrides, f"run_dir={run}"])
    torch.manual_seed(0)
    model = build_model(cfg, 10, in_chans)
    if spread:
        size = cfg.data.img_size or DATASETS[cfg.data.dataset].size
        with torch.no_grad():
            for value in model.parameters():
                value.add_(spread * torch.randn_like(value))
            model.train()
            for _ in range(3):
                model(0.5 + 2 * torch.randn(16, in_chans, size, size))
            model.eval()
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"model": model.state_dict(), "position": {"step": 0, "epoch": 0, "batch": 0},
                "config": cfg.model_dump(mode="json"), "model_args": {"num_classes": 10, "in_chans": in_chans,
                                                                      "vocab_size": None}},
               run / "checkpoints" / "step_00000000.pt")
    return run


# A 2-member σN-Ens on Fashion-MNIST (untrained_run(..., in_chans=1, spread=0.1)) and the mixed stream the shift tests
# of issue 52 score: contrast and fog at severity 5 beside the clean images, of SUBSET test images each (81 images:
# ten batches of 8 and one lone image)
FMNIST_RUN = ["model.name=test_resnet", "model.num_members=2", "data.dataset=fashion_mnist", "train.batch_size=8",
              "data.num_workers=0", "tracking.enabled=false"]
MIXED_CELLS = ["contrast", "fog"]
MIXED_SUBSET = 27


def scored_cell(log_probs: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """Accuracy, NLL and ECE of an ensemble's log-probabilities ``(N, K)``, from their definitions."""
    from sigmanens_dist.evaluation.metrics import calibration_error

    confidence, prediction = log_probs.exp().max(-1)
    correct = (prediction == target).float()
    return {"acc": float(correct.mean()), "nll": float(-log_probs[torch.arange(len(target)), target].mean()),
            "ece": calibration_error(confidence.float(), correct)}
