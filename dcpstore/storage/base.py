"""The byte-level storage interface every backend implements.

dcpstore's DCP writer and reader (:mod:`dcpstore.writers`) are written once
against :class:`Storage`; a backend is one module in this package that maps
these few operations onto a filesystem or object store.

Paths are always *relative* to the storage root (the checkpoint URI) and use
``/`` as separator. Call order during a save, per rank::

    storage.makedirs()                       # once, before any write
    with storage.open_write("__0_0.distcp") as w:   # one per data file
        w.write(buf) ...                     # streamed, in order
    # leaving the block commits: the object becomes visible atomically and
    # durable (POSIX: fsync + rename + fsync dir; S3: complete the upload).
    # An exception inside the block aborts: nothing becomes visible.

and on the coordinator, after every rank's files are committed::

    storage.put(".metadata", blob)           # the checkpoint's commit point

Reads are ranged (``read_range``) so a rank loads only the items it needs.
Backends must be safe to call from several threads at once; the writers use
one thread per file.

Errors: a missing object raises :class:`~dcpstore.errors.StorageNotFound`
(also a ``FileNotFoundError``); any other failure, after the backend's own
retries, raises :class:`~dcpstore.errors.StorageError` chained to the cause.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from dataclasses import dataclass
from typing import ClassVar, TypedDict

from typing_extensions import NotRequired

from ..errors import InvalidArgument, StorageNotFound
from .uri import StorageURL, redact

MiB = 1 << 20


@dataclass(frozen=True)
class StorageOptions:
    """Tuning shared by all backends; each reads the fields that apply to it.

    Parsed and validated once (here), then handed to the backend constructor.
    """

    #: Object stores: objects larger than this go up as multipart uploads in
    #: parts of this size; reads larger than this are split into parallel
    #: ranged GETs of this size. None (default): chosen per object or read
    #: from its size (:meth:`part_size_for`).
    part_size: int | None = None
    #: Object stores: concurrent part uploads / ranged GETs per object.
    max_concurrency: int = 8
    #: Object stores: attempts per request (the first try included).
    max_attempts: int = 8
    #: Seconds for connecting and for each read from the socket.
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    #: Upper bound on the time one object operation may take, retries included.
    op_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.part_size is not None and (not isinstance(self.part_size, int) or self.part_size < 5 * MiB):
            raise InvalidArgument(
                f"part_size must be None (automatic) or an int >= 5 MiB (S3's minimum part), got {self.part_size!r}"
            )
        for name in ("max_concurrency", "max_attempts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "op_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {value!r}")

    def part_size_for(self, nbytes: int | None) -> int:
        """The part (upload) or range (read) size for ``nbytes`` bytes.

        ``part_size`` if set. Automatic: about ``max_concurrency`` pieces per
        object or read, so that one object keeps that many connections busy
        (an object store's throughput is per connection), in whole MiB
        between 8 MiB (the range size AWS recommends; S3's minimum part is
        5 MiB) and 64 MiB (few requests for large objects); 16 MiB for a
        stream of unknown size.
        """
        if self.part_size is not None:
            return self.part_size
        if not nbytes:
            return AUTO_PART_UNKNOWN
        per_piece = -(-nbytes // self.max_concurrency)
        return min(AUTO_PART_MAX, max(AUTO_PART_MIN, -(-per_piece // MiB) * MiB))


def byte_ranges(offset: int, length: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive pieces covering ``length`` bytes at ``offset``."""
    end = offset + length
    return [(o, min(piece, end - o)) for o in range(offset, end, piece)]


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


#: Bounds of the automatic part size (see StorageOptions.part_size_for).
AUTO_PART_MIN = 8 * MiB
AUTO_PART_MAX = 64 * MiB
AUTO_PART_UNKNOWN = 16 * MiB


class ObjectInfo(TypedDict):
    """One listed object: its path relative to the storage root and its size.

    ``mtime`` (seconds since the epoch) is given where the backend knows it;
    ``dcpstore gc`` uses it to leave recent, possibly in-flight saves alone.
    """

    path: str
    size: int
    mtime: NotRequired[float]


class ObjectWriter(abc.ABC):
    """A stream that becomes one object when committed, and nothing if aborted.

    Use it as a context manager: a clean exit commits, an exception aborts.
    ``write`` may keep a reference to ``data`` only until it returns.
    """

    def __init__(self) -> None:
        self._closed = False

    @abc.abstractmethod
    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Append ``data``; return the number of bytes written."""

    @abc.abstractmethod
    def tell(self) -> int:
        """Bytes written so far."""

    @abc.abstractmethod
    def _commit(self) -> None:
        """Make the object durable and visible under its final name."""

    @abc.abstractmethod
    def _abort(self) -> None:
        """Discard everything written; leave nothing visible."""

    def commit(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._commit()
        except BaseException:
            self._abort()
            raise

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._abort()

    # Writers are passed to torch.save, which probes these.
    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Storage(abc.ABC):
    """One checkpoint location (a directory or a key prefix) on one backend.

    Construct through :func:`dcpstore.storage.open_storage`, which parses the
    URI once and picks the backend from the registry.
    """

    #: The registry name of this backend (``"local"``, ``"s3"``, ...).
    backend: ClassVar[str]

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        self.url = url
        self.options = options or StorageOptions()

    @property
    def uri(self) -> str:
        """The root URI, safe to print (credentials redacted)."""
        return redact(self.url.uri)

    def describe(self, path: str = "") -> str:
        """A printable URI for ``path`` under this root, for messages."""
        return f"{self.uri.rstrip('/')}/{path}" if path else self.uri

    # -- writing -----------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, path: str, *, size_hint: int | None = None) -> ObjectWriter:
        """Start writing the object ``path``; see :class:`ObjectWriter`.

        ``size_hint`` (the expected size, if known) lets object stores choose
        between a single PUT and a multipart upload up front.
        """

    def put(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole object atomically (write, then commit)."""
        with self.open_write(path, size_hint=len(data)) as writer:
            writer.write(data)

    @abc.abstractmethod
    def makedirs(self, path: str = "") -> None:
        """Ensure the directory ``path`` (default: the root) exists.

        A no-op on object stores, where prefixes need no creation.
        """

    # -- reading -----------------------------------------------------------
    @abc.abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; fewer only if the object ends."""

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
        """Scatter-read: fill ``buffers`` (writable, contiguous byte views),
        in order, from the bytes at ``offset``; return how many arrived
        (fewer only if the object ends).

        Loads read tensor bytes through this straight into the caller's
        tensors: one call covers a run of neighbouring tensors, with scratch
        buffers for the record headers between them, so it costs one request
        per ``part_size`` on object stores and one ``preadv`` locally. The
        default copies from :meth:`read_range`; backends that can land bytes
        in place (``preadv``, a response body's ``readinto``) override it.
        """
        data = memoryview(self.read_range(path, offset, sum(b.nbytes for b in buffers)))
        pos = 0
        for buf in buffers:
            take = min(buf.nbytes, data.nbytes - pos)
            buf[:take] = data[pos : pos + take]
            pos += take
            if take < buf.nbytes:
                break
        return pos

    def read(self, path: str) -> bytes:
        """Read a whole object."""
        return self.read_range(path, 0, self.size(path))

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; :class:`StorageNotFound` if absent."""

    def exists(self, path: str) -> bool:
        try:
            self.size(path)
        except StorageNotFound:
            return False
        return True

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """All objects under ``prefix`` (recursive), paths relative to the root.

        In-progress writes (temporary files, open multipart uploads) are not
        listed.
        """

    # -- deleting ----------------------------------------------------------
    @abc.abstractmethod
    def delete(self, paths: Iterable[str]) -> None:
        """Delete objects; paths that do not exist are ignored."""

    def list_incomplete(self) -> Iterator[str]:
        """Leftovers of interrupted writes (temp files, open uploads).

        Used by ``dcpstore gc``; the default backend has none to report.
        """
        return iter(())

    def cleanup_incomplete(self, older_than_s: float = 0.0) -> int:
        """Remove leftovers of interrupted writes older than ``older_than_s``.

        Returns how many were removed.
        """
        return 0

    def close(self) -> None:
        """Release clients and connections. The storage is unusable afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
