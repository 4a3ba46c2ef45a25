"""Helpers every backend shares; the interface itself is :mod:`.base`.

Byte arithmetic for splitting reads (:func:`byte_ranges`,
:func:`slice_buffers`), the built-in exceptions mapped to the dcpstore
family (:func:`map_os_error`; :func:`library_text` is where every text
from a library or server passes before it enters a message), how many connections
a storage's HTTP client keeps (:func:`http_pool_size`), and POSIX
durability (:func:`fsync_dir`), what a file read from a local filesystem
may resolve to (:class:`LocalRoot`), and the AWS environment boto3 clients read
(:func:`aws_env_fingerprint`, :func:`aws_retry_mode`: the native S3 and the
MSC backends build theirs alike).

Imports only :mod:`dcpstore._impl.errors`, :mod:`.secrets` and :mod:`.uri`.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Sequence

from dcpstore._impl.errors import CheckpointError, StorageError, StorageNotFound, StoragePermissionError, UnsafeCheckpoint
from dcpstore._impl.storage.secrets import scrub, scrub_exception
from dcpstore._impl.storage.uri import redact


#: How much larger than the asked size a piece of :func:`byte_ranges` may
#: grow (1/8): rather than a last piece of a few bytes.
PIECE_SLACK = 8


def byte_ranges(offset: int, length: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive pieces covering ``length`` bytes at
    ``offset``, about ``piece`` bytes each.

    The pieces are of equal size (to a byte), at most ``piece + piece //
    PIECE_SLACK``: a read of 4 x 8 MiB and a 12 KiB record trailer is four
    ranged GETs, not five, one of them for 12 KiB (a whole round trip, and a
    connection taken from the budget the others share).
    """
    if length <= 0:
        return []
    return equal_ranges(offset, length, -(-length // (piece + piece // PIECE_SLACK)))


def equal_ranges(offset: int, length: int, count: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``count`` consecutive pieces of equal size (to
    a byte) covering ``length`` bytes at ``offset`` (fewer if there are fewer bytes)."""
    count = max(1, min(count, length))
    size, bigger = divmod(length, count)
    ranges = []
    for i in range(count):
        n = size + (i < bigger)
        ranges.append((offset, n))
        offset += n
    return ranges


def slice_buffers(buffers: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """The views of bytes ``[start, start + length)`` of the concatenation of
    ``buffers`` (for splitting a scatter read into requests, or resuming one)."""
    out: list[memoryview] = []
    pos = 0
    end = start + length
    for buf in buffers:
        lo, hi = max(start, pos), min(end, pos + buf.nbytes)
        if lo < hi:
            out.append(buf[lo - pos : hi - pos])
        pos += buf.nbytes
        if pos >= end:
            break
    return out


#: Connections beyond the request pool: the writer and reader threads make
#: their own small requests (start and complete an upload, a HEAD, a
#: one-range GET) beside the pool's, one at a time each.
CALLER_CONNECTIONS = 16


def http_pool_size(max_concurrency: int) -> int:
    """Connections an object-store client keeps open for a storage whose
    request pool is ``max_concurrency`` wide (see :mod:`.pool`): one per pool
    thread, plus :data:`CALLER_CONNECTIONS` for the callers' own requests.
    Fewer would make a request wait for a connection, or open and drop one
    (urllib3 discards connections beyond its pool)."""
    return max_concurrency + CALLER_CONNECTIONS


def disk_workers() -> int:
    """Writer/reader threads per rank on a local (or locally mounted) disk:
    one per CPU, between 2 and 8. A disk's throughput grows with the requests
    queued at it and every thread also copies and checksums, so the CPUs
    are the parallelism; beyond 8 the queue is deep enough for an NVMe
    drive and more files only add fsyncs."""
    return max(2, min(8, os.cpu_count() or 1))


def library_text(text: str) -> str:
    """Text from a storage library or server (an exception's message, an
    S3 error body) made fit for our messages. Every such text passes here,
    so that this is the one place where it is cleaned (URIs redacted,
    credentials scrubbed: an endpoint may echo them back)."""
    return scrub(redact(str(text))).strip()


def library_detail(e: BaseException) -> str:
    """A library exception, as error messages quote it (see :func:`library_text`).

    An ``OSError`` with an errno reads ``No space left on device (ENOSPC)``;
    anything else ``TypeName: its text``.
    """
    if isinstance(e, OSError) and e.strerror and e.errno:
        code = errno.errorcode.get(e.errno, "")
        return e.strerror + (f" ({code})" if code else "")
    scrub_exception(e)  # quoted here, and chained to ours by the caller
    text = library_text(str(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def map_os_error(e: BaseException, what: str, *, denied: str = "permission denied") -> CheckpointError:
    """The dcpstore exception for a built-in error (``OSError`` and kin, which
    most storage libraries raise), ``what`` naming the operation and URI."""
    if isinstance(e, FileNotFoundError):
        return StorageNotFound(f"{what}: no such file or directory")
    if isinstance(e, NotADirectoryError):  # a path component is a file
        return StorageNotFound(f"{what}: a parent is not a directory")
    if isinstance(e, PermissionError):
        return StoragePermissionError(f"{what}: {denied}")
    return StorageError(f"{what}: {library_detail(e)}")


class LocalRoot:
    """A storage root on a local filesystem, and the rule for what is read
    under it: a file read must resolve (every symbolic link followed) to a
    path inside the root, else :class:`UnsafeCheckpoint` naming it. A link
    to elsewhere inside the checkpoint is fine; one out of it (to another
    checkpoint, ``/etc``, a device) is never followed. The root itself may
    be reached through links: it is resolved once it exists (a save creates
    it). The local, MSC POSIX and fsspec local backends all check here."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._real: str | None = None

    def real(self) -> str:
        """The root, its links resolved."""
        if self._real is not None:
            return self._real
        real = os.path.realpath(self.root)
        if os.path.isdir(real):
            self._real = real
        return real

    def check(self, resolved: str, where: str) -> None:
        """``resolved`` (a file's path, links resolved) lies inside the root;
        ``where`` names the file in the error."""
        real_root = self.real()
        if resolved != real_root and not resolved.startswith(real_root.rstrip(os.sep) + os.sep):
            raise UnsafeCheckpoint(
                f"{where} resolves to {resolved}, outside the checkpoint directory {real_root} "
                "(a symbolic link out of it): dcpstore reads nothing outside a checkpoint"
            )

    def check_path(self, full: str, where: str) -> None:
        """:meth:`check` for the file at ``full``, resolved now (for backends
        that open by path: the resolution and their open are two steps)."""
        self.check(os.path.realpath(full), where)


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in ``path`` durable (POSIX needs the directory fsynced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Environment variables that change which endpoint, region or credentials a
#: new client gets; a client is reused only while they are unchanged.
AWS_ENV_KEYS = (
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
    "AWS_REQUEST_CHECKSUM_CALCULATION",
    "AWS_CA_BUNDLE",
)


def aws_env_fingerprint() -> str:
    """A digest of the AWS environment a new boto3 client would read: a
    cached client is reused only while it is unchanged."""
    # Hashed so that the cache key never holds a credential in clear text.
    digest = hashlib.sha256()
    for key in AWS_ENV_KEYS:
        digest.update(f"{key}={os.environ.get(key, '<unset>')}\n".encode())
    return digest.hexdigest()


def aws_retry_mode() -> str:
    """botocore's retry mode for dcpstore's clients: ``standard``, or the
    user's explicit ``adaptive`` (``AWS_RETRY_MODE``)."""
    mode = os.environ.get("AWS_RETRY_MODE", "").strip().lower()
    # "legacy" (botocore's default when unset) retries fewer errors and has no
    # retry quota; we want standard (or the user's explicit adaptive).
    return mode if mode in ("standard", "adaptive") else "standard"
