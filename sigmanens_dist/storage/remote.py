"""Webdataset shards, manifests and ``classes.json`` read from an HTTP(S) server or an S3 bucket.

:class:`RemotePath` is the part of ``pathlib.Path`` the webdataset reader uses (``/``, ``name``, ``parent``,
``is_file``, ``read_text``), so a ``data.root`` of ``https://host/c10_wds`` or ``s3://bucket/c10_wds`` flows through
the loaders like a folder. HTTP goes through the standard library; S3 through boto3, which takes the endpoint,
region and credentials from the standard AWS variables and files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, ``~/.aws/…``). Credentials never enter a URL (one holding ``user:password@`` is refused), so
nothing this module logs or raises, and no config that records the URL, can carry one.

Reading is retried: a connection error, timeout, HTTP 5xx/408/429 or short read waits (0.5 s, doubling, at most
30 s) and reads the object again from its start; :func:`stream_items` then skips the items it already yielded, so
a consumer sees each item of a shard exactly once. A 4xx (not found, forbidden, wrong credentials) is a
:class:`RemoteRefused`, a :class:`~sigmanens_dist.errors.UsageError`: retrying cannot fix it.

:class:`ReadAhead` downloads whole shards in a background thread ahead of the one being read, so a slow request
costs a step nothing while the shards before it last. :data:`~sigmanens_dist.storage.traffic.TRAFFIC` counts what
arrives, for the trainer's log.
:func:`upload` writes converted shards to a bucket (HTTP is read-only here).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import random
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from sigmanens_dist.errors import MissingPathError, UnavailableError, UsageError
from sigmanens_dist.storage.traffic import TRAFFIC

__all__ = ["SCHEMES", "ReadAhead", "RemoteError", "RemoteMismatch", "RemoteNotFound", "RemotePath", "RemoteRefused",
           "RemoteSettings", "RemoteUnavailable", "download", "first_object", "stream_items", "upload"]

log = logging.getLogger(__name__)

SCHEMES = ("http", "https", "s3")
_FIRST_DELAY_S, _MAX_DELAY_S = 0.5, 30.0
_JITTER = random.Random()  # its own generator: the global one is seeded per sample for augmentation
_SPOOL_BYTES = 64 << 20  # a read-ahead shard larger than this waits in an anonymous temporary file (TMPDIR)
T = TypeVar("T")


class RemoteError(Exception):
    """Base of this module's errors; each message is one line naming the URL."""


class RemoteRefused(RemoteError, UsageError):
    """The server or bucket refused the request (4xx, missing or wrong credentials): a configuration error."""


class RemoteNotFound(RemoteRefused, MissingPathError):
    """HTTP 404/410 or a missing S3 key or bucket."""


class RemoteMismatch(RemoteError, UsageError):
    """The object differs from what the manifest records (size or sha256): replaced or rewritten."""


class RemoteUnavailable(RemoteError, UnavailableError):
    """The retry budget ran out on connection errors, timeouts, 5xx or short reads: maybe transient, so not a
    usage error (exit 1: a batch script may requeue), but one line."""


class _Transient(Exception):
    """A failure worth another attempt; never an ``OSError``, so tar readers do not mistake it for corrupt data."""


@dataclass(frozen=True)
class RemoteSettings:
    """``data.remote``: failed attempts in a row before giving up, the timeout of each connect and read, how many
    whole shards each stream downloads ahead of the one it reads (0: it streams the one it reads), and the node-local
    shard cache (data/shard_cache.py; None: none) with its size limit and whether a folder that cannot take a copy
    stops the run (else it is a warning and the shards are streamed)."""

    retries: int = 5
    timeout_s: float = 60.0
    read_ahead: int = 1
    cache_dir: Path | None = None
    cache_gb: float = 20.0
    cache_required: bool = False


class RemotePath:
    """An object (or a "folder" prefix) at ``http(s)://host/path`` or ``s3://bucket/key``, with the retry settings
    every read of it and of the paths below it uses."""

    __slots__ = ("settings", "url")

    def __init__(self, url: str, settings: RemoteSettings | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise UsageError(f"{url!r}: a remote root is http://HOST/PATH, https://HOST/PATH or s3://BUCKET/PREFIX")
        if parts.username is not None or parts.password is not None:
            raise UsageError(f"{parts.scheme}://…@{parts.hostname}: credentials do not belong in a URL (it is logged "
                             "and saved with the config); give them in the environment (AWS_ACCESS_KEY_ID, …)")
        if parts.query or parts.fragment:
            raise UsageError(f"{url!r}: a query or fragment cannot be extended into shard URLs; give the folder URL")
        self.url = url.rstrip("/")
        self.settings = settings or RemoteSettings()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        """In a config it validates from the URL string and is saved (JSON, YAML, checkpoints) as that string."""
        return core_schema.no_info_plain_validator_function(
            lambda v: v if isinstance(v, RemotePath) else cls(v),
            serialization=core_schema.plain_serializer_function_ser_schema(str, when_used="json"))

    def with_settings(self, settings: RemoteSettings) -> RemotePath:
        return RemotePath(self.url, settings)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.settings)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.settings)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def is_file(self) -> bool:
        """Whether the object exists (HTTP HEAD, S3 HeadObject); refusals other than not-found raise."""
        try:
            return _retrying(self, lambda: _s3_head(self) if self.url.startswith("s3://") else _http_head(self))
        except RemoteNotFound:
            return False

    def read_bytes(self) -> bytes:
        return b"".join(stream_items(self, None, None, lambda body: iter([body.read()])))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)


class _Backoff:
    """Counts failed attempts in a row on one object, waits before the next, raises once the budget is spent."""

    def __init__(self, path: RemotePath) -> None:
        self.path, self.failures = path, 0

    def failed(self, err: _Transient) -> None:
        self.failures += 1
        retries = self.path.settings.retries
        if self.failures > retries:
            raise RemoteUnavailable(f"{self.path}: {err}; gave up after {self.failures} attempts "
                                    f"(data.remote.retries={retries})") from None
        delay = min(_MAX_DELAY_S, _FIRST_DELAY_S * 2 ** (self.failures - 1)) * _JITTER.uniform(0.8, 1.2)
        log.warning("%s: %s; reading it again from its start in %.1f s (retry %d of %d)", self.path, err, delay,
                    self.failures, retries)
        time.sleep(delay)


def _retrying(path: RemotePath, attempt: Callable[[], T]) -> T:
    backoff = _Backoff(path)
    while True:
        try:
            return attempt()
        except _Transient as err:
            backoff.failed(err)


class _Body:
    """The response stream as a file for ``tarfile``: a dropped connection or a short read becomes ``_Transient``;
    bytes past the expected size, or (at :meth:`finish`) a sha256 that differs, a :class:`RemoteMismatch`."""

    def __init__(self, path: RemotePath, raw: Any, size: int | None, errors: tuple[type[BaseException], ...]
                 ) -> None:
        self.path, self.raw, self.size, self.errors = path, raw, size, errors
        self.pos, self.hash = 0, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        try:
            data = self.raw.read() if n is None or n < 0 else self.raw.read(n)
        except self.errors as err:
            raise _Transient(f"connection lost after {self.pos} of {self.size} bytes ({type(err).__name__}: "
                             f"{err})") from None
        if not data and n != 0 and self.size is not None and self.pos < self.size:
            raise _Transient(f"short read: the transfer ended after {self.pos} of {self.size} bytes")
        self.pos += len(data)
        TRAFFIC.add(len(data))
        if self.size is not None and self.pos > self.size:
            raise RemoteMismatch(f"{self.path}: more than the {self.size} bytes its manifest records; the object "
                                 "was replaced: write the shards and manifest again")
        self.hash.update(data)
        return data

    def finish(self, sha256: str | None) -> None:
        """Reads what the parser left (a tar's end padding) and checks the whole object's digest."""
        while self.read(1 << 20):
            pass
        if sha256 is not None and self.hash.hexdigest() != sha256:
            raise RemoteMismatch(f"{self.path}: sha256 differs from its manifest's; the object is corrupt or was "
                                 "replaced: write the shards and manifest again")

    def close(self) -> None:
        self.raw.close()


def stream_items(path: RemotePath, size: int | None, sha256: str | None,
                 parse: Callable[[_Body], Iterator[T]]) -> Iterator[T]:
    """The items ``parse`` reads from the object at ``path``, each exactly once: after a transient failure the object
    is read again from its start and the items already yielded are skipped (``parse`` must be deterministic, which
    the size and sha256 checks make it). ``size`` and ``sha256``, when known, are checked against what arrives.
    The retry budget counts failures in a row: an attempt that yields new items resets it."""
    done, backoff = 0, _Backoff(path)
    TRAFFIC.add(active=1)
    try:
        while True:
            try:
                body = _s3_get(path, size) if path.url.startswith("s3://") else _http_get(path, size)
                try:
                    for seen, item in enumerate(parse(body), 1):
                        if seen > done:
                            done, backoff.failures = seen, 0
                            yield item
                    body.finish(sha256)
                finally:
                    body.close()
                return
            except _Transient as err:
                backoff.failed(err)
    finally:
        TRAFFIC.add(active=-1)


def download(path: RemotePath, size: int | None, sha256: str | None, f: IO[bytes],
             stop: threading.Event | None = None) -> None:
    """The object's bytes into ``f``, retried and checked as :func:`stream_items` does (an attempt after a failure
    writes ``f`` again from its start); a set ``stop`` abandons it."""

    def copy(body: _Body) -> Iterator[None]:
        f.seek(0)
        f.truncate()
        while chunk := body.read(1 << 20):
            if stop is not None and stop.is_set():
                raise _Stopped
            f.write(chunk)
        yield None

    deque(stream_items(path, size, sha256, copy), maxlen=0)


class _Stopped(Exception):
    """A read-ahead download abandoned because its stream was closed."""


class ReadAhead:
    """The objects ``(path, size, sha256)``, each downloaded whole (retried, checked as :func:`stream_items` does)
    by a background thread into memory or, past 64 MiB, an anonymous temporary file, at most ``depth`` ahead of the
    one being read: iterating yields each as a file positioned at its start, in order, closed once the next is
    asked for. A failed download raises at its turn, so the objects before it are read first, as without read-ahead.
    """

    def __init__(self, objects: Sequence[tuple[RemotePath, int | None, str | None]], depth: int,
                 local: Callable[[RemotePath, int | None, str | None], IO[bytes] | None] | None = None) -> None:
        self.objects, self.depth, self.local = list(objects), depth, local  # local: a cached copy, or None
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-read-ahead")
        self._pending: deque[Future[IO[bytes]]] = deque()
        self._next = 0

    def __iter__(self) -> Iterator[IO[bytes]]:
        self._submit(self.depth + 1)
        while self._pending:
            f = self._pending[0].result()
            self._pending.popleft()
            self._submit(self.depth)
            try:
                yield f
            finally:
                f.close()

    def _submit(self, queued: int) -> None:
        while self._next < len(self.objects) and len(self._pending) < queued:
            self._pending.append(self._pool.submit(self._fetch, *self.objects[self._next]))
            self._next += 1

    def _fetch(self, path: RemotePath, size: int | None, sha256: str | None) -> IO[bytes]:
        if self.local is not None and (copy := self.local(path, size, sha256)) is not None:
            return copy
        f = tempfile.SpooledTemporaryFile(_SPOOL_BYTES)  # noqa: SIM115 (the reader closes it)
        try:
            download(path, size, sha256, f, self._stop)
        except BaseException:
            f.close()
            raise
        f.seek(0)
        return f

    def close(self) -> None:
        """Stops the downloads without waiting (one in a retry's back-off ends by itself) and frees the files."""
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for future in self._pending:
            future.add_done_callback(_close_result)  # at once if done; else when its download ends
        self._pending.clear()


def _close_result(future: Future[IO[bytes]]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


def _expected(path: RemotePath, size: int | None, length: int | None) -> int | None:
    """The size to check the transfer against; a server-side size other than the manifest's is refused at once."""
    if size is not None and length is not None and length != size:
        raise RemoteMismatch(f"{path}: {length} bytes on the server but its manifest records {size} "
                             f"({'truncated' if length < size else 'replaced or appended to'}); write the shards and "
                             "manifest again")
    return size if size is not None else length


# ---------------------------------------------------------------------------------------------------------------------
# HTTP(S): the standard library.


def _http_request(path: RemotePath, method: str) -> http.client.HTTPResponse:
    try:
        return urllib.request.urlopen(urllib.request.Request(path.url, method=method),
                                      timeout=path.settings.timeout_s)
    except urllib.error.HTTPError as err:
        err.close()
        status = f"HTTP {err.code} {err.reason}"
        if err.code >= 500 or err.code in (408, 429):
            raise _Transient(status) from None
        if err.code in (404, 410):
            raise RemoteNotFound(f"{path}: {status}; check data.root and that the shards are served there") from None
        raise RemoteRefused(f"{path}: {status}; check the URL and the server's access rules") from None
    except (OSError, http.client.HTTPException) as err:  # URLError, timeouts, resets, a bad status line
        raise _Transient(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from None


def _http_head(path: RemotePath) -> bool:
    _http_request(path, "HEAD").close()
    return True


def _http_get(path: RemotePath, size: int | None) -> _Body:
    response = _http_request(path, "GET")
    length = response.headers.get("Content-Length")
    try:
        expected = _expected(path, size, int(length) if length is not None else None)
    except RemoteMismatch:
        response.close()
        raise
    return _Body(path, response, expected, (OSError, http.client.HTTPException))


# ---------------------------------------------------------------------------------------------------------------------
# S3: boto3, configured by the standard AWS environment variables and files.

_clients: dict[tuple[int, float, int], Any] = {}


def _s3_client(timeout_s: float) -> Any:
    """One client per process (DataLoader workers fork; a client is not fork-safe), timeout and AWS environment (a
    changed ``AWS_*`` variable gets a client built from the new one; only a hash of them is kept). Its own retries
    are off: :class:`_Backoff` counts every attempt against ``data.remote.retries``."""
    key = (os.getpid(), timeout_s, hash(frozenset((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    if key not in _clients:
        import boto3  # optional extra: webdataset (boto3)
        from botocore.config import Config

        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                        retries={"mode": "standard", "total_max_attempts": 1})
        _clients[key] = boto3.session.Session().client("s3", config=config)
    return _clients[key]


def _bucket_key(path: RemotePath) -> tuple[str, str]:
    bucket, _, key = path.url.removeprefix("s3://").partition("/")
    return bucket, key


def _s3_call(path: RemotePath, call: Callable[[Any, str, str], T]) -> T:
    from botocore import exceptions as bx  # optional extra: webdataset (boto3)

    try:
        return call(_s3_client(path.settings.timeout_s), *_bucket_key(path))
    except (bx.NoCredentialsError, bx.PartialCredentialsError, bx.ProfileNotFound) as err:
        raise RemoteRefused(f"{path}: {type(err).__name__}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                            "AWS_PROFILE with ~/.aws/credentials") from None
    except bx.ParamValidationError as err:
        raise RemoteRefused(f"{path}: not a valid S3 location ({err})") from None
    except bx.ClientError as err:  # only the code and status: the message may quote the request
        code = err.response.get("Error", {}).get("Code", "?")
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if status >= 500 or status in (408, 429) or code in ("SlowDown", "RequestTimeout", "Throttling"):
            raise _Transient(f"S3 {code} (HTTP {status})") from None
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
            raise RemoteNotFound(f"{path}: not found (S3 {code}); check data.root and that the shards were "
                                 "uploaded there") from None
        reason = f"HTTP {status}" if code == str(status) else f"S3 {code}, HTTP {status}"  # HEAD has no error code
        raise RemoteRefused(f"{path}: refused ({reason}); check the credentials "
                            "(AWS_ACCESS_KEY_ID, AWS_PROFILE, …), AWS_ENDPOINT_URL and the bucket policy") from None
    except bx.BotoCoreError as err:  # endpoint unreachable, timeouts, dropped connections
        raise _Transient(f"{type(err).__name__}: {err}") from None


def _s3_head(path: RemotePath) -> bool:
    return _s3_call(path, lambda client, bucket, key: client.head_object(Bucket=bucket, Key=key)) is not None


def _s3_get(path: RemotePath, size: int | None) -> _Body:
    from botocore.exceptions import BotoCoreError  # optional extra: webdataset (boto3)
    from urllib3.exceptions import HTTPError

    response = _s3_call(path, lambda client, bucket, key: client.get_object(Bucket=bucket, Key=key))
    try:
        expected = _expected(path, size, response.get("ContentLength"))
    except RemoteMismatch:
        response["Body"].close()
        raise
    return _Body(path, response["Body"], expected, (OSError, BotoCoreError, HTTPError))


def upload(local: Path, dest: RemotePath) -> None:
    """``local``'s bytes as the S3 object ``dest``: one PUT (up to 5 GB; a shard closes at 1 GB by default), retried
    as reads are."""

    def put() -> None:
        with local.open("rb") as f:
            _s3_call(dest, lambda client, bucket, key: client.put_object(Bucket=bucket, Key=key, Body=f))

    _retrying(dest, put)


def first_object(prefix: RemotePath) -> RemotePath | None:
    """An object below the S3 "folder" ``prefix``, or None when it holds none."""
    listed = _retrying(prefix, lambda: _s3_call(prefix, lambda client, bucket, key: client.list_objects_v2(
        Bucket=bucket, Prefix=f"{key}/" if key else "", MaxKeys=1)))
    keys = [entry["Key"] for entry in listed.get("Contents", [])]
    return RemotePath(f"s3://{_bucket_key(prefix)[0]}/{keys[0]}", prefix.settings) if keys else None
