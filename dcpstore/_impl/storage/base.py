"""The byte-level storage contract every backend keeps: :class:`Storage`.

dcpstore's DCP writer and reader (:mod:`dcpstore._impl.dcp`) are written once
against :class:`Storage`; a backend is one module in this package that maps
its few operations onto a filesystem or object store. The class docstring
says which methods a backend implements, which it may override, who calls
them when, and what they guarantee; :class:`ObjectWriter` is what
``open_write`` returns and :class:`ObjectInfo` what ``list`` yields.

The kit the built-in backends share (the root-containment check, the error
mapping, one request pool per instance) is not part of the contract: it
is :class:`~dcpstore._impl.storage.backend_base.BackendBase`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import ClassVar, TypedDict, final

from typing_extensions import NotRequired

from dcpstore._impl.storage.incomplete import IncompleteWrite, Unfinished
from dcpstore._impl.storage.storage_options import OBJECT_STORE_WORKERS, StorageOptions
from dcpstore._impl.storage.uri import StorageURL, redact
from dcpstore._impl.util.errors import StorageNotFound


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

    #: Where not None, :meth:`write_lent` sends the whole blocks of this
    #: many bytes of a large buffer from memory to the disk, bypassing the
    #: page cache, when the buffer lies at the same offset modulo this in
    #: memory as in the object (writers above place their bytes so).
    direct_align: int | None = None

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
    """One checkpoint location (a directory or a key prefix) on one backend:
    the contract between a backend and the rest of dcpstore.

    The only methods a backend must implement are :meth:`open_write`,
    :meth:`read_range`, :meth:`read`, :meth:`size`, :meth:`list`,
    :meth:`delete` and :meth:`makedirs` (seven); it may override
    :meth:`put`, :meth:`read_into`, :meth:`read_into_each`,
    :meth:`incomplete_writes`, :meth:`remove_incomplete`, :meth:`learn_sizes`,
    :meth:`size_seen`, :meth:`default_workers`, :meth:`local_path` and
    :meth:`close` (ten, each with a default that is correct, if slower or less informed). Everything
    else here is built on those and is not overridden: :attr:`uri`,
    :meth:`describe`, :meth:`exists`, and the clean-up ledger
    (:meth:`leave_unfinished`, :meth:`take_unfinished`). A backend sets the
    class attribute :attr:`backend` (its name in messages and save reports)
    and, if it defines ``__init__``, calls ``super().__init__(url, options)``.
    :meth:`open_write` returns an :class:`ObjectWriter`; subclassing
    :class:`~dcpstore.storage.BufferedObjectWriter` leaves a backend only
    how bytes leave, land and are discarded. :mod:`dcpstore.storage.testing`
    is the suite that checks a backend keeps this contract.

    **Who calls what, when.** :func:`~dcpstore.storage.open_storage` builds
    the storage (``cls(url, options)``) in every process that touches the
    checkpoint: each rank of a save or load, a checkpoint process, a tool.
    During a save, on each rank::

        storage.makedirs()                       # once, before any write
        with storage.open_write("__0_0.distcp", size_hint=n, batch_hint=total) as w:
            w.write(buf) ...                     # one per data file, streamed, in order
            w.seal()                             # optional: no more bytes; send the rest
        # leaving the block commits, an exception inside it aborts

    several data files at once, each on a writer thread of its own; then, on
    the coordinator, after every rank's files are committed::

        storage.put(".dcpstore.json", manifest)  # the manifest, then
        storage.put(".metadata", blob)           # the checkpoint's commit point
        storage.delete(stale)                    # what the commit made stale

    with :meth:`list`, :meth:`exists` and small :meth:`put` / :meth:`delete`
    calls (an in-flight marker, alive files, ``durable=False``) around it.
    During a load, on each rank: :meth:`learn_sizes` beside the ``read`` of
    ``.metadata`` (with a ``limit``), :meth:`size_seen` or :meth:`size` per
    data file, then :meth:`read_into` and :meth:`read_range` on reader
    threads (:meth:`default_workers` of them unless the caller names a
    number). ``dcpstore ls`` calls :meth:`list`; ``gc`` and a manager's
    retention :meth:`list` and :meth:`delete`, and ``gc`` also
    :meth:`incomplete_writes` and :meth:`remove_incomplete`. :meth:`close`
    comes last.

    **What a backend guarantees.**

    * Paths are relative to the root (the checkpoint URI), ``/``-separated;
      one that would leave the root (absolute, or with a ``..`` component)
      raises :class:`~dcpstore.StorageError` before the store is touched.
    * Atomic visibility: an object written through :meth:`open_write` (and
      so :meth:`put`) becomes visible only when its writer commits, and then
      whole, in place of any earlier version (a reader sees the old bytes or
      the new, never a mixture or a short object); an aborted writer leaves
      nothing visible. Committed means durable (POSIX: fsync, rename,
      directory fsync; an object store: the upload completed), unless
      :meth:`put` was told ``durable=False``.
    * :meth:`read` returns one version of an object, whole, however often it
      is replaced meanwhile; :meth:`read_range` and :meth:`read_into` return
      fewer bytes than asked only where the object ends.
    * :meth:`list` is recursive, relative to the root, treats its prefix as
      a directory (``"x"`` lists ``x/...``, never ``xy``) and never shows an
      in-progress write (a temporary file, an open upload).
    * Every method may be called from several threads at once.
    * Errors: a missing object raises :class:`~dcpstore.StorageNotFound`
      (also a ``FileNotFoundError``); refused credentials or permissions
      :class:`~dcpstore.StoragePermissionError`; a whole read over its
      ``limit`` :class:`~dcpstore.storage.ObjectTooLarge`; any other failure,
      after the backend's own retries, :class:`~dcpstore.StorageError`
      chained to the cause, its message naming the URI (:meth:`describe`)
      and free of credentials.

    The built-in backends derive from
    :class:`~dcpstore._impl.storage.backend_base.BackendBase`, the kit
    (containment check, error mapping, a request pool) they share.
    """

    #: The registry name of this backend (``"local"``, ``"s3"``, ...).
    backend: ClassVar[str]

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        self.url = url
        self.options = options or StorageOptions()
        self._unfinished: list[Unfinished] = []
        self._unfinished_lock = threading.Lock()

    # -- what callers get, built on the rest (never overridden) -----------------
    @property
    def uri(self) -> str:
        """The root URI, safe to print (credentials redacted)."""
        return redact(self.url.uri)

    @final
    def describe(self, path: str = "") -> str:
        """A printable URI for ``path`` under this root, for messages."""
        return f"{self.uri.rstrip('/')}/{path}" if path else self.uri

    @final
    def exists(self, path: str) -> bool:
        """Whether the object ``path`` exists (:meth:`size` does not raise
        :class:`~dcpstore.StorageNotFound`)."""
        try:
            self.size(path)
        except StorageNotFound:
            return False
        return True

    @final
    def leave_unfinished(self, what: str, retry: Callable[[], object]) -> None:
        """Record a clean-up that failed (an abort, a delete), for the owner
        of the write to try again later (:meth:`take_unfinished`)."""
        with self._unfinished_lock:
            self._unfinished.append(Unfinished(what, retry))

    @final
    def take_unfinished(self) -> list[Unfinished]:
        """The clean-ups recorded since the last call (and forget them)."""
        with self._unfinished_lock:
            taken, self._unfinished = self._unfinished, []
        return taken

    # -- writing (must implement: open_write, makedirs) --------------------------
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

    # -- reading (must implement: read_range, read, size, list) ------------------
    @abc.abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """Read ``length`` bytes at ``offset``; fewer only if the object ends."""

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview], *, batch_hint: int | None = None) -> int:
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

    def read_into_each(
        self,
        path: str,
        offset: int,
        buffers: Sequence[memoryview],
        each: Callable[[int, memoryview], None],
        *,
        batch_hint: int | None = None,
    ) -> int:
        """:meth:`read_into`, and ``each(k, view)`` for the bytes that arrived
        in ``buffers[k]``, in order (a buffer may come in several views, one
        after another). A load checksums each item this way: a backend that
        lands the bytes piece by piece (a local file) calls ``each`` right
        after a piece lands, while it is still in the cache, instead of a
        second pass over memory after the whole read. The default reads,
        then reports every buffer."""
        n = self.read_into(path, offset, buffers, batch_hint=batch_hint)
        left = n
        for k, buf in enumerate(buffers):
            if left <= 0:
                break
            take = min(buf.nbytes, left)
            each(k, buf[:take])
            left -= take
        return n

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
        first one returned (the built-in backends' kit has
        :meth:`~dcpstore._impl.storage.backend_base.BackendBase._read_one_version`).

        ``limit``: refuse an object of more than ``limit`` bytes before
        allocating or reading it (:class:`~dcpstore._impl.util.errors.ObjectTooLarge`),
        for files whose size is not to be trusted (a crafted sparse file must
        cost no memory); the limit is checked against the size of the
        version read, so no version larger than the limit is ever returned
        or read whole.
        """

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; :class:`StorageNotFound` if absent."""

    def learn_sizes(self) -> None:
        """Learn the sizes of the objects under this storage from one listing
        request, where that is cheaper than a size request per object (object
        stores: the first page of a listing, up to 1,000 objects), so that
        :meth:`size_seen` knows them. A load runs it beside its commit read:
        the files' real sizes then cost no round trip of their own. Best
        effort: a failure here only leaves the sizes to be asked for. The
        default learns nothing."""

    def size_seen(self, path: str) -> int | None:
        """The size of ``path`` as a read or :meth:`learn_sizes` made through
        this instance reported it, or None (never seen, or a backend whose
        reads do not say: the default).

        Object stores learn it from every ranged GET's ``Content-Range``, so
        a load checks the sizes of the files it read without a request per
        file. Sizes are remembered per instance: a load opens its own.
        """
        return None

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """All objects under ``prefix`` (recursive), paths relative to the root.

        In-progress writes (temporary files, open multipart uploads) are not
        listed.
        """

    # -- deleting (must implement: delete) ---------------------------------------
    @abc.abstractmethod
    def delete(self, paths: Iterable[str]) -> None:
        """Delete objects; paths that do not exist are ignored."""

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        """Writes in progress and leftovers of interrupted ones (temp files,
        open uploads), with their age. Used by ``dcpstore gc``; the default
        backend has none to report."""
        return []

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """Remove exactly ``writes`` (as :meth:`incomplete_writes` listed
        them): never another write started since under the same path, and
        (where the backend can tell) never one written to within
        ``older_than_s`` seconds since it was listed. Returns how many were
        removed; one already gone is not counted."""
        return 0

    # -- how it is used (may override) -------------------------------------------
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

    def local_path(self) -> str | None:
        """The directory of this machine's filesystem the root is, where it is
        one (a local path, MSC's POSIX profiles, fsspec's local filesystem),
        else None (the default): what
        :func:`~dcpstore._impl.storage.overlap.overlap` compares."""
        return None

    def close(self) -> None:
        """Release clients, connections and threads. The storage is unusable
        afterwards. The default holds nothing to release."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"
