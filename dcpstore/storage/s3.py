"""Native S3 backend (boto3): ``s3://bucket/prefix``.

Writing one object (:meth:`S3Storage.open_write`)::

    write()   bytes are buffered into parts (``StorageOptions.part_size_for``
              the size hint: by default about ``max_concurrency`` parts of
              8-64 MiB per object, so one object keeps that many
              connections busy). While the object
              is smaller than one part nothing is sent. The first full part
              starts a multipart upload; every full part goes to a small
              per-object thread pool (``max_concurrency`` parts in flight at
              most, so at most ~``max_concurrency + 1`` parts are buffered).
              A failed part fails the next ``write`` (fail fast).
    commit    small object: one ``PutObject``. Multipart: upload the tail,
              wait for every part, ``CompleteMultipartUpload``. The object
              becomes visible atomically, and only here.
    abort     (exception inside the ``with`` block, or a failed commit)
              cancel queued parts, wait for those in flight, then
              ``AbortMultipartUpload``: no parts are left behind.

A checkpoint commits by writing ``.metadata`` last (see
:mod:`dcpstore.writers.dcp`), after every data object is complete. If the
process dies between data and commit, the prefix holds data objects but no
``.metadata``: it is not a checkpoint, the next save to the same URI
overwrites it (and deletes stale data files after its own commit), and
``dcpstore gc`` removes it. A crash in the middle of a multipart upload leaves
an open upload that S3 never shows as an object; :meth:`S3Storage.list_incomplete`
lists and :meth:`S3Storage.cleanup_incomplete` (``dcpstore gc``) aborts those
under the prefix (a bucket lifecycle rule ``AbortIncompleteMultipartUpload``
does the same server-side).

Reads are ranged GETs; a long read is split into ranges (sized like parts)
fetched by up to ``max_concurrency`` threads, each response body read
straight into the caller's buffers (:meth:`S3Storage.read_into`).

Retries are botocore's own (``standard`` mode, or ``adaptive`` when
``AWS_RETRY_MODE`` says so) with ``max_attempts`` attempts per request and the
connect/read timeouts from :class:`~dcpstore.storage.base.StorageOptions`; on
top of that a request gives up once it has spent ``op_timeout_s`` retrying.
Errors after the retries are mapped to the :mod:`dcpstore.errors` family,
chained to the botocore exception. Endpoint, region and credentials come from
the standard AWS sources (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
profiles, ...); no message or log line here ever contains a credential.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from ..errors import CheckpointError, StorageError, StorageNotFound, StoragePermissionError
from .base import ObjectInfo, ObjectWriter, Storage, StorageOptions, byte_ranges, slice_buffers
from .secrets import remember_boto_credentials, scrub, scrub_exception
from .uri import StorageURL, redact

log = logging.getLogger(__name__)

T = TypeVar("T")

#: S3 accepts at most this many keys per DeleteObjects request.
_DELETE_BATCH = 1000

_NOT_FOUND = {"NoSuchKey", "404", "NotFound", "NoSuchUpload", "NoSuchVersion"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
}
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}

#: Errors raised while *reading a response body*, after botocore's retry loop
#: has already returned: retried here (s3transfer does the same).
def _readinto_full(body: Any, buffers: list[memoryview]) -> int:
    """Fill ``buffers`` in order from a botocore ``StreamingBody``; fewer
    bytes only at its end."""
    done = 0
    try:
        for out in buffers:
            pos = 0
            while pos < out.nbytes:
                n = body.readinto(out[pos:])
                if not n:
                    return done + pos
                pos += n
            done += pos
    finally:
        body.close()
    return done


_BODY_ERRORS = (
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
    bexc.ReadTimeoutError,
    bexc.ConnectionClosedError,
)


class _OperationTimeout(Exception):
    """Raised from a botocore hook when a request has retried past op_timeout_s."""

    def __init__(self, limit_s: float, elapsed_s: float, attempts: int, last: str) -> None:
        super().__init__(f"gave up after {elapsed_s:.1f}s and {attempts} attempts (op_timeout_s={limit_s:g}); last error: {last}")


# ---------------------------------------------------------------------------
# Clients: one per process and configuration, shared by every S3Storage.
# ---------------------------------------------------------------------------

#: Environment variables that change which endpoint, region or credentials a
#: new client gets; a client is reused only while they are unchanged.
_ENV_KEYS = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_RETRY_MODE",
    "AWS_CA_BUNDLE",
)

_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _env_fingerprint() -> str:
    # Hashed so that the cache key never holds a credential in clear text.
    digest = hashlib.sha256()
    for key in _ENV_KEYS:
        digest.update(f"{key}={os.environ.get(key, '<unset>')}\n".encode())
    return digest.hexdigest()


def _retry_mode() -> str:
    mode = os.environ.get("AWS_RETRY_MODE", "").strip().lower()
    # "legacy" (botocore's default when unset) retries fewer errors and has no
    # retry quota; we want standard (or the user's explicit adaptive).
    return mode if mode in ("standard", "adaptive") else "standard"


def s3_client(options: StorageOptions) -> Any:
    """The boto3 S3 client for this process and configuration (cached).

    Creating a client costs tens of milliseconds and a connection pool, so
    every :class:`S3Storage` with the same options (and the same AWS
    environment) in one process shares one; boto3 clients are thread-safe.
    The key includes the pid: a forked child builds its own.
    """
    key = (
        os.getpid(),
        _env_fingerprint(),
        options.max_attempts,
        options.max_concurrency,
        options.connect_timeout_s,
        options.read_timeout_s,
        options.op_timeout_s,
    )
    client = _clients.get(key)
    if client is not None:
        return client
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _make_client(options)
            _clients[key] = client
        return client


def _make_client(options: StorageOptions) -> Any:
    config = Config(
        # total_max_attempts counts the first try, like StorageOptions.max_attempts
        # (botocore's "max_attempts" would count retries only).
        retries={"mode": _retry_mode(), "total_max_attempts": options.max_attempts},
        connect_timeout=options.connect_timeout_s,
        read_timeout=options.read_timeout_s,
        # Several files per rank, each with max_concurrency parts in flight.
        max_pool_connections=max(32, 8 * options.max_concurrency),
        tcp_keepalive=True,
    )
    # A Session per client: sessions are not thread-safe, clients are.
    session = boto3.session.Session()
    client = session.client("s3", config=config)
    _install_deadline(client, options.op_timeout_s)
    remember_boto_credentials(session, client)  # so that no message ever shows them
    return client


def _install_deadline(client: Any, limit_s: float) -> None:
    """Bound the time one request may spend retrying (botocore has no such knob).

    botocore creates a fresh request object for every attempt and emits
    ``request-created``; the per-request ``context`` dict survives retries, so
    it carries the start time and the last failure for the message.
    """

    def on_request_created(request: Any, **_: Any) -> None:
        ctx = request.context
        now = time.monotonic()
        ctx["dcpstore_attempts"] = ctx.get("dcpstore_attempts", 0) + 1
        started = ctx.setdefault("dcpstore_t0", now)
        if now - started > limit_s:
            raise _OperationTimeout(limit_s, now - started, ctx["dcpstore_attempts"] - 1, ctx.get("dcpstore_last", "?"))

    def on_needs_retry(
        response: Any = None, caught_exception: Any = None, request_dict: Any = None, **_: Any
    ) -> None:
        if request_dict is None:
            return None
        if caught_exception is not None:
            request_dict["context"]["dcpstore_last"] = type(caught_exception).__name__
        elif response is not None and response[0].status_code >= 300:
            code = response[1].get("Error", {}).get("Code", "")
            request_dict["context"]["dcpstore_last"] = f"{code} (HTTP {response[0].status_code})"
        return None  # never decides about retrying: botocore's handler does

    client.meta.events.register("request-created.s3", on_request_created)
    client.meta.events.register("needs-retry.s3", on_needs_retry)


# ---------------------------------------------------------------------------
# Error mapping
# ---------------------------------------------------------------------------


def _client_error_parts(e: bexc.ClientError) -> tuple[str, int, str, int]:
    err = e.response.get("Error", {})
    meta = e.response.get("ResponseMetadata", {})
    return (
        str(err.get("Code", "")),
        int(meta.get("HTTPStatusCode", 0) or 0),
        str(err.get("Message", "")),
        int(meta.get("RetryAttempts", 0) or 0),
    )


def map_error(e: BaseException, what: str, bucket: str, endpoint: str) -> CheckpointError:
    """Translate a botocore exception into the dcpstore family (raise it ``from e``).

    ``what`` names the operation and the URI; ``bucket`` is named when it is
    the bucket that is missing.
    """
    if isinstance(e, CheckpointError):
        return e
    scrub_exception(e)  # an endpoint may echo credentials in its error body
    if isinstance(e, bexc.ClientError):
        code, status, message, retries = _client_error_parts(e)
        return _map_code(code, status, message, retries, what, bucket, endpoint)
    if isinstance(e, bexc.NoCredentialsError | bexc.PartialCredentialsError):
        return StoragePermissionError(
            f"{what}: no usable AWS credentials found (environment, shared credentials file, "
            "profile or instance metadata)"
        )
    if isinstance(e, _OperationTimeout):
        return StorageError(f"{what}: {e}")
    if isinstance(e, bexc.EndpointConnectionError | bexc.ConnectTimeoutError):
        return StorageError(f"{what}: cannot connect to the S3 endpoint {endpoint} ({type(e).__name__}), retries exhausted")
    if isinstance(e, bexc.BotoCoreError | OSError):
        return StorageError(f"{what}: {type(e).__name__} talking to the S3 endpoint {endpoint}, retries exhausted")
    return StorageError(f"{what}: unexpected {type(e).__name__}: {redact(str(e))}")


def _map_code(
    code: str, status: int, message: str, retries: int, what: str, bucket: str, endpoint: str
) -> CheckpointError:
    """Map one S3 error code (a request's, or one key's in DeleteObjects)."""
    code, message = scrub(code), scrub(message)
    if code == "NoSuchBucket":
        return StorageNotFound(f"{what}: bucket {bucket!r} does not exist (S3 endpoint {endpoint})")
    if code in _NOT_FOUND or status == 404:
        return StorageNotFound(f"{what}: no such object")
    if code in _BAD_CREDENTIALS:
        return StoragePermissionError(
            f"{what}: the S3 endpoint {endpoint} refused the credentials ({code}); check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or the AWS profile"
        )
    if code in _DENIED or status == 403:
        return StoragePermissionError(
            f"{what}: access denied by the S3 endpoint {endpoint} ({code or status}): the credentials "
            "were refused or lack permission for this bucket/key"
        )
    tries = f" after {retries + 1} attempts" if retries else ""
    http = f" (HTTP {status})" if status else ""
    return StorageError(f"{what}: S3 error {code or '?'}{http}{tries}: {message}")


def _status_code(e: BaseException) -> tuple[str, int]:
    if isinstance(e, bexc.ClientError):
        code, status, _, _ = _client_error_parts(e)
        return code, status
    return "", 0


# ---------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------


#: S3 allows at most this many parts per multipart upload.
_MAX_PARTS = 10_000


def _part_size_for(part_size: int, size_hint: int | None) -> int:
    """``part_size``, grown (in whole MiB) if ``size_hint`` would need more than 10,000 parts."""
    if not size_hint or size_hint <= part_size * _MAX_PARTS:
        return part_size
    mib = 1 << 20
    needed = -(-size_hint // _MAX_PARTS)
    return -(-needed // mib) * mib


class _S3Writer(ObjectWriter):
    """Streams one object; see the module docstring for the protocol."""

    def __init__(self, storage: S3Storage, path: str, size_hint: int | None = None) -> None:
        super().__init__()
        self._st = storage
        self._path = path
        self._key = storage.key(path)
        self._part_size = _part_size_for(storage.options.part_size_for(size_hint), size_hint)
        self._max_inflight = storage.options.max_concurrency
        self._buf = bytearray()
        self._pos = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._inflight: set[Future[tuple[int, str]]] = set()
        self._etags: dict[int, str] = {}
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        ps = self._part_size
        while view.nbytes:
            if not self._buf and view.nbytes >= ps:
                # A whole part straight from the caller's buffer: one copy.
                self._ship(bytes(view[:ps]))
                view = view[ps:]
                continue
            take = min(ps - len(self._buf), view.nbytes)
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == ps:
                part, self._buf = self._buf, bytearray()
                self._ship(part)
        self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    # -- multipart -----------------------------------------------------------
    def _ship(self, part: bytes | bytearray) -> None:
        """Hand one full part to the pool, waiting while too many are in flight."""
        if self._upload_id is None:
            self._start()
        if self._next_part > _MAX_PARTS:
            raise StorageError(
                f"cannot write {self._st.describe(self._path)}: more than {_MAX_PARTS} parts of "
                f"{self._part_size} bytes (S3's limit); raise StorageOptions.part_size or pass size_hint"
            )
        self._drain(self._max_inflight - 1)
        assert self._pool is not None
        number = self._next_part
        self._next_part += 1
        self._inflight.add(self._pool.submit(self._upload_part, number, part))

    def _start(self) -> None:
        resp = self._st.call(
            f"cannot start multipart upload of {self._st.describe(self._path)}",
            self._st.client.create_multipart_upload,
            Bucket=self._st.bucket,
            Key=self._key,
        )
        self._upload_id = resp["UploadId"]
        self._pool = ThreadPoolExecutor(self._max_inflight, thread_name_prefix="dcpstore-s3-part")

    def _upload_part(self, number: int, body: bytes | bytearray) -> tuple[int, str]:
        resp = self._st.call(
            f"cannot upload part {number} of {self._st.describe(self._path)}",
            self._st.client.upload_part,
            Bucket=self._st.bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        return number, resp["ETag"]

    def _drain(self, keep: int) -> None:
        """Wait until at most ``keep`` parts are in flight; raise the first failure."""
        while len(self._inflight) > keep:
            done, self._inflight = wait(self._inflight, return_when=FIRST_COMPLETED)
            for fut in done:
                number, etag = fut.result()
                self._etags[number] = etag

    # -- commit / abort ------------------------------------------------------
    def _commit(self) -> None:
        if self._upload_id is None:
            self._st.call(
                f"cannot write {self._st.describe(self._path)}",
                self._st.client.put_object,
                Bucket=self._st.bucket,
                Key=self._key,
                Body=bytes(self._buf),
            )
            self._buf = bytearray()
            return
        if self._buf:
            part, self._buf = self._buf, bytearray()
            self._ship(part)
        self._drain(0)
        parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
        try:
            self._st.call(
                f"cannot complete multipart upload of {self._st.describe(self._path)}",
                self._st.client.complete_multipart_upload,
                Bucket=self._st.bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        except StorageNotFound:
            # NoSuchUpload: a retry after the connection dropped *after* S3
            # had completed the upload. Done iff the object is ours.
            if not self._landed(parts):
                raise
        self._upload_id = None
        self._shutdown()

    def _landed(self, parts: list[dict[str, Any]]) -> bool:
        """Is the object at our key the one these parts make (by multipart ETag)?"""
        digest = hashlib.md5(usedforsecurity=False)
        for part in parts:
            digest.update(bytes.fromhex(str(part["ETag"]).strip('"')))
        expected = f"{digest.hexdigest()}-{len(parts)}"
        try:
            head = self._st.client.head_object(Bucket=self._st.bucket, Key=self._key)
        except Exception:
            return False
        return str(head.get("ETag", "")).strip('"') == expected

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _abort(self) -> None:
        self._buf = bytearray()
        # Parts still uploading could land after the abort and survive it:
        # let them finish (or fail) first.
        self._shutdown()
        self._inflight.clear()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            self._st.call(
                f"cannot abort multipart upload of {self._st.describe(self._path)}",
                self._st.client.abort_multipart_upload,
                Bucket=self._st.bucket,
                Key=self._key,
                UploadId=upload_id,
            )
        except StorageNotFound:
            pass  # already gone
        except CheckpointError as e:
            log.warning(
                "%s; its parts stay until 'dcpstore gc %s' or a bucket lifecycle rule removes them",
                e,
                self._st.uri,
            )


# ---------------------------------------------------------------------------
# Storage
# ---------------------------------------------------------------------------


class S3Storage(Storage):
    """A key prefix in an S3 (or S3-compatible) bucket."""

    backend = "s3"

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        super().__init__(url, options)
        self.bucket = url.netloc
        self.prefix = url.path.strip("/")
        self.client = s3_client(self.options)
        self.endpoint = redact(str(self.client.meta.endpoint_url))

    def key(self, path: str) -> str:
        """The S3 key of ``path`` (relative to the root)."""
        if path.startswith("/") or ".." in path.split("/"):
            raise StorageError(f"{self.describe(path)}: path escapes the checkpoint root")
        path = path.rstrip("/")
        if not self.prefix:
            return path
        return f"{self.prefix}/{path}" if path else self.prefix

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """Run one botocore call, mapping its errors to the dcpstore family."""
        try:
            return fn(**kwargs)
        except Exception as e:
            raise map_error(e, what, self.bucket, self.endpoint) from e

    # -- writing -------------------------------------------------------------
    def open_write(self, path: str, *, size_hint: int | None = None) -> ObjectWriter:
        # The first full part decides on multipart; size_hint only grows the
        # part size for objects that would otherwise need > 10,000 parts.
        return _S3Writer(self, path, size_hint)

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        nbytes = memoryview(data).nbytes
        if nbytes < self.options.part_size_for(nbytes):
            self.call(
                f"cannot write {self.describe(path)}",
                self.client.put_object,
                Bucket=self.bucket,
                Key=self.key(path),
                Body=bytes(data),
            )
            return
        super().put(path, data)

    def makedirs(self, path: str = "") -> None:
        """Prefixes need no creation on S3."""

    # -- reading -------------------------------------------------------------
    def _get(self, path: str, offset: int, length: int, if_match: str | None = None) -> tuple[bytes, dict[str, Any]]:
        """One ranged GET, body included (``b""`` and ``{}`` past the end)."""
        got = self._ranged_get(path, offset, length, lambda resp: (resp["Body"].read(), resp), if_match)
        return got if got is not None else (b"", {})

    def _get_into(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        """One ranged GET filling ``buffers`` in order; bytes read, 0 past the end."""
        length = sum(b.nbytes for b in buffers)
        got = self._ranged_get(path, offset, length, lambda resp: _readinto_full(resp["Body"], buffers), None)
        return got or 0

    def _ranged_get(
        self, path: str, offset: int, length: int, consume: Callable[[dict[str, Any]], T], if_match: str | None
    ) -> T | None:
        """GET ``length`` bytes at ``offset`` and return what ``consume`` makes
        of the response (it reads the body); None if ``offset`` is at or past
        the end.

        botocore retries the request itself; a body that breaks off after the
        headers arrived is past its retry loop, so the GET is retried here,
        bounded alike (``max_attempts``, ``op_timeout_s``).
        """
        what = f"cannot read {self.describe(path)}"
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key(path), "Range": f"bytes={offset}-{offset + length - 1}"}
        if if_match:
            kwargs["IfMatch"] = if_match
        deadline = time.monotonic() + self.options.op_timeout_s
        for attempt in range(1, self.options.max_attempts + 1):
            try:
                resp = self.client.get_object(**kwargs)
            except bexc.ClientError as e:
                code, status = _status_code(e)
                if status == 416 or code == "InvalidRange":
                    return None
                if status == 412 or code == "PreconditionFailed":
                    raise StorageError(f"{what}: the object changed while it was being read") from e
                raise map_error(e, what, self.bucket, self.endpoint) from e
            except Exception as e:
                raise map_error(e, what, self.bucket, self.endpoint) from e
            try:
                return consume(resp)
            except _BODY_ERRORS as e:
                if attempt >= self.options.max_attempts or time.monotonic() > deadline:
                    raise map_error(e, what, self.bucket, self.endpoint) from e
                log.debug("%s: body read failed (%s), retrying", what, type(e).__name__)
                time.sleep(min(random.uniform(0, 2**attempt) * 0.05, 2.0))
        raise AssertionError("unreachable")  # the loop returns or raises

    def _in_parallel(self, fn: Callable[..., T], jobs: list[tuple[Any, ...]]) -> list[T]:
        """``[fn(*job) for job in jobs]`` on up to ``max_concurrency`` threads, in order."""
        workers = min(self.options.max_concurrency, len(jobs))
        if workers <= 1:
            return [fn(*job) for job in jobs]
        with ThreadPoolExecutor(workers, thread_name_prefix="dcpstore-s3-get") as pool:
            futures = [pool.submit(fn, *job) for job in jobs]
            return [f.result() for f in futures]

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            self.size(path)  # still report a missing object
            return b""
        # One worker: one GET for the whole range, not several in a row.
        piece = length if self.options.max_concurrency == 1 else self.options.part_size_for(length)
        chunks = self._in_parallel(lambda o, n: self._get(path, o, n)[0], byte_ranges(offset, length, piece))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Ranged GETs in parallel, each body read straight into its stretch
        of ``buffers`` (no whole-object bytes in between)."""
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            self.size(path)  # still report a missing object
            return 0
        ranges = byte_ranges(0, total, self.options.part_size_for(total))
        counts = self._in_parallel(self._get_into, [(path, offset + o, slice_buffers(buffers, o, n)) for o, n in ranges])
        done = 0
        for (_, n), got in zip(ranges, counts):
            done += got
            if got < n:  # the object ended here
                break
        return done

    def read(self, path: str) -> bytes:
        """Whole object: the first ranged GET also tells the size (no HEAD)."""
        ps = self.options.part_size_for(None)
        first, resp = self._get(path, 0, ps)
        if not resp:  # 416: an empty object (or none at all)
            if self.size(path) == 0:
                return b""
            first, resp = self._get(path, 0, ps)
        total = int(str(resp.get("ContentRange", "")).rpartition("/")[2] or len(first))
        if total <= len(first):
            return first
        etag = resp.get("ETag")
        rest = total - len(first)
        ranges = byte_ranges(len(first), rest, self.options.part_size_for(rest))
        chunks = self._in_parallel(lambda o, n: self._get(path, o, n, etag)[0], ranges)
        return b"".join([first, *chunks])

    def size(self, path: str) -> int:
        resp = self.call(
            f"cannot stat {self.describe(path)}", self.client.head_object, Bucket=self.bucket, Key=self.key(path)
        )
        return int(resp["ContentLength"])

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        prefix = prefix.strip("/")
        full = self.key(prefix) if prefix else ""
        if prefix:
            s3_prefix = full
        else:
            s3_prefix = f"{self.prefix}/" if self.prefix else ""
        paginator = self.client.get_paginator("list_objects_v2")
        what = f"cannot list {self.describe(prefix)}"
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=s3_prefix):
                for obj in page.get("Contents", []):
                    key = obj["Key"]
                    if key.endswith("/"):
                        continue  # a "directory marker" some tools create
                    if prefix and key != full and not key.startswith(full + "/"):
                        continue  # root/x matched root/xy.bin
                    info: ObjectInfo = {"path": self._relative(key), "size": int(obj["Size"])}
                    if obj.get("LastModified") is not None:
                        info["mtime"] = obj["LastModified"].timestamp()
                    yield info
        except Exception as e:
            raise map_error(e, what, self.bucket, self.endpoint) from e

    # -- deleting ------------------------------------------------------------
    def delete(self, paths: Iterable[str]) -> None:
        keys = [self.key(p) for p in paths]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            resp = self.call(
                f"cannot delete {len(batch)} object(s) under {self.uri}",
                self.client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
            )
            errors = resp.get("Errors") or []
            if errors:
                # DeleteObjects answers 200 and reports failures per key.
                first = errors[0]
                what = f"cannot delete {self.describe(self._relative(first.get('Key', '')))}"
                if len(errors) > 1:
                    what += f" (and {len(errors) - 1} more of {len(batch)})"
                code, message = str(first.get("Code", "")), str(first.get("Message", ""))
                raise _map_code(code, 0, message, 0, what, self.bucket, self.endpoint)

    def _open_uploads(self) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_multipart_uploads")
        s3_prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=s3_prefix):
                yield from page.get("Uploads", [])
        except Exception as e:
            raise map_error(e, f"cannot list multipart uploads under {self.uri}", self.bucket, self.endpoint) from e

    def list_incomplete(self) -> Iterator[str]:
        """Keys (relative) with an open multipart upload: interrupted writes."""
        for upload in self._open_uploads():
            yield self._relative(upload["Key"])

    def cleanup_incomplete(self, older_than_s: float = 0.0) -> int:
        """Abort open multipart uploads under the prefix started ``older_than_s`` ago or earlier."""
        now = time.time()
        removed = 0
        for upload in list(self._open_uploads()):
            initiated = upload.get("Initiated")
            age = now - initiated.timestamp() if initiated is not None else float("inf")
            if age < older_than_s:
                continue
            with contextlib.suppress(StorageNotFound):
                self.call(
                    f"cannot abort multipart upload of {self.describe(self._relative(upload['Key']))}",
                    self.client.abort_multipart_upload,
                    Bucket=self.bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
                removed += 1
        return removed

    def close(self) -> None:
        """The client is shared per process (see :func:`s3_client`); nothing to release."""
