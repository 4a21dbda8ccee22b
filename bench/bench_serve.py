"""A registered program served by ``mlflow models serve``: its memory over many requests, and its request rate.

Registers the fixture run's program (tests/fixtures/run_v0_1_0, a 2-member ViT on 16 × 16 RGB) in a fresh sqlite
store, serves it, and sends N requests, alternating 8 float images (``inputs``) and 8 PNG files of several sizes
(base64 in a ``dataframe_split`` column, the form a client has), with a refused request (a NaN) every 10th. It
prints the server's resident memory (its whole process tree) after the warm-up and every N/4 requests, the growth
from the warm-up to the end as MB and as a ratio, and requests per second.

    python bench/bench_serve.py                 # 1,000 requests
    python bench/bench_serve.py --requests 200
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "run_v0_1_0"
WARMUP = 20


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and every descendant (uvicorn's worker), in MB, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0) / 1024
    return total


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _register(folder: Path) -> str:
    """The fixture's program registered as ``bench@champion`` in a new sqlite store under ``folder``; its URI."""
    import mlflow
    import torch

    from sigmanens_dist.export.program import export_program
    from sigmanens_dist.models import load_trained
    from sigmanens_dist.registry import register_program
    from sigmanens_dist.safe_load import load_file

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("bench-serve")).info.run_id
    run = shutil.copytree(FIXTURE, folder / "run")
    checkpoint = run / "checkpoints" / "step_00000002.pt"
    torch.save({**load_file(checkpoint, "checkpoint"), "mlflow_run_id": run_id}, checkpoint)
    export_program(load_trained(checkpoint), folder / "model.pt2")
    register_program(folder / "model.pt2", "bench", uri=uri, run_id=run_id, alias="champion")
    return uri


def _payloads() -> list[dict]:
    """A float request, a request of image files, and a refused one."""
    rng = np.random.default_rng(0)
    floats = {"inputs": rng.random((8, 3, 16, 16), dtype=np.float32).tolist()}
    files = []
    for i in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (16 + i, 16 + 2 * i, 3), dtype=np.uint8)).save(buf, format="PNG")
        files.append([base64.b64encode(buf.getvalue()).decode()])
    nan = np.array(floats["inputs"])
    nan[0, 0, 0, 0] = np.nan
    return [floats, {"dataframe_split": {"columns": ["image"], "data": files}}, {"inputs": nan.tolist()}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    args = ap.parse_args()
    floats, files, refused = _payloads()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        uri = _register(Path(tmp))
        port = _port()
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        log = Path(tmp) / "serve.log"
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/bench@champion",
                                   "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], env=env,
                                  stdout=log.open("w"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/invocations"
            deadline = time.monotonic() + 180
            while True:
                try:
                    requests.get(f"http://127.0.0.1:{port}/ping", timeout=2)
                    break
                except requests.ConnectionError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        print(log.read_text()[-3000:], file=sys.stderr)
                        return 1
                    time.sleep(0.5)
            seen: list[tuple[int, float]] = []
            started = None
            for i in range(WARMUP + args.requests):
                if i == WARMUP:
                    seen.append((0, _rss_mb(server.pid)))
                    started = time.monotonic()
                payload = refused if i % 10 == 9 else (floats if i % 2 else files)
                answer = requests.post(url, data=json.dumps(payload), timeout=60,  # json.dumps writes NaN
                                       headers={"Content-Type": "application/json"})
                if answer.status_code != (400 if payload is refused else 200):
                    print(f"request {i}: HTTP {answer.status_code} {answer.text[-300:]}", file=sys.stderr)
                    return 1
                done = i + 1 - WARMUP
                if done > 0 and done % max(1, args.requests // 4) == 0:
                    seen.append((done, _rss_mb(server.pid)))
            seconds = time.monotonic() - started
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"mlflow models serve, {args.requests} requests after {WARMUP} of warm-up (8 images each: floats and PNG "
          "files alternating, every 10th refused with a 400)")
    for done, rss in seen:
        print(f"  after {done:5d} requests: {rss:7.1f} MB resident (server and workers)")
    base, end = seen[0][1], seen[-1][1]
    print(f"growth: {end - base:+.1f} MB ({end / base:.3f}× the memory after warm-up); "
          f"{args.requests / seconds:.1f} requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
