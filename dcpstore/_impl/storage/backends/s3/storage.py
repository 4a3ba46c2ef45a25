"""Native S3 backend (boto3): ``s3://bucket/prefix``.

The backend is three modules, one job each:

* this one, :class:`S3Storage`: keys under the prefix, ranged reads,
  listing, deleting, and the leftovers of interrupted uploads;
* :mod:`.upload`: writing one object (a PUT, or a parallel multipart
  upload that becomes visible only when completed);
* :mod:`.client`: the shared boto3 clients, retries and deadlines, and
  the mapping of botocore errors to the :mod:`dcpstore._impl.util.errors` family.

A checkpoint commits by writing ``.metadata`` last (see
:mod:`dcpstore._impl.dcp.commit`), after every data object is complete. If the
process dies between data and commit, the prefix holds data objects but no
``.metadata``: it is not a checkpoint, the next save to the same URI
overwrites it (and deletes stale data files after its own commit), and
``dcpstore gc`` removes it. A crash in the middle of a multipart upload leaves
an open upload that S3 never shows as an object; :meth:`S3Storage.incomplete_writes`
lists and :meth:`S3Storage.remove_incomplete` (``dcpstore gc``) aborts those
under the prefix (a bucket lifecycle rule ``AbortIncompleteMultipartUpload``
does the same server-side).

Reads are ranged GETs; a long read is split into ranges (sized like parts)
fetched on the storage's read pool, up to ``max_concurrency`` at a time,
each response body read straight into the caller's buffers
(:meth:`S3Storage.read_into`). A body that breaks off after the headers
arrived is past botocore's retry loop, so that GET is retried here, bounded
alike (``max_attempts``, ``op_timeout_s``).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import botocore.exceptions as bexc
from botocore.response import StreamingBody

from dcpstore._impl.storage.backend_base import BackendBase
from dcpstore._impl.storage.backends.s3.client import client_error, map_code, map_error, s3_client, sends_checksums
from dcpstore._impl.storage.backends.s3.error_codes import Meaning, meaning
from dcpstore._impl.storage.backends.s3.upload import S3Writer, checksum_args
from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter
from dcpstore._impl.storage.byte_ranges import byte_ranges, equal_ranges, slice_buffers
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.secrets import scrub
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.storage.uri import StorageURL, redact
from dcpstore._impl.util.errors import CheckpointError, StorageError, StorageNotFound

__all__ = ["S3Storage", "s3_client"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: S3 accepts at most this many keys per DeleteObjects request.
_DELETE_BATCH = 1000

#: Errors raised while *reading a response body*, after botocore's retry loop
#: has already returned: retried here (s3transfer does the same).
_BODY_ERRORS = (
    bexc.IncompleteReadError,
    bexc.ResponseStreamingError,
    bexc.ReadTimeoutError,
    bexc.ConnectionClosedError,
)


def _socket_reader(body: Any) -> Callable[[memoryview], int] | None:
    """``readinto`` of the HTTP response under a plain botocore body, or None.

    botocore's ``readinto`` goes through urllib3's, which reads into a new
    bytes object and copies it (and http.client's ``read(n)`` copies once
    more): three copies of every byte. http.client's own ``readinto`` receives
    straight into the caller's buffer. Taken only for a plain
    ``StreamingBody`` (not one that verifies a response checksum) over an
    undecoded http.client response; anything else keeps botocore's path.
    """
    if type(body) is not StreamingBody:
        return None
    raw: Any = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if raw is None or not isinstance(fp, http.client.HTTPResponse) or getattr(raw, "_decoder", None) is not None:
        return None
    if str(raw.headers.get("content-encoding", "")).lower() not in ("", "identity"):
        return None
    reader: Callable[[memoryview], int] = fp.readinto
    return reader


def _total_size(resp: dict[str, Any]) -> int | None:
    """The object's whole size, from a ranged GET's ``Content-Range``."""
    total = str(resp.get("ContentRange", "")).rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _readinto_full(body: Any, buffers: list[memoryview], expected: int) -> int:
    """Fill ``buffers`` in order from a botocore ``StreamingBody`` whose
    response promised ``expected`` bytes; fewer only at the object's end.

    A body that ends before ``expected`` raises botocore's
    ``IncompleteReadError``, a socket error while reading it its
    ``ResponseStreamingError``: both mean the connection dropped, and the GET
    is retried.
    """
    readinto = _socket_reader(body)
    done = 0
    clean = False
    try:
        for out in buffers:
            pos = 0
            while pos < out.nbytes:
                try:
                    n = readinto(out[pos:]) if readinto else body.readinto(out[pos:])
                except (OSError, http.client.HTTPException) as e:
                    raise bexc.ResponseStreamingError(error=e) from e
                if not n:
                    if done + pos < expected:
                        raise bexc.IncompleteReadError(actual_bytes=done + pos, expected_bytes=expected)
                    clean = True
                    return done + pos
                pos += n
            done += pos
        clean = done == expected
    finally:
        if readinto is not None and clean:
            body._raw_stream.release_conn()  # read to its end: the connection can serve another request
        body.close()
    return done


class _ObjectChanged(StorageError):
    """A GET pinned to the ETag of an earlier one (``If-Match``) found the
    object replaced: :meth:`S3Storage.read` reads it again."""


class S3Storage(BackendBase):
    """A key prefix in an S3 (or S3-compatible) bucket."""

    backend = "s3"

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        super().__init__(url, options)
        self.bucket = url.netloc
        self.prefix = url.path.strip("/")
        self.client = s3_client(self.options)
        self._checksums = sends_checksums(self.client)
        self._sizes: dict[str, int] = {}  # see size_seen
        self.endpoint = redact(str(self.client.meta.endpoint_url))

    def key(self, path: str) -> str:
        """The S3 key of ``path`` (relative to the root)."""
        return self._join_root(self.prefix, path)

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def _map_error(self, e: Exception, what: str) -> CheckpointError:
        return map_error(e, what, self.bucket, self.endpoint)

    def call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """Run one botocore call, mapping its errors to the dcpstore family."""
        with self._mapped(what):
            return fn(**kwargs)

    # -- writing -------------------------------------------------------------
    def open_write(self, path: str, *, size_hint: int | None = None, batch_hint: int | None = None) -> ObjectWriter:
        # The hints size the parts (and start the upload at once where the
        # object will need several); the first full part decides on multipart.
        return S3Writer(
            self,
            path,
            client=self.client,
            bucket=self.bucket,
            key=self.key(path),
            size_hint=size_hint,
            batch_hint=batch_hint,
        )

    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        nbytes = memoryview(data).nbytes
        if nbytes < self.options.upload_part_size(nbytes):
            body = bytes(data)
            self.call(
                f"cannot write {self.describe(path)}",
                self.client.put_object,
                Bucket=self.bucket,
                Key=self.key(path),
                Body=body,
                **(checksum_args(body) if self._checksums else {}),
            )
            return
        super().put(path, data)

    def makedirs(self, path: str = "") -> None:
        """Prefixes need no creation on S3 (``path`` is still checked)."""
        self.key(path)

    # -- reading -------------------------------------------------------------
    def _get(self, path: str, offset: int, length: int, if_match: str | None = None) -> tuple[bytes, dict[str, Any]]:
        """One ranged GET, body included (``b""`` and ``{}`` past the end)."""
        got = self._ranged_get(path, offset, length, lambda resp: (resp["Body"].read(), resp), if_match)
        return got if got is not None else (b"", {})

    def _get_into(self, path: str, offset: int, buffers: list[memoryview]) -> int:
        """One ranged GET filling ``buffers`` in order; bytes read, 0 past the end."""
        length = sum(b.nbytes for b in buffers)
        got = self._ranged_get(
            path, offset, length, lambda resp: _readinto_full(resp["Body"], buffers, int(resp["ContentLength"])), None
        )
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
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self.key(path),
            "Range": f"bytes={offset}-{offset + length - 1}",
        }
        if if_match:
            kwargs["IfMatch"] = if_match

        def one_try() -> T | None:
            try:
                resp = self.client.get_object(**kwargs)
            except Exception as e:
                found = meaning(*client_error(e))
                if found is Meaning.PAST_END:
                    return None
                if found is Meaning.CHANGED:
                    raise _ObjectChanged(f"{what}: the object changed while it was being read") from e
                raise self._error(e, what) from e
            total = _total_size(resp)
            if total is not None:
                self._sizes[path] = total
            return consume(resp)

        def again(e: Exception, attempt: int) -> None:
            log.debug("%s: body read failed (%s), retrying", what, type(e).__name__)
            time.sleep(min(random.uniform(0, 2**attempt) * 0.05, 2.0))

        try:
            return self._retried(one_try, _BODY_ERRORS, again)
        except _BODY_ERRORS as e:
            raise self._error(e, what) from e

    def _retried(
        self, one_try: Callable[[], T], retried: tuple[type[Exception], ...], again: Callable[[Exception, int], None]
    ) -> T:
        """``one_try()``, tried again while it raises one of ``retried``,
        bounded as a request's retries are: ``max_attempts`` tries at most,
        and none begun once ``op_timeout_s`` has passed since the first.
        ``again(error, attempt)`` runs before each further try (it logs, it
        may wait); the last try's error is raised as it is."""
        deadline = time.monotonic() + self.options.op_timeout_s
        for attempt in range(1, self.options.max_attempts + 1):
            try:
                return one_try()
            except retried as e:
                if attempt >= self.options.max_attempts or time.monotonic() > deadline:
                    raise
                again(e, attempt)
        raise AssertionError("unreachable")  # the loop returns or raises

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            self.size(path)  # still report a missing object
            return b""
        # One worker: one GET for the whole range, not several in a row.
        piece = length if self.options.max_concurrency == 1 else self.options.part_size_for(length)
        chunks = self._in_parallel(lambda o, n: self._get(path, o, n)[0], byte_ranges(offset, length, piece))
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview], *, batch_hint: int | None = None) -> int:
        """Ranged GETs in parallel, each body read straight into its stretch
        of ``buffers`` (no whole-object bytes in between): ranges of
        ``part_size`` if set, else equal ones, as many as
        :meth:`StorageOptions.transfer_pieces` gives this read in its batch."""
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            self.size(path)  # still report a missing object
            return 0
        if self.options.part_size is not None:
            ranges = byte_ranges(0, total, self.options.part_size)
        else:
            ranges = equal_ranges(0, total, self.options.transfer_pieces(total, batch_hint))
        counts = self._in_parallel(
            self._get_into, [(path, offset + o, slice_buffers(buffers, o, n)) for o, n in ranges]
        )
        done = 0
        for (_, n), got in zip(ranges, counts):
            done += got
            if got < n:  # the object ended here
                break
        return done

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """Whole object: the first ranged GET also tells the size (no HEAD);
        one over ``limit`` is refused from that GET's headers, its body left
        unread. The ranges after it are pinned to its ETag (``If-Match``), so
        all of them are of one version; should a replace land in between,
        the read starts again (``max_attempts`` reads at most, within
        ``op_timeout_s``), so that it returns the new version, whole."""

        def again(e: Exception, attempt: int) -> None:
            log.debug("%s changed while it was being read; reading it again", self.describe(path))

        return self._retried(lambda: self._read_pinned(path, limit), (_ObjectChanged,), again)

    def _read_pinned(self, path: str, limit: int | None) -> bytes:
        """One try of :meth:`read`: :class:`_ObjectChanged` if the object is
        replaced between its first GET and a later one."""
        ps = self.options.part_size_for(None)
        first_len = ps if limit is None else max(1, min(ps, limit))

        def consume(resp: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
            total = _total_size(resp)
            if total is not None and limit is not None and total > limit:
                resp["Body"].close()
                self.check_limit(path, total, limit)
            return resp["Body"].read(), resp

        got = self._ranged_get(path, 0, first_len, consume, None)
        first, resp = got if got is not None else (b"", {})
        if not resp:  # 416: an empty object (or none at all)
            if self.size(path) == 0:
                return b""
            return self._read_pinned(path, limit)  # it was written meanwhile
        total = _total_size(resp) or len(first)
        if total <= len(first):
            return first
        etag = resp.get("ETag")
        rest = total - len(first)
        ranges = byte_ranges(len(first), rest, self.options.part_size_for(rest))
        chunks = self._in_parallel(lambda o, n: self._get(path, o, n, etag)[0], ranges)
        return b"".join([first, *chunks])

    def size_seen(self, path: str) -> int | None:
        return self._sizes.get(path)

    def learn_sizes(self) -> None:
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            page = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        except Exception as e:  # noqa: BLE001 -- the sizes are then asked for one by one
            log.debug("listing %s for its sizes failed: %s", self.uri, scrub(str(e)))
            return
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.startswith(prefix) and not key.endswith("/"):
                self._sizes[self._relative(key)] = int(obj["Size"])

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
        with self._mapped(f"cannot list {self.describe(prefix)}"):
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
                raise map_code(code, 0, message, 0, what, self.bucket, self.endpoint)

    def _open_uploads(self) -> Iterator[dict[str, Any]]:
        paginator = self.client.get_paginator("list_multipart_uploads")
        s3_prefix = f"{self.prefix}/" if self.prefix else ""
        with self._mapped(f"cannot list multipart uploads under {self.uri}"):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=s3_prefix):
                yield from page.get("Uploads", [])

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        """Open multipart uploads under the prefix (interrupted writes, or
        writes in progress), each with its upload id and the time since it
        was started."""
        now = time.time()
        found = []
        for upload in self._open_uploads():
            initiated = upload.get("Initiated")
            age = now - initiated.timestamp() if initiated is not None else None
            found.append(IncompleteWrite(self._relative(upload["Key"]), age, str(upload["UploadId"])))
        return found

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """Abort each upload by its id (one already completed or aborted is
        not counted)."""
        removed = 0
        for write in writes:
            with contextlib.suppress(StorageNotFound):
                self.call(
                    f"cannot abort multipart upload of {self.describe(write.path)}",
                    self.client.abort_multipart_upload,
                    Bucket=self.bucket,
                    Key=self.key(write.path),
                    UploadId=write.key,
                )
                removed += 1
        return removed

    def close(self) -> None:
        """Shut the read pool; the client is shared per process (see :func:`s3_client`) and stays."""
        super().close()
