"""Writing one S3 object: a single PUT, or a multipart upload in parallel.

:class:`S3Writer` is a :class:`~dcpstore.storage.buffered.BufferedObjectWriter`
with a part size, so the base gathers the bytes into parts
(``StorageOptions.part_size_for`` the size hint: by default about
``max_concurrency`` parts of 8-64 MiB per object, so one object keeps that
many connections busy) and this module moves them::

    _write_part   the first full part starts a multipart upload; every full
                  part goes to a small per-object thread pool
                  (``max_concurrency`` parts in flight at most, so at most
                  ~``max_concurrency + 1`` parts are buffered). A failed part
                  fails the next ``write`` (fail fast). While the object is
                  smaller than one part nothing is sent.
    _publish      small object: one ``PutObject``. Multipart: upload the
                  tail, wait for every part, ``CompleteMultipartUpload``. The
                  object becomes visible atomically, and only here.
    _discard      (an exception inside the ``with`` block, or a failed
                  commit) cancel queued parts, wait for those in flight, then
                  ``AbortMultipartUpload``: no parts are left behind.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from ..errors import CheckpointError, StorageError, StorageNotFound
from .base import MiB, Storage
from .buffered import BufferedObjectWriter

T = TypeVar("T")

log = logging.getLogger(__name__)

#: S3 allows at most this many parts per multipart upload.
_MAX_PARTS = 10_000


def _part_size_for(part_size: int, size_hint: int | None) -> int:
    """``part_size``, grown (in whole MiB) if ``size_hint`` would need more than 10,000 parts."""
    if not size_hint or size_hint <= part_size * _MAX_PARTS:
        return part_size
    needed = -(-size_hint // _MAX_PARTS)
    return -(-needed // MiB) * MiB


class S3Writer(BufferedObjectWriter):
    """Streams one object; see the module docstring for the protocol."""

    def __init__(self, storage: Storage, path: str, *, client: Any, bucket: str, key: str, size_hint: int | None) -> None:
        part_size = _part_size_for(storage.options.part_size_for(size_hint), size_hint)
        super().__init__(storage, path, part_size)
        self._client = client
        self._bucket = bucket
        self._key = key
        self._where = storage.describe(path)
        self._part_bytes = part_size
        self._max_inflight = storage.options.max_concurrency
        self._upload_id: str | None = None
        self._next_part = 1
        self._inflight: set[Future[tuple[int, str]]] = set()
        self._etags: dict[int, str] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """One request about this object, its errors mapped by the storage."""
        with self._storage._mapped(what):
            return fn(Bucket=self._bucket, Key=self._key, **kwargs)

    # -- multipart -----------------------------------------------------------
    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        """Hand one full part to the pool, waiting while too many are in flight."""
        if self._upload_id is None:
            self._start()
        if self._next_part > _MAX_PARTS:
            raise StorageError(
                f"{self._what}: more than {_MAX_PARTS} parts of {self._part_bytes} bytes "
                "(S3's limit); raise StorageOptions.part_size or pass size_hint"
            )
        self._drain(self._max_inflight - 1)
        assert self._pool is not None
        number = self._next_part
        self._next_part += 1
        self._inflight.add(self._pool.submit(self._upload_part, number, part))

    def _start(self) -> None:
        resp = self._call(f"cannot start multipart upload of {self._where}", self._client.create_multipart_upload)
        self._upload_id = resp["UploadId"]
        self._pool = ThreadPoolExecutor(self._max_inflight, thread_name_prefix="dcpstore-s3-part")

    def _upload_part(self, number: int, body: bytes | bytearray | memoryview) -> tuple[int, str]:
        resp = self._call(
            f"cannot upload part {number} of {self._where}",
            self._client.upload_part,
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
    def _publish(self, tail: bytearray) -> None:
        if self._upload_id is None:
            self._call(self._what, self._client.put_object, Body=bytes(tail))
            return
        if tail:
            self._write_part(tail)
        self._drain(0)
        parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
        try:
            self._call(
                f"cannot complete multipart upload of {self._where}",
                self._client.complete_multipart_upload,
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
            head = self._client.head_object(Bucket=self._bucket, Key=self._key)
        except Exception:
            return False
        return str(head.get("ETag", "")).strip('"') == expected

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _discard(self) -> None:
        # Parts still uploading could land after the abort and survive it:
        # let them finish (or fail) first.
        self._shutdown()
        self._inflight.clear()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            self._call(
                f"cannot abort multipart upload of {self._where}", self._client.abort_multipart_upload, UploadId=upload_id
            )
        except StorageNotFound:
            pass  # already gone
        except CheckpointError as e:
            log.warning(
                "%s; its parts stay until 'dcpstore gc %s' or a bucket lifecycle rule removes them",
                e,
                self._storage.uri,
            )
