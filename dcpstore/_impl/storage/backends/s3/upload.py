"""Writing one S3 object: a single PUT, or a multipart upload in parallel.

:class:`S3Writer` is a :class:`~dcpstore._impl.storage.buffered.BufferedObjectWriter`
with a part size, so the base gathers the bytes into parts
(``StorageOptions.upload_part_size`` of the size and batch hints: the
caller's whole batch -- a rank's data files -- in about two rounds of its
connection budget, each object in equal parts of 8-64 MiB, so that one
file alone still keeps every connection busy) and this module moves them.
A tensor's bytes are lent, not copied
(:class:`~dcpstore._impl.storage.lending_writer.LendingObjectWriter`): a part
that holds them goes up as a file over the tensor's own memory and the
record headers around it::

    open          an object expected to take more than one part starts its
                  multipart upload at once, on the storage's request pool,
                  while the first part is still being gathered.
    _write_part   every full part goes to the storage's request pool, the
                  connection budget that all of the rank's objects share
                  (at most ``max_concurrency`` parts buffered or in flight
                  per storage: a writer that gets ahead waits). A failed
                  part fails the next ``write`` (fail fast). While the
                  object is smaller than one part nothing is sent.
    _seal         (optional) the last, partial part goes too, before the
                  commit: a caller that checks something first (the save's
                  ownership gate) does not hold it back meanwhile.
    _publish      small object: one ``PutObject``. Multipart: upload the
                  tail (unless sealed), wait for every part,
                  ``CompleteMultipartUpload``. The object becomes visible
                  atomically, and only here.
    _discard      (an exception inside the ``with`` block, or a failed
                  commit) cancel this object's queued parts, wait for those in
                  flight, then ``AbortMultipartUpload``: no parts are left
                  behind. An abort that fails too (the endpoint is down) is
                  left with the storage (``Storage.leave_unfinished``) for
                  the saver to try again.

Integrity in transit: one digest of every request body, which S3 verifies
before it accepts the bytes (the storage's client is configured for it:
:func:`~dcpstore._impl.storage.backends.s3.client._one_digest`). Over HTTPS every PUT
and part carries its CRC32C, computed here with the hardware instruction
(:func:`checksum_args`), a multipart upload is created for CRC32C and
completed with every part's, and the payload goes unsigned (TLS guards it
against tampering): botocore would otherwise SHA-256 every byte for the
signature, and compute a software CRC32 of it too. Over plain HTTP the
SHA-256 payload signature is the digest, and no CRC32C is sent beside it.
AWS_REQUEST_CHECKSUM_CALCULATION=when_required turns the CRC32C off.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from dcpstore._impl.storage.backend_base import BackendBase, errors_mapped
from dcpstore._impl.storage.backends.s3.client import sends_checksums
from dcpstore._impl.storage.byte_ranges import ceil_div
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.lending_writer import LendingObjectWriter, Part, PartBody
from dcpstore._impl.storage.storage_options import MiB
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointError, StorageError, StorageNotFound

T = TypeVar("T")

log = logging.getLogger(__name__)

#: S3 allows at most this many parts per multipart upload.
_MAX_PARTS = 10_000


def checksum_args(body: bytes | bytearray | memoryview | PartBody) -> dict[str, str]:
    """The ``ChecksumCRC32C`` argument of a PutObject / UploadPart of ``body``
    (S3 rejects the request if the bytes it received do not match)."""
    crc = body.crc32c() if isinstance(body, PartBody) else crc32c(body)
    return {"ChecksumCRC32C": base64.b64encode(crc.to_bytes(4, "big")).decode()}


def _part_size_for(part_size: int, size_hint: int | None) -> int:
    """``part_size``, grown (in whole MiB) if ``size_hint`` would need more than 10,000 parts."""
    if not size_hint or size_hint <= part_size * _MAX_PARTS:
        return part_size
    needed = ceil_div(size_hint, _MAX_PARTS)
    return ceil_div(needed, MiB) * MiB


class S3Writer(LendingObjectWriter):
    """Streams one object; see the module docstring for the protocol. Lent
    bytes (a tensor's) go up from where they lie: such a part is a file
    over its pieces, which botocore reads (to sign it) and sends."""

    def __init__(
        self,
        storage: BackendBase,
        path: str,
        *,
        client: Any,
        bucket: str,
        key: str,
        size_hint: int | None,
        batch_hint: int | None = None,
    ) -> None:
        part_size = _part_size_for(storage.options.upload_part_size(size_hint, batch_hint), size_hint)
        super().__init__(storage, path, part_size, size_hint)
        self._client = client
        self._bucket = bucket
        self._key = key
        self._where = storage.describe(path)
        self._part_bytes = part_size
        self._requests = storage._requests
        self._checksums = sends_checksums(client)
        self._upload_id: str | None = None
        self._next_part = 1
        self._inflight: set[Future[dict[str, Any]]] = set()
        self._parts: dict[int, dict[str, Any]] = {}
        # An object the hint says needs parts starts its upload now, so that
        # the round trip overlaps gathering the first part.
        self._creating: Future[str] | None = None
        if size_hint and size_hint > part_size:
            self._creating = self._requests.submit_buffered(self._create)

    def _call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """One request about this object, its errors mapped by the storage."""
        with errors_mapped(self._storage, what):
            return fn(Bucket=self._bucket, Key=self._key, **kwargs)

    # -- multipart -----------------------------------------------------------
    def _write_part(self, part: bytes | bytearray | memoryview | PartBody) -> None:
        """Hand one full part to the storage's request pool (waiting while the
        storage has ``max_concurrency`` parts buffered or in flight)."""
        if self._upload_id is None:
            self._upload_id = self._created()
        if self._next_part > _MAX_PARTS:
            raise StorageError(
                f"{self._what}: more than {_MAX_PARTS} parts of {self._part_bytes} bytes "
                "(S3's limit); raise StorageOptions.part_size or pass size_hint"
            )
        self._harvest(wait_all=False)  # fail fast: a failed part stops the writer here
        number = self._next_part
        self._next_part += 1
        self._inflight.add(self._requests.submit_buffered(self._upload_part, number, part))

    def _create(self) -> str:
        """Start the multipart upload; its id."""
        algorithm = {"ChecksumAlgorithm": "CRC32C"} if self._checksums else {}
        resp = self._call(
            f"cannot start multipart upload of {self._where}", self._client.create_multipart_upload, **algorithm
        )
        return str(resp["UploadId"])

    def _created(self) -> str:
        """The upload's id: the one started at open, else one started now."""
        creating, self._creating = self._creating, None
        return creating.result() if creating is not None else self._create()

    def _upload_part(self, number: int, body: bytes | bytearray | memoryview | PartBody) -> dict[str, Any]:
        """Upload one part (on a pool thread); its entry for ``CompleteMultipartUpload``."""
        checksum = checksum_args(body) if self._checksums else {}
        resp = self._call(
            f"cannot upload part {number} of {self._where}",
            self._client.upload_part,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
            **checksum,
        )
        self._recycle(body)  # sent and answered: nothing reads it any more (a failed part's buffer is dropped)
        return {"PartNumber": number, "ETag": resp["ETag"], **checksum}

    def _harvest(self, *, wait_all: bool) -> None:
        """Collect the ETags of this object's finished parts (all of them,
        waiting, with ``wait_all``); raise the first failure."""
        if wait_all:
            wait(self._inflight)
        done = {f for f in self._inflight if f.done()}
        self._inflight -= done
        for fut in done:
            part = fut.result()
            self._parts[part["PartNumber"]] = part

    # -- seal / commit / abort -----------------------------------------------
    def _multipart(self) -> bool:
        return self._upload_id is not None or self._creating is not None

    def _seal(self, tail: Part) -> Part:  # type: ignore[override]
        if tail and self._multipart():
            self._write_part(tail)  # the last part: any size S3 allows
            return bytearray()
        return tail  # a single PUT makes the object visible: it waits for the commit

    def _publish(self, tail: Part) -> None:
        if not self._multipart() or (self._upload_id is None and not tail):
            self._drop_creating()  # the hint was too high: one PUT after all
            self._call(
                self._what, self._client.put_object, Body=tail, **(checksum_args(tail) if self._checksums else {})
            )
            self._recycle(tail)
            return
        if tail:
            self._write_part(tail)
        self._harvest(wait_all=True)
        parts = [self._parts[n] for n in sorted(self._parts)]
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

    def _drop_creating(self) -> None:
        """Abort the upload started at open that is not going to be used."""
        if self._creating is not None:
            self._discard()

    def _discard(self) -> None:
        # Parts still uploading could land after the abort and survive it:
        # drop the queued ones, let the others finish (or fail) first.
        for fut in self._inflight:
            fut.cancel()
        wait(self._inflight)
        self._inflight.clear()
        creating, self._creating = self._creating, None
        if creating is not None and self._upload_id is None:
            wait([creating])  # started at open: it may have created an upload
            if creating.exception() is None:
                self._upload_id = creating.result()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        try:
            self._call(
                f"cannot abort multipart upload of {self._where}",
                self._client.abort_multipart_upload,
                UploadId=upload_id,
            )
        except StorageNotFound:
            pass  # already gone
        except CheckpointError as e:
            log.warning(
                "%s; the upload stays open: the saver that wrote it tries again later (its next save, close() and "
                "exit), and 'dcpstore gc %s' or a bucket lifecycle rule removes it",
                e,
                self._storage.uri,
            )
            abort = IncompleteWrite(self._path, None, upload_id)
            self._storage.leave_unfinished(
                f"abort the multipart upload of {self._where}",
                functools.partial(self._storage.remove_incomplete, [abort]),
            )
