"""Webdataset shards streamed from real servers started here on 127.0.0.1: Debian's nginx for HTTP, moto's S3 server
(with IAM auth on, so wrong credentials are refused as by AWS). The loader's contract holds unchanged: the same
batches (keys and tensors) as from local disk, from any resume point, through dropped connections and 5xx; 4xx and
corrupt shards are one line naming the URL; no credential reaches any file a run writes."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchvision import datasets

from sigmanens_dist.atomic import file_sha256
from sigmanens_dist.config import ConfigError, load_config
from sigmanens_dist.data import FASHION_MNIST_ROOT
from sigmanens_dist.data.shard_cache import CacheUnwritable, open_cached
from sigmanens_dist.data.synthetic_tree import make_image_folder
from sigmanens_dist.data.webdataset_io import MANIFEST, WebDatasetLoader, image_transform
from sigmanens_dist.data.webdataset_write import write_shards
from sigmanens_dist.errors import UsageError
from sigmanens_dist.storage.remote import (
    RemoteMismatch,
    RemoteNotFound,
    RemotePath,
    RemoteSettings,
    RemoteUnavailable,
)
from sigmanens_dist.storage.traffic import TRAFFIC
from tests.helpers import (
    REPO,
    TINY_VIT,
    Nginx,
    env,
    free_port,
    interrupted,
    losses,
    run_train,
    stop_process,
    train_cmd,
    wait_for_port,
)

FAST = RemoteSettings(retries=3, timeout_s=10)  # read_ahead=1, the default
TRAIN = [*TINY_VIT, "data.dataset=fashion_mnist", "data.format=webdataset", "data.img_size=16", "data.num_workers=1",
         "data.val_split=40", "model.num_members=2", "train.batch_size=4", "train.log_every_steps=1",
         "train.max_steps=4", "optim.lr=0.02"]


# ---------------------------------------------------------------------------------------------------------------------
# The data and the servers.


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the servers serve: ``loose/train/``, 8 shards of 12 images written by ``write_shards``."""
    root = tmp_path_factory.mktemp("served")
    tree = make_image_folder(tmp_path_factory.mktemp("tree"), 4, 24, 32, seed=0)
    write_shards(datasets.ImageFolder(str(tree / "train")), root / "loose" / "train", max_count=12)
    return root


@pytest.fixture(scope="module")
def conv(data: Path) -> Path:
    """``data/conv``: what ``sigmanens data convert`` writes (train/val/test, classes.json) from 200 + 50 Fashion-MNIST
    images, 160 of them for training in 8 shards."""
    from sigmanens_dist.cli import main

    if not FASHION_MNIST_ROOT.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")
    assert main(["data", "convert", "--dataset", "fashion_mnist", "--format", "webdataset", "--out",
                 str(data / "conv"), "--max-count", "20", "--train-subset", "200", "--test-subset", "50",
                 "--val-split", "40"]) == 0
    return data / "conv"


@pytest.fixture(scope="module")
def nginx(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    server = Nginx(data, tmp_path_factory.mktemp("nginx"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """moto's S3 server with IAM auth on after the first 3 requests (the user, its policy and access key made here);
    ``data`` uploaded to bucket ``shards``. The AWS environment that reaches it."""
    if shutil.which("moto_server") is None and not _importable("moto.server"):
        pytest.skip("moto's server is not installed (pip install 'moto[server]', in the dev extra)")
    import boto3

    port, log = free_port(), tmp_path_factory.mktemp("moto") / "log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}, stdout=out, stderr=out)
    if not wait_for_port(port, proc, 60):
        stop_process(proc)
        pytest.skip(f"moto's S3 server could not start: {log.read_text().strip()[-300:]}")
    url = f"http://127.0.0.1:{port}"
    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", aws_access_key_id="bootstrap",
                       aws_secret_access_key="bootstrap")
    iam.create_user(UserName="trainer")
    iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    aws = {"AWS_ENDPOINT_URL": url, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
           "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"], "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=aws["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket="shards")
    _upload(client, data, "loose")
    yield aws
    stop_process(proc)


def _upload(client: Any, data: Path, folder: str) -> None:
    for path in (data / folder).rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "shards", str(path.relative_to(data)))


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _aws_env(monkeypatch: pytest.MonkeyPatch, aws: dict[str, str]) -> None:
    """Only ``aws`` of the AWS variables (DataLoader workers fork and inherit it)."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in aws.items():
        monkeypatch.setenv(name, value)


class _Flaky(http.server.SimpleHTTPRequestHandler):
    """Serves its directory, except where ``server.faults[path]`` lists what the next requests get instead:
    ``503``, ``drop`` (full Content-Length, half the body, then the connection closes), ``corrupt`` (one byte of the
    tar's end padding changed: the tar still parses, the sha256 differs) or ``404`` (permanent)."""

    def do_GET(self) -> None:
        plan = self.server.faults.get(self.path, [])
        self.server.requests.append(self.path)
        fault = plan[0] if plan else None
        if fault is not None and fault != "404":
            plan.pop(0)
        if fault in ("503", "404"):
            self.send_error(int(fault))
            return
        if fault in ("drop", "corrupt"):
            body = Path(self.translate_path(self.path)).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault == "drop":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
            else:
                self.wfile.write(body[:-1] + bytes([body[-1] ^ 1]))
            return
        super().do_GET()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def flaky(data: Path) -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Flaky, directory=str(data)))
    server.faults, server.requests = {}, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: http.server.ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


# ---------------------------------------------------------------------------------------------------------------------
# The loader: remote batches are the local ones.

TF = image_transform(True, 24, (0.5,) * 3, (0.25,) * 3)  # random crops and flips: per-sample seeds must replay


def _loader(manifest: Path | RemotePath, rank: int = 1, workers: int = 2) -> WebDatasetLoader:
    return WebDatasetLoader(manifest, 4, rank, 2, workers, seed=5, transform=TF, shuffle_buffer=16, return_keys=True)


def _epoch(loader: WebDatasetLoader, epoch: int, start: int = 0) -> list[tuple[Any, ...]]:
    return list(loader.iter_epoch(epoch, start))


def _assert_same(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]]) -> None:
    assert [b[2] for b in got] == [b[2] for b in want]  # same samples, same order
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # same pixels after augmentation, same labels


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_nginx_streams_the_batches_of_local_disk(data: Path, nginx: Nginx, read_ahead: int) -> None:
    settings = RemoteSettings(retries=3, timeout_s=10, read_ahead=read_ahead)
    local, remote = _loader(data / "loose" / "train"), _loader(RemotePath(f"{nginx}/loose/train/{MANIFEST}", settings))
    assert len(remote) == len(local) == 12
    full = _epoch(local, 1)
    _assert_same(_epoch(remote, 1), full)
    _assert_same(_epoch(remote, 1, 5), full[5:])  # exact resume from mid-epoch


def test_s3_streams_the_batches_of_local_disk(data: Path, s3: dict[str, str], monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    _aws_env(monkeypatch, s3)
    local, remote = _loader(data / "loose" / "train"), _loader(RemotePath(f"s3://shards/loose/train/{MANIFEST}", FAST))
    full = _epoch(local, 2)
    _assert_same(_epoch(remote, 2, 3), full[3:])
    _assert_same(_epoch(remote, 2), full)


@pytest.mark.parametrize("read_ahead", [0, 1])
def test_dropped_connections_and_503s_are_retried_without_losing_or_repeating_a_sample(
        data: Path, flaky: http.server.ThreadingHTTPServer, caplog: pytest.LogCaptureFixture, read_ahead: int) -> None:
    settings = RemoteSettings(retries=3, timeout_s=10, read_ahead=read_ahead)
    local = _loader(data / "loose" / "train", workers=0)
    remote = _loader(RemotePath(f"{_url(flaky)}/loose/train/{MANIFEST}", settings), workers=0)
    shards = [s.path.name for stream in remote.epoch_shards(0) for s in stream]
    flaky.faults.update({f"/loose/train/{shards[0]}": ["drop"], f"/loose/train/{shards[1]}": ["503", "503"],
                         f"/loose/train/{shards[2]}": ["drop", "503"]})
    with caplog.at_level(logging.WARNING, logger="sigmanens_dist.storage.remote"):
        _assert_same(_epoch(remote, 0), _epoch(local, 0))
    assert not any(flaky.faults.values())  # every planned fault was served
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 5
    assert any(f"/loose/train/{shards[0]}: short read: the transfer ended after" in w for w in warnings)
    assert any(f"/loose/train/{shards[1]}: HTTP 503" in w and "retry 2 of 3" in w for w in warnings)


def test_read_ahead_is_bounded_and_every_byte_is_counted(data: Path, flaky: http.server.ThreadingHTTPServer,
                                                          nginx: Nginx) -> None:
    """A stream downloads the next ``read_ahead`` shards while it reads one, and no more; the bytes DataLoader
    workers receive reach the main process's count (what the trainer's throughput line reports) exactly."""
    for depth in (1, 2):
        flaky.requests.clear()
        loader = _loader(RemotePath(f"{_url(flaky)}/loose/train/{MANIFEST}", RemoteSettings(read_ahead=depth)), 0,
                         workers=0)  # rank 0's only stream holds 4 shards
        order = [f"/loose/train/{s.path.name}" for s in loader.epoch_shards(0)[0]]
        batches = loader.iter_epoch(0)
        next(batches)  # the shuffle buffer holds 16 samples: the first shard read, the second being read
        deadline = time.time() + 10
        while len(flaky.requests) < 3 + depth and time.time() < deadline:  # the manifest, then shards
            time.sleep(0.05)
        time.sleep(0.3)
        assert [r for r in flaky.requests if r.endswith(".tar")] == order[: 2 + depth]
        batches.close()

    remote = _loader(RemotePath(f"{nginx}/loose/train/{MANIFEST}", FAST))  # 2 workers, 2 shards each, none left over
    before = TRAFFIC.received
    _epoch(remote, 1)
    assert TRAFFIC.received - before == sum(s.bytes for stream in remote.epoch_shards(1) for s in stream)
    line = TRAFFIC.line()
    assert line is not None and line.startswith("remote data: ") and "0 shard download(s) in flight" in line, line


@pytest.mark.parametrize("read_ahead", [0, 1])
def test_the_shard_cache_downloads_each_shard_once_and_gives_the_same_batches(data: Path, nginx: Nginx,
                                                                              tmp_path: Path, read_ahead: int) -> None:
    """With ``data.remote.cache_dir``, epochs 1, 2 and 1 again read the batches of local disk, and nginx serves each
    shard they touch once; the copies, named by their sha256, hold the shards' bytes."""
    cache = tmp_path / "cache"
    settings = RemoteSettings(retries=3, timeout_s=10, read_ahead=read_ahead, cache_dir=cache)
    local, remote = _loader(data / "loose" / "train"), _loader(RemotePath(f"{nginx}/loose/train/{MANIFEST}", settings))
    before = _tar_requests(nginx)
    for epoch in (1, 2, 1):
        _assert_same(_epoch(remote, epoch), _epoch(local, epoch))
    touched = {s.sha256: s.path.name for epoch in (1, 2) for stream in remote.epoch_shards(epoch) for s in stream}
    assert _tar_requests(nginx) - before == len(touched) > 4  # rank 1 of 2 reads 4 shards an epoch, others the next
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"{sha}.tar" for sha in touched)
    for sha, name in touched.items():
        assert (cache / f"{sha}.tar").read_bytes() == (data / "loose" / "train" / name).read_bytes()


def test_the_shard_cache_keeps_to_its_size_limit(data: Path, nginx: Nginx, tmp_path: Path) -> None:
    """A limit of two shards' bytes: the least recently used copies go, the batches stay those of local disk; the
    config carries the cache settings into every remote path."""
    sizes = sorted(p.stat().st_size for p in (data / "loose" / "train").glob("*.tar"))
    limit = sizes[-1] + sizes[-2]
    cache = tmp_path / "cache"
    cfg = load_config(None, [*TRAIN, f"data.root={nginx}/loose", f"data.remote.cache_dir={cache}",
                             f"data.remote.cache_gb={limit / 2**30}"])
    settings = cfg.data.root.settings
    assert (settings.cache_dir, settings.cache_gb) == (cache, limit / 2**30)
    local, remote = _loader(data / "loose" / "train"), _loader(cfg.data.root / "train" / MANIFEST)
    _assert_same(_epoch(remote, 1), _epoch(local, 1))
    kept = list(cache.iterdir())
    assert 1 <= len(kept) <= 2 and sum(p.stat().st_size for p in kept) <= limit


def test_a_copy_handed_to_a_reader_is_read_whole_though_it_is_evicted_before_the_reader_starts(
        data: Path, nginx: Nginx, tmp_path: Path) -> None:
    """The cache hands out an open copy, not a name: with room for one shard, fetching a second evicts the first
    (another job's download does the same), and its reader, handed it before, still reads all its bytes."""
    shards = sorted((data / "loose" / "train").glob("*.tar"))[:2]
    settings = RemoteSettings(retries=3, timeout_s=10, cache_dir=tmp_path / "cache",
                              cache_gb=max(p.stat().st_size for p in shards) / 2**30)
    first, second = (open_cached(RemotePath(f"{nginx}/loose/train/{p.name}", settings), p.stat().st_size,
                                 file_sha256(p)) for p in shards)
    assert first is not None and second is not None
    with first, second:
        assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{file_sha256(shards[1])}.tar"]  # first evicted
        assert first.read() == shards[0].read_bytes() and second.read() == shards[1].read_bytes()


_SHARING = """
import sys, time
from pathlib import Path
import torch
from sigmanens_dist.data import webdataset_io as wds
from sigmanens_dist.storage.remote import RemotePath, RemoteSettings

data, url, cache, read_ahead, seed = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), *map(int, sys.argv[4:])
handed = wds.open_cached

def slow_reader(*args):  # the copy handed over waits before its first read: the other job evicts it meanwhile
    copy = handed(*args)
    time.sleep(0.2)
    return copy

wds.open_cached = slow_reader  # DataLoader workers fork with it
limit = max(p.stat().st_size for p in (data / "loose" / "train").glob("*.tar"))
settings = RemoteSettings(retries=3, timeout_s=10, read_ahead=read_ahead, cache_dir=cache, cache_gb=limit / 2**30)
tf = wds.image_transform(True, 24, (0.5,) * 3, (0.25,) * 3)
remote, local = (wds.WebDatasetLoader(m, 4, 0, 1, 2, seed=seed, transform=tf, shuffle_buffer=16, return_keys=True)
                 for m in (RemotePath(f"{url}/loose/train/{wds.MANIFEST}", settings), data / "loose" / "train"))
for epoch in (1, 2):
    got, want = list(remote.iter_epoch(epoch)), list(local.iter_epoch(epoch))
    assert [b[2] for b in got] == [b[2] for b in want] and len(got) == 24
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want))
print("local disk's batches")
"""


def test_two_jobs_sharing_a_cache_of_one_shard_read_the_batches_of_local_disk(data: Path, nginx: Nginx,
                                                                              tmp_path: Path) -> None:
    """Two processes (read-ahead 0 and 1) with 2 DataLoader workers each share one cache folder with room for one
    shard, so every download evicts a copy another worker may have been handed; each reader is slow to start on its
    copy. Both read all 8 shards twice and get the batches of local disk: no copy vanishes under its reader."""
    jobs = [subprocess.Popen([sys.executable, "-c", _SHARING, str(data), str(nginx), str(tmp_path / "cache"),
                              str(read_ahead), str(seed)], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for read_ahead, seed in ((0, 5), (1, 6))]
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0 and out.strip() == "local disk's batches", err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    assert len(list((tmp_path / "cache").iterdir())) <= 1


@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``folder`` (``ro`` or a small ``size``): a file system that is really read-only or full,
    which no ``chmod`` gives root. Skips where this process may not mount."""
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
    if shutil.which("mount") is None or subprocess.run(mount, capture_output=True, check=False).returncode != 0:
        pytest.skip("needs to mount a tmpfs (root with CAP_SYS_ADMIN) for a read-only or a full file system")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


UNWRITABLE = {"read-only": ("ro", "Read-only file system"), "full": ("size=64k", "No space left on device")}


@pytest.mark.parametrize("fs", UNWRITABLE)
def test_a_cache_folder_that_cannot_take_a_copy_is_one_warning_and_the_shards_stream(
        data: Path, nginx: Nginx, tmp_path: Path, fs: str) -> None:
    """A read-only file system (found before any worker starts) and a full one (70 KB shards, 64 KB of room: met
    by the DataLoader workers mid-write): one warning in all, from whichever process meets it first, through two
    epochs of two workers; the batches are those of local disk, and nothing is left half-written."""
    options, reason = UNWRITABLE[fs]
    with _tmpfs(tmp_path / "mnt", options) as mnt:
        settings = RemoteSettings(retries=3, timeout_s=10, cache_dir=mnt / "cache")
        logged = tmp_path / "warnings.log"
        handler, logger = logging.FileHandler(logged), logging.getLogger("sigmanens_dist.data.shard_cache")
        logger.addHandler(handler)  # the workers fork with it: their warnings are appended there too
        try:
            local, remote = _loader(data / "loose" / "train"), _loader(RemotePath(f"{nginx}/loose/train/{MANIFEST}",
                                                                                  settings))
            for epoch in (1, 2):
                _assert_same(_epoch(remote, epoch), _epoch(local, epoch))
        finally:
            logger.removeHandler(handler)
            handler.close()
        assert logged.read_text().splitlines() == [
            f"data.remote.cache_dir={mnt / 'cache'} cannot take a shard copy ({reason}): for the rest of this run the "
            "shards it does not hold are streamed, uncached"]
        assert [p.name for p in mnt.rglob("*")] == ([] if fs == "read-only" else ["cache"])


def test_a_required_cache_that_cannot_take_a_copy_stops_in_one_line(data: Path, nginx: Nginx, tmp_path: Path
                                                                    ) -> None:
    """``data.remote.cache_required``: a read-only folder is refused when the loader is built (before compute), a
    disk found full by a worker mid-epoch stops the epoch; both are usage errors of one line."""
    manifest = f"{nginx}/loose/train/{MANIFEST}"
    for fs in UNWRITABLE:
        options, reason = UNWRITABLE[fs]
        with _tmpfs(tmp_path / fs, options) as mnt:
            settings = RemoteSettings(retries=3, timeout_s=10, cache_dir=mnt / "cache", cache_required=True)
            if fs == "read-only":
                with pytest.raises(CacheUnwritable) as err:
                    _loader(RemotePath(manifest, settings))  # found when the loader is built, before any batch
            else:
                loader = _loader(RemotePath(manifest, settings))  # the probe's one byte fits
                with pytest.raises(CacheUnwritable) as err:
                    _epoch(loader, 1)  # a worker writing its first copy finds the disk full
            assert isinstance(err.value, UsageError)
            assert str(err.value) == (
                f"data.remote.cache_dir={mnt / 'cache'} cannot take a shard copy ({reason}) and "
                "data.remote.cache_required=true: free space or give a writable folder, or set "
                "data.remote.cache_required=false to stream the shards uncached")
    with pytest.raises(ConfigError, match=r"data.remote.cache_required: true needs data.remote.cache_dir"):
        load_config(None, [*TRAIN, f"data.root={nginx}/loose", "data.remote.cache_required=true"])


@pytest.mark.slow
def test_training_on_a_read_only_cache_warns_once_and_a_required_one_is_exit_2(conv: Path, nginx: Nginx,
                                                                               tmp_path: Path) -> None:
    """What the trainer makes of it (a read-only cache was a 72-line traceback, exit 1): the run trains on the
    streamed shards after one warning; with ``data.remote.cache_required=true`` it stops before the first step in
    one line, exit 2."""
    with _tmpfs(tmp_path / "ro", "ro") as mnt:
        overrides = [*TRAIN, "train.max_steps=2", f"data.root={nginx}/conv", f"data.remote.cache_dir={mnt / 'cache'}"]
        proc = run_train(tmp_path / "run", *overrides)
        assert sorted(losses(tmp_path / "run")) == [1, 2] and "Traceback" not in proc.stderr
        assert [line.split(" WARNING ")[1] for line in proc.stderr.splitlines() if "cache_dir" in line] == [
            f"data.remote.cache_dir={mnt / 'cache'} cannot take a shard copy (Read-only file system): for the rest "
            "of this run the shards it does not hold are streamed, uncached"], proc.stderr[-3000:]
        proc = run_train(tmp_path / "required", *overrides, "data.remote.cache_required=true", expect=2)
        assert [line for line in proc.stderr.splitlines() if "error" in line.lower()] == [
            f"error: data.remote.cache_dir={mnt / 'cache'} cannot take a shard copy (Read-only file system) and "
            "data.remote.cache_required=true: free space or give a writable folder, or set "
            "data.remote.cache_required=false to stream the shards uncached"], proc.stderr[-3000:]


def test_refusals_and_corrupt_shards_are_one_line_naming_the_url(data: Path,
                                                                 flaky: http.server.ThreadingHTTPServer) -> None:
    base = f"{_url(flaky)}/loose/train"
    with pytest.raises(FileNotFoundError, match=rf"^{_url(flaky)}/nowhere/{MANIFEST}: no webdataset manifest;"):
        _loader(RemotePath(f"{_url(flaky)}/nowhere/{MANIFEST}", FAST))
    remote = _loader(RemotePath(f"{base}/{MANIFEST}", FAST), workers=1)  # errors cross the worker boundary
    first = remote.epoch_shards(0)[0][0].path.name
    cases = {"404": (RemoteNotFound, f"{base}/{first}: HTTP 404 Not Found; check data.root"),
             "corrupt": (RemoteMismatch, f"{base}/{first}: sha256 differs from its manifest's"),
             "503": (RemoteUnavailable, f"{base}/{first}: HTTP 503 Service Unavailable; gave up after 4 attempts "
                                        "(data.remote.retries=3)")}
    for fault, (kind, message) in cases.items():
        flaky.faults[f"/loose/train/{first}"] = [fault] * (4 if fault == "503" else 1)
        with pytest.raises(kind) as err:
            _epoch(remote, 0)
        assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
        flaky.faults.clear()


def test_wrong_s3_credentials_are_one_line(s3: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _aws_env(monkeypatch, {**s3, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    with pytest.raises(ValueError) as err:
        _loader(RemotePath(f"s3://shards/loose/train/{MANIFEST}", FAST))
    assert str(err.value).startswith(f"s3://shards/loose/train/{MANIFEST}: refused (S3 SignatureDoesNotMatch, "
                                     "HTTP 403); check the credentials"), str(err.value)
    assert "\n" not in str(err.value) and s3["AWS_SECRET_ACCESS_KEY"] not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------------
# Writing to a bucket.

CONVERT = ["data", "convert", "--dataset", "fashion_mnist", "--format", "webdataset", "--max-count", "20",
           "--train-subset", "200", "--test-subset", "50", "--val-split", "40"]  # the options `conv` was written with


def test_convert_to_s3_writes_the_local_conversion_manifests_last(conv: Path, s3: dict[str, str],
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Every object is byte for byte the file converted to disk (so it trains as they do: same batches checked
    here too), each split's manifest after its shards and classes.json last; a prefix already written is refused
    unless --force, and an http --out in one line."""
    import boto3

    from sigmanens_dist.cli import main
    from sigmanens_dist.data import convert as convert_module

    _aws_env(monkeypatch, s3)
    order: list[str] = []
    upload = convert_module.upload
    monkeypatch.setattr(convert_module, "upload", lambda path, dest: (order.append(dest.url), upload(path, dest)))
    assert main([*CONVERT, "--out", "s3://shards/conv_s3"]) == 0
    assert "data.root=s3://shards/conv_s3 " in capsys.readouterr().out
    local = {p.relative_to(conv).as_posix(): p.read_bytes() for p in conv.rglob("*") if p.is_file()}
    client = boto3.client("s3")
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="shards", Prefix="conv_s3/")["Contents"]]
    assert sorted(k.removeprefix("conv_s3/") for k in keys) == sorted(local)
    for key in keys:
        assert client.get_object(Bucket="shards", Key=key)["Body"].read() == local[key.removeprefix("conv_s3/")]
    names = [url.removeprefix("s3://shards/conv_s3/") for url in order]
    assert names[-1] == "classes.json" and len(names) == len(local)
    for split in ("train", "val", "test"):
        assert max(i for i, n in enumerate(names) if n.startswith(f"{split}/{split}-")) < names.index(
            f"{split}/{MANIFEST}")
    remote = _loader(RemotePath(f"s3://shards/conv_s3/train/{MANIFEST}", FAST), workers=1)
    _assert_same(_epoch(remote, 0), _epoch(_loader(conv / "train", workers=1), 0))

    assert main([*CONVERT, "--out", "s3://shards/conv_s3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sigmanens data convert: error: --out s3://shards/conv_s3 is not empty (it holds "
                          "s3://shards/conv_s3/") and "pass --force" in err and "\n" not in err, err
    assert main([*CONVERT, "--out", "s3://shards/conv_s3", "--force"]) == 0
    capsys.readouterr()
    assert main([*CONVERT, "--out", "http://127.0.0.1:9/conv"]) == 2
    assert capsys.readouterr().err == ("sigmanens data convert: error: --out http://127.0.0.1:9/conv: HTTP is "
                                       "read-only here; write to a local folder (and serve it) or to "
                                       "s3://BUCKET/PREFIX\n")


# ---------------------------------------------------------------------------------------------------------------------
# Training from a remote root.


def test_training_from_s3_writes_no_credential_anywhere(data: Path, conv: Path, s3: dict[str, str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret is the one the run really uses; every file of the run directory and the MLflow store, and the
    run's output, are searched for it. Wrong credentials: exit 2 and one line."""
    import boto3

    _aws_env(monkeypatch, s3)
    _upload(boto3.client("s3"), data, conv.name)
    secret = s3["AWS_SECRET_ACCESS_KEY"].encode()
    run = tmp_path / "runs" / "s3"
    proc = run_train(run, *TRAIN, "data.root=s3://shards/conv", "tracking.enabled=true",
                     f"tracking.uri=sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert sum(" INFO remote data: " in line and " MB/s " in line for line in proc.stderr.splitlines()) == 4
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    [tracked] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert json.loads(tracked.inputs.dataset_inputs[0].dataset.source) == {"uri": "s3://shards/conv"}  # the URL
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in written) and len(written) > 5
    assert [p for p in written if secret in p.read_bytes()] == []
    assert secret not in (proc.stdout + proc.stderr).encode()

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    proc = run_train(tmp_path / "refused", *TRAIN, "data.root=s3://shards/conv", expect=2)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: s3://shards/conv/classes.json: refused (HTTP 403); check the "
                     "credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, …), AWS_ENDPOINT_URL and the bucket policy"], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_two_rank_training_over_http_and_s3_equals_local_disk(data: Path, conv: Path, nginx: Nginx,
                                                              s3: dict[str, str], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The 8 training shards of ``conv`` served by nginx and by the S3 server: both 2-rank runs train on exactly
    the batches of the run over local disk (the same losses, to the last digit)."""
    import boto3

    run_train(tmp_path / "local", *TRAIN, f"data.root={conv}", nproc=2)
    run_train(tmp_path / "http", *TRAIN, f"data.root={nginx}/conv", nproc=2)
    assert losses(tmp_path / "http") == losses(tmp_path / "local") and len(losses(tmp_path / "local")) == 4
    served = urllib.request.urlopen(f"{nginx}/conv/classes.json", timeout=10).read()
    assert json.loads(served) == json.loads((conv / "classes.json").read_text())
    _aws_env(monkeypatch, s3)
    _upload(boto3.client("s3"), data, conv.name)
    run_train(tmp_path / "s3", *TRAIN, "data.root=s3://shards/conv", nproc=2)
    assert losses(tmp_path / "s3") == losses(tmp_path / "local")


# Training through network faults: shards of one batch each (40 a training epoch), so every step needs a request.
SMALL = [*TRAIN, "train.max_steps=16", "checkpoint.every_steps=4", "checkpoint.keep_last=10"]


@pytest.fixture(scope="module")
def small(data: Path) -> Path:
    """``data/small``: the conversion ``conv`` is, with one batch (4 images) a shard."""
    from sigmanens_dist.cli import main

    if not FASHION_MNIST_ROOT.is_dir():
        pytest.skip("needs Debian's dataset-fashion-mnist (launch/setup.sh installs it)")
    assert main([*CONVERT[:6], "--max-count", "4", *CONVERT[8:], "--out", str(data / "small")]) == 0
    return data / "small"


@pytest.fixture(scope="module")
def straight(small: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the undisturbed run on local disk."""
    run = tmp_path_factory.mktemp("straight") / "run"
    run_train(run, *SMALL, f"data.root={small}")
    return losses(run)


def _tar_requests(server: Nginx) -> int:
    return sum(".tar HTTP/" in line for line in server.access_log.read_text().splitlines())


@pytest.mark.slow
def test_training_survives_the_server_stopped_for_5_s(small: Path, straight: dict[int, float], nginx: Nginx,
                                                      tmp_path: Path) -> None:
    """nginx stopped by PID once 3 shards were requested and started again 5 s later: the run waits with warning
    lines (connection refused, retry n of 5) and trains on exactly the undisturbed run's batches."""
    run, err = tmp_path / "http", tmp_path / "http.stderr"
    before = _tar_requests(nginx)
    with err.open("w") as f:
        proc = subprocess.Popen(train_cmd(run, *SMALL, f"data.root={nginx}/small"), cwd=REPO, env=env(),
                                stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.time() + 120
        while _tar_requests(nginx) < before + 3:
            assert proc.poll() is None and time.time() < deadline, err.read_text()[-3000:]
            time.sleep(0.02)
        nginx.stop()
        time.sleep(5)
        nginx.start()
        assert proc.wait(timeout=300) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    retries = [line for line in err.read_text().splitlines() if "reading it again from its start" in line]
    assert retries and all(f"{nginx}/small/" in line and "WARNING" in line for line in retries), retries
    assert losses(run) == straight and len(straight) == 16


@pytest.mark.slow
def test_sigkill_mid_run_over_http_resumes_to_the_undisturbed_losses(small: Path, straight: dict[int, float],
                                                                    nginx: Nginx, tmp_path: Path) -> None:
    run, overrides = tmp_path / "killed", [*SMALL, f"data.root={nginx}/small"]
    assert interrupted(run, overrides, signal.SIGKILL, "step_00000008.pt") == -signal.SIGKILL
    run_train(run, *overrides, "checkpoint.resume=auto")
    assert losses(run) == straight


def test_config_takes_a_url_root_for_webdataset_only_and_without_reaching_it() -> None:
    """Loading a config (``--check``, what the Slurm scripts run before queueing) needs no network: the loader reads
    the manifest. The URL is saved as written, never with credentials; the other formats refuse it."""
    cfg = load_config(None, [*TRAIN, "data.root=https://data.invalid/c10/", "data.remote.retries=2"])
    assert cfg.data.root == RemotePath("https://data.invalid/c10") and cfg.data.root.settings.retries == 2
    assert cfg.model_dump(mode="json")["data"]["root"] == "https://data.invalid/c10"
    with pytest.raises(ConfigError, match=r"data.root: a remote root is read by data.format=webdataset only, not "
                                          r"data.format=ffcv"):
        load_config(None, [*TRAIN, "data.format=ffcv", "data.root=s3://bucket/c10"])
    with pytest.raises(ConfigError, match=r"credentials do not belong in a URL .* \(got 'https://…@host/c10'\)$"):
        load_config(None, [*TRAIN, "data.root=https://user:hunter2@host/c10"])
