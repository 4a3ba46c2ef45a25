"""The byte-level storage interface every backend implements.

dcpstore's DCP writer and reader (:mod:`dcpstore._impl.dcp`) are written once
against :class:`Storage`; a backend is one module in this package that maps
these few operations onto a filesystem or object store.

Paths are always *relative* to the storage root (the checkpoint URI) and use
``/`` as separator. Call order during a save, per rank::

    storage.makedirs()                       # once, before any write
    with storage.open_write("__0_0.distcp", size_hint=n, batch_hint=total) as w:
        w.write(buf) ...                     # one per data file, streamed, in order
        w.seal()                             # optional: no more bytes; send the rest
    # leaving the block commits: the object becomes visible atomically and
    # durable (POSIX: fsync + rename + fsync dir; S3: complete the upload).
    # An exception inside the block aborts: nothing becomes visible.

and on the coordinator, after every rank's files are committed::

    storage.put(".metadata", blob)           # the checkpoint's commit point

Reads are ranged (``read_range``) so a rank loads only the items it needs.
Backends must be safe to call from several threads at once; the writers use
one thread per file.

Errors: a missing object raises :class:`~dcpstore._impl.util.errors.StorageNotFound`
(also a ``FileNotFoundError``); any other failure, after the backend's own
retries, raises :class:`~dcpstore._impl.util.errors.StorageError` chained to the cause.

The backend kit: what every backend needs is written once, as protected
members of :class:`Storage` that only backends call -- the root-containment
check (``_relpath``), the error mapping (``_mapped`` around each library
call, or ``_error`` in a handler of the backend's own, both translating
through the backend's ``_map_error``), and one request pool per instance
(:class:`~dcpstore._impl.storage.request_pool.RequestPool`: the connection budget that
ranged reads, ``_in_parallel``, and part uploads share), shut down by
:meth:`Storage.close`.
Object writers build on :class:`~dcpstore._impl.storage.buffered.BufferedObjectWriter`,
which owns position, ``tell`` and part buffering.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, ClassVar, TypedDict, TypeVar

from typing_extensions import NotRequired

from dcpstore._impl.util.errors import CheckpointError, ObjectTooLarge, StorageError, StorageNotFound
from dcpstore._impl.storage.error_mapping import map_os_error
from dcpstore._impl.storage.storage_options import OBJECT_STORE_WORKERS, StorageOptions
from dcpstore._impl.storage.incomplete import IncompleteWrite, Unfinished
from dcpstore._impl.storage.request_pool import RequestPool
from dcpstore._impl.storage.secrets import scrub_exception
from dcpstore._impl.storage.uri import StorageURL, redact

T = TypeVar("T")


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

    def write_lent(self, data: bytes | bytearray | memoryview, owner: object) -> int:
        """:meth:`write` ``data``, which its caller promises stays unchanged,
        and alive while ``owner`` is, until this object is committed or
        aborted (a tensor's storage, for one). A writer may then send it from
        where it lies instead of copying it (keeping ``owner`` meanwhile);
        this one copies, like :meth:`write`."""
        return self.write(data)

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

    def seal(self) -> None:
        """No byte follows the ones written: start sending what is still
        buffered. The object still becomes visible only at :meth:`commit`
        (and nothing of it if the writer is aborted). For a caller that has
        something to check between its last write and the commit (a save's
        ownership gate) and would otherwise hold the object's last part back
        meanwhile. A write after it is refused. The default does nothing:
        a backend that buffers nothing has nothing to send early."""

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
    #: What this backend's library raises, which :meth:`_mapped` translates
    #: through :meth:`_map_error`; anything else (a bug) passes unchanged.
    _library_errors: ClassVar[tuple[type[Exception], ...]] = (Exception,)

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        self.url = url
        self.options = options or StorageOptions()
        #: This storage's connection budget: every parallel request (ranged
        #: GETs, part uploads) of every file runs here.
        #: (A wrapping Storage may set ``backend`` only after this returns.)
        name = getattr(self, "backend", type(self).__name__)
        self._requests = RequestPool(self.options.max_concurrency, f"dcpstore-{name}-io")
        self._unfinished: list[Unfinished] = []
        self._unfinished_lock = threading.Lock()

    @property
    def uri(self) -> str:
        """The root URI, safe to print (credentials redacted)."""
        return redact(self.url.uri)

    def default_workers(self) -> int:
        """Writer and reader threads per rank when a save or load names none.

        Object stores (this default): :data:`OBJECT_STORE_WORKERS`, whatever
        the CPU count. Their throughput comes from requests in flight, and
        the storage's connection budget (``max_concurrency``) keeps those in
        flight across all of a rank's files, so the threads only have to
        serialise, checksum and verify faster than the network moves the
        bytes; more of them would only make more, smaller files (more
        requests, more objects to list). Backends on a local disk override
        this: there the threads are the parallelism.
        """
        return OBJECT_STORE_WORKERS

    def describe(self, path: str = "") -> str:
        """A printable URI for ``path`` under this root, for messages."""
        return f"{self.uri.rstrip('/')}/{path}" if path else self.uri

    def leave_unfinished(self, what: str, retry: Callable[[], object]) -> None:
        """Record a clean-up that failed (an abort, a delete), for the owner
        of the write to try again later (:meth:`take_unfinished`)."""
        with self._unfinished_lock:
            self._unfinished.append(Unfinished(what, retry))

    def take_unfinished(self) -> list[Unfinished]:
        """The clean-ups recorded since the last call (and forget them)."""
        with self._unfinished_lock:
            taken, self._unfinished = self._unfinished, []
        return taken

    def local_path(self) -> str | None:
        """The directory of this machine's filesystem the root is, where it is
        one (a local path, MSC's POSIX profiles, fsspec's local filesystem),
        else None: what :func:`~dcpstore._impl.storage.overlap.overlap` compares."""
        return None

    # -- the backend kit -----------------------------------------------------
    def _relpath(self, path: str) -> str:
        """``path``, checked to stay under the root, without a trailing ``/``.

        Every backend resolves a path through this before it touches the
        store: an absolute path or a ``..`` component raises
        :class:`StorageError` (a crafted manifest must not reach outside the
        checkpoint).
        """
        if path.startswith("/") or ".." in path.split("/"):
            raise StorageError(f"{self.describe(path)}: path escapes the checkpoint root")
        return path.rstrip("/")

    def _join_root(self, root: str, path: str) -> str:
        """``root/path`` for an object-store style ``root`` (``""``: the bucket or
        filesystem root), ``path`` checked by :meth:`_relpath`."""
        path = self._relpath(path)
        if not root:
            return path
        return f"{root}/{path}" if path else root

    def _map_error(self, e: Exception, what: str) -> CheckpointError:
        """The dcpstore exception for ``e``, one of :attr:`_library_errors`
        raised while doing ``what`` (the operation and the URI).

        Backends override this with their library's knowledge (S3 error
        codes, ...); the default reads the built-in exceptions. Callers go
        through :meth:`_error`.
        """
        return map_os_error(e, what)

    def _error(self, e: Exception, what: str) -> CheckpointError:
        """The one way a library exception becomes ours (raise it ``from e``):
        :meth:`_mapped` and a backend's own handlers all pass here, so that
        whatever every mapping must do is done here once."""
        if isinstance(e, CheckpointError):
            return e
        scrub_exception(e)  # ours is chained to it: what it quotes (an echoing endpoint) must be clean too
        return self._map_error(e, what)

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """Run the block; raise its library errors as :meth:`_error` says,
        chained to the original. dcpstore's own errors pass unchanged."""
        try:
            yield
        except CheckpointError:
            raise
        except self._library_errors as e:
            raise self._error(e, what) from e

    def _in_parallel(self, fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]]) -> list[T]:
        """``[fn(*job) for job in jobs]`` on this storage's request pool: in
        flight with every other request of this storage, ``max_concurrency``
        at most (see :meth:`~dcpstore._impl.storage.request_pool.RequestPool.map`)."""
        return self._requests.map(fn, jobs)

    # -- writing -----------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, path: str, *, size_hint: int | None = None, batch_hint: int | None = None) -> ObjectWriter:
        """Start writing the object ``path``; see :class:`ObjectWriter`.

        ``size_hint`` (the expected size, if known) lets object stores choose
        between a single PUT and a multipart upload up front; ``batch_hint``
        (the expected bytes of every object the caller writes at the same
        time as this one, this one included: a rank's data files) lets them
        share the connection budget out over the batch's parts
        (:meth:`StorageOptions.upload_part_size`). Backends that upload
        nothing in parts ignore both.
        """

    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        """Write a whole object atomically (write, then commit).

        ``durable=False``: a backend may skip what makes the object survive a
        crash of the machine (POSIX: the fsyncs), never what makes it appear
        whole or not at all; for a marker whose loss loses nothing, written
        where the caller waits. Backends whose every write is durable ignore it.
        """
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

    def read_into(
        self, path: str, offset: int, buffers: Sequence[memoryview], *, batch_hint: int | None = None
    ) -> int:
        """Scatter-read: fill ``buffers`` (writable, contiguous byte views),
        in order, from the bytes at ``offset``; return how many arrived
        (fewer only if the object ends). ``batch_hint``: the bytes of every
        read the caller makes at about the same time, this one included (a
        rank's load), which object stores share their connection budget out
        over (:meth:`StorageOptions.transfer_pieces`; ``None``: this read alone).

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

    @abc.abstractmethod
    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """Read a whole object: exactly one version of it, whole.

        However often the object is replaced meanwhile (a load reads
        ``.metadata`` while an overwrite commits its own), the bytes returned
        are all of one version that ``path`` held: never the first bytes of
        a newer version cut at an older one's size, never pieces of two.
        (Asking the size and then reading that many bytes, in a second open
        or request, is exactly what breaks this.) A backend reads from one
        open file, in one request, or in ranges pinned to the version the
        first one returned (:meth:`_read_one_version` is the kit's way).

        ``limit``: refuse an object of more than ``limit`` bytes before
        allocating or reading it (:class:`~dcpstore._impl.util.errors.ObjectTooLarge`),
        for files whose size is not to be trusted (a crafted sparse file must
        cost no memory); the limit is checked against the size of the
        version read, so no version larger than the limit is ever returned
        or read whole.
        """

    def _read_one_version(self, path: str, seen: int, limit: int | None, head: Callable[[int | None], bytes]) -> bytes:
        """:meth:`read` for a backend whose every request returns bytes of one
        version: ``head(n)`` gives the object's first ``n`` bytes (``None``:
        all of it) in one request (``b""`` past the end), ``seen`` is its
        size as just asked, already checked against ``limit``.

        The first request asks one byte more than ``seen``: fewer back means
        the object ended there, so they are all of one version (the one asked
        about, or one that replaced it meanwhile and is no larger). All of
        them back: a larger version replaced it between the size and the
        read, and one more request asks for one byte past ``limit`` (no
        limit: the whole object), which either ends within it or is refused.
        Memory stays bounded by the version read (or ``limit`` + 1 bytes,
        only when a larger version lands in that window).
        """
        data = head(seen + 1)
        if len(data) <= seen:
            return data
        data = head(None if limit is None else limit + 1)
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(
                f"{self.describe(path)}: more than the {limit} bytes read (replaced by a larger object while read)",
                len(data),
                limit,
            )
        return data

    def check_limit(self, path: str, size: int, limit: int | None) -> None:
        """Raise :class:`~dcpstore._impl.util.errors.ObjectTooLarge` if ``size`` exceeds ``limit``."""
        if limit is not None and size > limit:
            raise ObjectTooLarge(f"{self.describe(path)}: {size} bytes, more than the {limit} read", size, limit)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; :class:`StorageNotFound` if absent."""

    def learn_sizes(self) -> None:
        """Learn the sizes of the objects under this storage from one listing
        request, where that is cheaper than a size request per object (object
        stores: the first page of a listing, up to 1,000 objects), so that
        :meth:`size_seen` knows them. A load runs it beside its commit read:
        the files' real sizes then cost no round trip of their own. Best
        effort: a failure here only leaves the sizes to be asked for."""

    def size_seen(self, path: str) -> int | None:
        """The size of ``path`` as a read or :meth:`learn_sizes` made through
        this instance reported it, or None (never seen, or a backend whose
        reads do not say).

        Object stores learn it from every ranged GET's ``Content-Range``, so
        a load checks the sizes of the files it read without a request per
        file. Sizes are remembered per instance: a load opens its own.
        """
        return None

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

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        """Writes in progress and leftovers of interrupted ones (temp files,
        open uploads), with their age. Used by ``dcpstore gc``; the default
        backend has none to report."""
        return []

    def list_incomplete(self) -> Iterator[str]:
        """The paths of :meth:`incomplete_writes`."""
        return iter([w.path for w in self.incomplete_writes()])

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """Remove exactly ``writes`` (as :meth:`incomplete_writes` listed
        them): never another write started since under the same path, and
        (where the backend can tell) never one written to within
        ``older_than_s`` seconds since it was listed. Returns how many were
        removed; one already gone is not counted."""
        return 0

    def cleanup_incomplete(self, older_than_s: float = 0.0) -> int:
        """Remove leftovers of interrupted writes older than ``older_than_s``
        (of unknown age: only with ``older_than_s`` <= 0). Returns how many
        were removed."""
        old = [w for w in self.incomplete_writes() if (w.age_s is None and older_than_s <= 0) or (w.age_s or 0) >= older_than_s]
        return self.remove_incomplete(old, older_than_s)

    def close(self) -> None:
        """Release clients, connections and the request pool. The storage is
        unusable afterwards. Backends that hold more extend this."""
        self._requests.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
