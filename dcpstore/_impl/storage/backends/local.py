"""Local POSIX backend.

Atomic commit: each object is written to a hidden temporary file in its final
directory (``.<name>.dcpstore-tmp-<random>``), fsynced, renamed over its
final name, and then the directory is fsynced so the rename itself is durable.
A crash at any point leaves either the old state or the complete new object,
plus at most a temporary file that is never listed and that
``dcpstore gc`` removes (:meth:`LocalStorage.incomplete_writes`).

Symbolic links: a file read resolves inside the root (the root itself may be
reached through a link: it is resolved once), else
:class:`~dcpstore._impl.util.errors.UnsafeCheckpoint` naming it. Listing and deleting
never follow a link: a link is listed as itself (its own size and time), a
linked directory is not descended into, a path reached through a linked
directory is not deleted, and a delete removes a link, never its target.

Listing errors: the directory listed is a :class:`StorageError` naming it
and the cause (unreadable, a link loop, a name too long); a directory below
it that cannot be read is skipped with a warning on the ``dcpstore`` logger
(a ``lost+found`` in a mount point must not stop ``ls``, ``gc`` or a
manager; nothing is deleted there), and so is an entry that cannot be
stat'ed; one deleted while the walk runs is skipped silently.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, NamedTuple

from dcpstore._impl.storage.backend_base import BackendBase, errors_mapped
from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter
from dcpstore._impl.storage.buffered import BufferedObjectWriter
from dcpstore._impl.storage.byte_ranges import buffer_address, slice_buffers
from dcpstore._impl.storage.concurrency import disk_workers
from dcpstore._impl.storage.error_mapping import library_detail
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.posix import DIRECT_ALIGN, LocalRoot, fsync_dir, open_direct, start_writeback
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.storage.uri import StorageURL
from dcpstore._impl.util.errors import StorageError, StorageNotFound

log = logging.getLogger("dcpstore")

_TMP_MARK = ".dcpstore-tmp-"
#: Warnings one listing gives for entries it cannot read and skips.
_SKIP_WARNINGS = 3
#: Buffers per preadv call (the kernel's UIO_MAXIOV).
_IOV_MAX = getattr(os, "IOV_MAX", 1024)
#: A durable file's writeback is started every this many bytes written
#: (:func:`~dcpstore._impl.storage.posix.start_writeback`), so that the disk
#: works while the file is still being written and the fsync finds little left.
_WRITEBACK_EVERY = 8 << 20
#: Bytes per preadv of :meth:`LocalStorage.read_into_each`: what a core's
#: cache holds between the read's copy and the caller's pass over the piece.
_PIECE = 1 << 20
#: Most bytes one direct write sends: its pages stay pinned while it runs.
_DIRECT_CHUNK = 64 << 20
#: The least buffer a read with ``direct_io`` takes straight from the disk:
#: a direct read has no readahead, so a small one waits on the disk alone.
_DIRECT_READ_MIN = 1 << 20
#: Bytes per direct read. A call's reads run ahead of the checksum of the
#: last (:data:`_READS_AHEAD`), so the disk works while the core checks;
#: one into memory that does not lie at the file's place in a page
#: goes through a page-aligned buffer of this size, then a copy.
_DIRECT_READ_CHUNK = 8 << 20
#: Reads of one call with ``direct_io`` in flight while the last one's
#: bytes are checked.
_READS_AHEAD = 2
#: Bounce buffers kept between reads (``_READS_AHEAD + 1`` per reading
#: thread are in use at once).
_BOUNCES_KEPT = 16


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and _TMP_MARK in name


#: How often a write re-creates a directory that a concurrent delete removed.
_MKDIR_TRIES = 5


def _create(tmp: str) -> int:
    """Create the temporary file ``tmp``. Deletes remove the directories they
    empty (retention, ``dcpstore gc``): one may go between a save's
    ``makedirs`` and its first file, so a missing directory is made again
    (a few times: each needs another delete to empty it in between)."""
    for attempt in range(_MKDIR_TRIES):
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            if attempt == _MKDIR_TRIES - 1:
                raise
            _makedirs(os.path.dirname(tmp))
    raise AssertionError("unreachable")


def _makedirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, again if a directory on the way
    was removed while it ran (see :func:`_create`)."""
    for attempt in range(_MKDIR_TRIES):
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == _MKDIR_TRIES - 1:
                raise


class _LocalWriter(BufferedObjectWriter):
    """Unbuffered: each write goes to the temporary file's descriptor. With
    ``direct_io``, a lent buffer's whole pages go through a second
    descriptor opened with ``O_DIRECT``, from its memory to the disk, where
    the buffer lies at the same offset modulo a page in memory as in the
    file (:attr:`~dcpstore._impl.storage.base.ObjectWriter.direct_align`);
    its ragged ends, and every other write, through the first."""

    def __init__(self, storage: LocalStorage, path: str, final: str, durable: bool = True) -> None:
        super().__init__(storage, path)
        self._final = final
        self._durable = durable
        directory, name = os.path.split(final)
        self._dir = directory
        self._tmp = os.path.join(directory, f".{name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
        with storage._mapped(self._what):
            self._fd = _create(self._tmp)
        # Direct writes: until a filesystem refuses them, through a
        # descriptor opened at the first (so small files never open one).
        self._direct = durable and storage.options.direct_io
        self._direct_fd = -1
        self.direct_align = DIRECT_ALIGN if self._direct else None
        # Bytes written, and the first byte whose writeback is not started yet.
        self._written = self._flushed = 0

    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        view = memoryview(part)
        while view:
            n = os.write(self._fd, view)  # releases the GIL
            view = view[n:]
            self._written += n
        if self._durable and self._written - self._flushed >= _WRITEBACK_EVERY:
            start_writeback(self._fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written

    def write_lent(self, data: bytes | bytearray | memoryview, owner: object) -> int:
        view = memoryview(data).cast("B")
        pos, n = self._pos, view.nbytes
        head = -pos % DIRECT_ALIGN
        pages = (n - head) // DIRECT_ALIGN * DIRECT_ALIGN if n > head else 0
        if not self._direct or not pages or self._sealed or (buffer_address(view) - pos) % DIRECT_ALIGN:
            return self.write(view)
        if self._direct_fd < 0:
            self._direct_fd = open_direct(self._tmp)
            if self._direct_fd < 0:
                self._stop_direct()
                return self.write(view)
        self.write(view[:head])
        with errors_mapped(self._storage, self._what):
            done = self._write_direct(view[head : head + pages])
        self._pos += done
        self.write(view[head + done :])
        return n

    def _write_direct(self, view: memoryview) -> int:
        """Write ``view`` (whole pages, page-aligned in memory and in the
        file) with ``O_DIRECT``; return the bytes written. Fewer than all
        where the filesystem refused a direct write (it then gets none
        again) or wrote part of a page: the caller writes the rest."""
        done = 0
        while done < view.nbytes:
            try:
                n = os.pwrite(self._direct_fd, view[done : done + _DIRECT_CHUNK], self._written)  # releases the GIL
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct()  # a filesystem that opens O_DIRECT files but refuses their writes
                break
            done += n
            self._written += n
            if n % DIRECT_ALIGN or not n:
                break
        os.lseek(self._fd, self._written, os.SEEK_SET)  # the buffered writes go on after these
        return done

    def _stop_direct(self) -> None:
        """No more direct writes to this file (a filesystem that refuses
        them, or the file is done)."""
        self._direct = False
        self.direct_align = None
        if self._direct_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._direct_fd)
            self._direct_fd = -1

    def _publish(self, tail: bytearray) -> None:
        self._stop_direct()
        if self._durable:
            os.fsync(self._fd)  # the direct writes' blocks too: one inode
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self._final)
        if self._durable:
            fsync_dir(self._dir)

    def _discard(self) -> None:
        self._stop_direct()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


class LocalStorage(BackendBase):
    """A directory on a local (or locally mounted) POSIX filesystem."""

    backend = "local"
    _library_errors = (OSError,)

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        super().__init__(url, options)
        self._local = LocalRoot(self.root)

    def default_workers(self) -> int:
        """Threads are a disk's parallelism: see :func:`~dcpstore._impl.storage.concurrency.disk_workers`."""
        return disk_workers()

    @property
    def root(self) -> str:
        return self.url.path

    def local_path(self) -> str:
        return self.root

    def _full(self, path: str) -> str:
        path = self._relpath(path)
        return os.path.join(self.root, path) if path else self.root

    def open_write(self, path: str, *, size_hint: int | None = None, batch_hint: int | None = None) -> ObjectWriter:
        return self._writer(path, durable=True)

    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        """As :meth:`Storage.put`; ``durable=False`` skips the fsyncs (the
        rename still shows the file whole or not at all)."""
        with self._writer(path, durable=durable) as writer:
            writer.write(data)

    def _writer(self, path: str, *, durable: bool) -> _LocalWriter:
        full = self._full(path)
        parent = os.path.dirname(full)
        if parent != self.root:
            self.makedirs(os.path.relpath(parent, self.root))
        return _LocalWriter(self, path, full, durable)

    def makedirs(self, path: str = "") -> None:
        full = self._full(path)
        with self._mapped(f"cannot create directory {self.describe(path)}"):
            if os.path.isfile(full):
                raise StorageError(f"{self.describe(path)} is a file, not a directory")
            _makedirs(full)

    def _open_file(self, path: str) -> int:
        """Open ``path`` for reading, refusing anything but a regular file
        (:class:`StorageNotFound`): a FIFO would block the reader forever and
        a device (``/dev/zero``) never end. ``O_NONBLOCK`` keeps the open of a
        FIFO from waiting for a writer; on a regular file it changes nothing.
        A file that resolves outside the root is refused too
        (:class:`~dcpstore._impl.storage.posix.LocalRoot`). Both checks are on the
        opened file, so a swap after them cannot fool them.

        With ``direct_io``, reads through it get no readahead: the kernel's
        would pull the pages around a small read, which may lie inside a
        large tensor that a direct read takes past the page cache."""
        full = self._full(path)
        fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StorageNotFound(f"{self.describe(path)} is not a file")
            self._local.check(_opened_path(fd, full), self.describe(path))
            if self.options.direct_io:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """With ``direct_io``, a read of :data:`_PIECE` bytes or more (a
        tiered manager's replication reads its local tier so) drops the pages
        it read from the page cache after it: a direct storage's files stay
        out of the page cache whoever reads them whole."""
        with self._mapped(f"cannot read {self.describe(path)}"):
            fd = self._open_file(path)
            try:
                data = _pread(fd, offset, length)
                if self.options.direct_io and len(data) >= _PIECE:
                    os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)  # drops clean pages only
                return data
            finally:
                os.close(fd)

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """One open: the size (checked against ``limit`` before anything is
        allocated) and the bytes both come from that file, so a rename over
        ``path`` meanwhile changes neither (see :meth:`Storage.read`). A file
        that grows meanwhile is read to the size first seen."""
        with self._mapped(f"cannot read {self.describe(path)}"):
            fd = self._open_file(path)
            try:
                size = os.fstat(fd).st_size
                self.check_limit(path, size, limit)
                return _pread(fd, 0, size)
            finally:
                os.close(fd)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview], *, batch_hint: int | None = None) -> int:
        if self.options.direct_io:
            return self.read_into_each(path, offset, buffers, _nothing, batch_hint=batch_hint)
        total = sum(b.nbytes for b in buffers)
        done = 0
        with self._mapped(f"cannot read {self.describe(path)}"):
            fd = self._open_file(path)
            try:
                todo = list(buffers)
                while todo:
                    n = os.preadv(fd, todo[:_IOV_MAX], offset + done)  # releases the GIL
                    if n == 0:
                        break
                    done += n
                    todo = slice_buffers(todo, n, total - done)
            finally:
                os.close(fd)
        return done

    def read_into_each(
        self,
        path: str,
        offset: int,
        buffers: Sequence[memoryview],
        each: Callable[[int, memoryview], None],
        *,
        batch_hint: int | None = None,
    ) -> int:
        """:meth:`read_into` in windows of :data:`_PIECE` bytes, each window's
        views handed to ``each`` right after its ``preadv`` (see
        :meth:`Storage.read_into_each`).

        With ``direct_io``, a buffer of :data:`_DIRECT_READ_MIN` bytes or
        more has the whole pages of the file it covers read with
        ``O_DIRECT``: straight into it where it lies at the same place in a
        page (as a direct save lays a tensor out for memory allocated as it
        was), else through page-aligned bounce buffers, copied out and
        handed to ``each`` a :data:`_PIECE` at a time. Its ragged ends and
        every other buffer are read in windows as above, with no readahead
        (which would pull the direct pages into the page cache). Every read
        of the call, direct reads of :data:`_DIRECT_READ_CHUNK` bytes and
        windows alike, is started :data:`_READS_AHEAD` reads before its
        bytes are handed to ``each``, so the disk is not idle while the
        caller checks them, nor between one tensor and the next. A
        filesystem that refuses ``O_DIRECT`` (at the open or at a read) gets
        the rest of the call read buffered."""
        with self._mapped(f"cannot read {self.describe(path)}"):
            reading = _Reading(self._open_file(path), self._full(path), each)
            try:
                if self.options.direct_io:
                    return reading.pipelined(offset, buffers)
                return reading.windows(offset, list(enumerate(buffers)))
            finally:
                reading.close()

    def size(self, path: str) -> int:
        # Through the open: the same checks as a read (a regular file, inside the root).
        with self._mapped(f"cannot stat {self.describe(path)}"):
            fd = self._open_file(path)
            try:
                return os.fstat(fd).st_size
            finally:
                os.close(fd)

    def _linked(self, full: str) -> bool:
        """Whether ``full`` (under the root) is reached through a symbolic link."""
        rel = os.path.relpath(full, self.root)
        want = self._local.real() if rel == "." else os.path.join(self._local.real(), rel)
        return os.path.realpath(full) != want

    def _walk(self, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        """``(path, lstat)`` of every entry under ``prefix`` that is not a
        directory (links included, never followed), paths relative to the
        root, sorted, each directory's entries before its subdirectories'
        (as ``os.walk``). The directory listed failing is an error; one below
        it is skipped with a warning (see the module docstring)."""
        base = self._full(prefix)
        what = f"cannot list {self.describe(prefix)}"
        with self._mapped(what):
            try:
                # The root may be reached through a link; nothing below it is.
                st = os.lstat(base) if prefix else os.stat(base)
            except (FileNotFoundError, NotADirectoryError):
                return  # nothing there: an empty listing
            if stat.S_ISLNK(st.st_mode) or (stat.S_ISDIR(st.st_mode) and prefix and self._linked(base)):
                return  # a link: listed by its parent's listing, never followed
        if not stat.S_ISDIR(st.st_mode):
            yield prefix, st
            return
        stack = [base]
        skipped = [0]
        while stack:
            directory = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except FileNotFoundError:
                continue  # deleted while we walked
            except OSError as e:
                if directory == base:
                    raise self._error(e, what) from e
                self._skipped(prefix, directory, e, skipped)
                continue
            subdirs = []
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.path)
                        continue
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    self._skipped(prefix, entry.path, e, skipped)
                    continue
                yield os.path.relpath(entry.path, self.root), info
            stack.extend(reversed(subdirs))

    def _skipped(self, prefix: str, full: str, e: OSError, count: list[int]) -> None:
        """Warn of an entry the listing of ``prefix`` skips; the first few only."""
        count[0] += 1
        if count[0] <= _SKIP_WARNINGS:
            where = self.describe(os.path.relpath(full, self.root))
            more = (
                "; further entries it cannot read are skipped without a warning" if count[0] == _SKIP_WARNINGS else ""
            )
            log.warning("listing %s skipped %s: %s%s", self.describe(prefix), where, library_detail(e), more)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for path, st in self._walk(prefix.rstrip("/")):
            if not _is_tmp(os.path.basename(path)):
                yield {"path": path, "size": st.st_size, "mtime": st.st_mtime}

    def delete(self, paths: Iterable[str]) -> None:
        parents = set()
        linked: dict[str, bool] = {}
        for path in paths:
            full = self._full(path)
            parent = os.path.dirname(full)
            if parent not in linked:
                linked[parent] = parent != self.root and self._linked(parent)
            if linked[parent]:
                log.warning("not deleted: %s is reached through a symbolic link", self.describe(path))
                continue
            with self._mapped(f"cannot delete {self.describe(path)}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)  # a link itself, never its target
            parents.add(parent)
        # Drop directories the deletes emptied (a retired step), never the root.
        for parent in sorted(parents, key=len, reverse=True):
            while parent.startswith(self.root + os.sep):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        """The temporary files under the root (never through a link), with
        the time since each was last written to."""
        now = time.time()
        return [
            IncompleteWrite(path, now - st.st_mtime) for path, st in self._walk("") if _is_tmp(os.path.basename(path))
        ]

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """Each temporary file's name is unique to its write; one written to
        within ``older_than_s`` seconds (looked at again now) is kept."""
        removed = 0
        for write in writes:
            full = self._full(write.path)
            with self._mapped(f"cannot delete {self.describe(write.path)}"), contextlib.suppress(FileNotFoundError):
                if time.time() - os.lstat(full).st_mtime >= older_than_s:
                    os.unlink(full)  # a link itself, never its target
                    removed += 1
        return removed


def _windows(run: Sequence[tuple[int, memoryview]], piece: int, most: int) -> Iterator[list[tuple[int, memoryview]]]:
    """``run`` (``(index of a buffer, a view of it)``) cut into windows of at
    most ``piece`` bytes and ``most`` views, in order, each view in the
    same form."""
    window: list[tuple[int, memoryview]] = []
    fill = 0
    for k, buf in run:
        pos = 0
        while pos < buf.nbytes:
            take = min(buf.nbytes - pos, piece - fill)
            window.append((k, buf[pos : pos + take]))
            fill += take
            pos += take
            if fill == piece or len(window) == most:
                yield window
                window, fill = [], 0
    if window:
        yield window


def _nothing(k: int, view: memoryview) -> None:
    pass


#: How a run of a read is read: through the page cache, or with ``O_DIRECT``
#: straight into the buffer or through a bounce buffer.
_Kind = Literal["buffered", "direct", "bounce"]


def _runs(buffers: Sequence[memoryview], offset: int) -> Iterator[tuple[_Kind, list[tuple[int, memoryview]]]]:
    """``buffers``, to be read from ``offset`` on with direct I/O, as runs of
    ``(index of the buffer, a view of it)``, in order, each with how to read
    it. A buffer of at least :data:`_DIRECT_READ_MIN` bytes has the
    part that covers whole pages of the file in a run of its own: read
    straight into it where it lies at the same place in a page
    (``"direct"``), else through a page-aligned buffer (``"bounce"``);
    everything else is in the ``"buffered"`` runs between."""
    run: list[tuple[int, memoryview]] = []
    pos = offset
    for k, buf in enumerate(buffers):
        n = buf.nbytes
        head = -pos % DIRECT_ALIGN
        pages = (n - head) // DIRECT_ALIGN * DIRECT_ALIGN if n > head else 0
        if n >= _DIRECT_READ_MIN and pages:
            if head:
                run.append((k, buf[:head]))
            if run:
                yield "buffered", run
            aligned = (buffer_address(buf) - pos) % DIRECT_ALIGN == 0
            yield ("direct" if aligned else "bounce"), [(k, buf[head : head + pages])]
            run = [(k, buf[head + pages :])] if head + pages < n else []
        else:
            run.append((k, buf))
        pos += n
    if run:
        yield "buffered", run


class _Read(NamedTuple):
    """One read of a direct-I/O call: ``views`` (``(index of a buffer, a
    view of it)``) filled from the file's offset ``at`` on, as ``kind``
    says (one view, :data:`_DIRECT_READ_CHUNK` bytes at most, unless
    ``"buffered"``)."""

    kind: _Kind
    at: int
    views: list[tuple[int, memoryview]]

    @property
    def nbytes(self) -> int:
        return sum(view.nbytes for _, view in self.views)


def _reads(buffers: Sequence[memoryview], offset: int) -> Iterator[_Read]:
    """The reads that fill ``buffers`` from ``offset`` on with direct I/O,
    in order: each direct run (:func:`_runs`) in reads of
    :data:`_DIRECT_READ_CHUNK` bytes, each buffered run in windows of
    :data:`_PIECE` bytes."""
    at = offset
    for kind, run in _runs(buffers, offset):
        if kind == "buffered":
            pieces = list(_windows(run, _PIECE, _IOV_MAX))
        else:
            ((k, view),) = run
            pieces = [[(k, view[p : p + _DIRECT_READ_CHUNK])] for p in range(0, view.nbytes, _DIRECT_READ_CHUNK)]
        for views in pieces:
            read = _Read(kind, at, views)
            yield read
            at += read.nbytes


_bounces: list[mmap.mmap] = []
_bounces_lock = threading.Lock()


def _forget_bounces() -> None:
    """In a forked child: the parent's kept buffers are its own, and its
    lock may have been held by a thread the child does not have."""
    global _bounces_lock
    _bounces.clear()
    _bounces_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_bounces)


@contextlib.contextmanager
def _bounce() -> Iterator[memoryview]:
    """A page-aligned buffer of :data:`_DIRECT_READ_CHUNK` bytes for direct
    reads into memory that lies elsewhere in a page, taken from those kept
    for the next reads (a fresh one's page faults would cost more than the
    copy through it), and given back after."""
    with _bounces_lock:
        memory = _bounces.pop() if _bounces else None
    if memory is None or len(memory) < _DIRECT_READ_CHUNK:
        memory = mmap.mmap(-1, _DIRECT_READ_CHUNK)
    view = memoryview(memory)
    try:
        yield view
    finally:
        view.release()
        with _bounces_lock:
            kept = len(_bounces) < _BOUNCES_KEPT
            if kept:
                _bounces.append(memory)
        if not kept:
            memory.close()


class _Reading:
    """One call's reads of one file: ``fd`` (checked by
    :meth:`LocalStorage._open_file`), and a twin with ``O_DIRECT`` where the
    call has direct reads, each piece reported to ``each`` as it lands."""

    def __init__(self, fd: int, full: str, each: Callable[[int, memoryview], None]) -> None:
        self.fd = fd
        self._full = full
        self._each = each
        self._direct_fd = -1
        self._reader: ThreadPoolExecutor | None = None
        #: The filesystem refused direct reads: the rest goes buffered.
        self.refused = False

    def windows(self, offset: int, run: list[tuple[int, memoryview]]) -> int:
        """Read ``run`` from ``offset`` on in windows of :data:`_PIECE`
        bytes; the bytes read (fewer only where the file ends)."""
        done = 0
        for window in _windows(run, _PIECE, _IOV_MAX):
            read = _Read("buffered", offset + done, window)
            got = self._read_window(read.at, [view for _, view in window])
            self._report(read, got, None)
            done += got
            if got < read.nbytes:
                break
        return done

    def pipelined(self, offset: int, buffers: Sequence[memoryview]) -> int:
        """Read ``buffers`` from ``offset`` on as
        :meth:`LocalStorage.read_into_each` does with ``direct_io``: each
        read (:class:`_Read`) runs on a helper thread, :data:`_READS_AHEAD`
        of them ahead of the one whose bytes are being reported. The bytes
        read: fewer than all only where the file ends."""
        reads = list(_reads(buffers, offset))
        if any(read.kind != "buffered" for read in reads):
            self._direct_fd = _direct_twin(self.fd, self._full)
            self.refused = self._direct_fd < 0
        if self.refused:
            return self.windows(offset, list(enumerate(buffers)))
        with contextlib.ExitStack() as stack:
            # A bounce buffer for each read in flight, and one being copied out.
            bounced = [read for read in reads if read.kind == "bounce"]
            throughs = [stack.enter_context(_bounce()) for _ in range(min(_READS_AHEAD + 1, len(bounced)))]
            through = {id(read): throughs[j % len(throughs)] for j, read in enumerate(bounced)}
            pending: deque[Future[int]] = deque()

            def start(read: _Read) -> None:
                if read.kind == "buffered":
                    pending.append(self._ahead().submit(self._read_window, read.at, [v for _, v in read.views]))
                else:
                    (_, view), fd = read.views[0], self._direct_fd
                    into = through[id(read)][: view.nbytes] if read.kind == "bounce" else view
                    pending.append(self._ahead().submit(os.preadv, fd, [into], read.at))

            for read in reads[:_READS_AHEAD]:
                start(read)
            done = 0
            try:
                for i, read in enumerate(reads):
                    try:
                        n = pending.popleft().result()
                    except OSError as e:
                        if e.errno != errno.EINVAL or read.kind == "buffered":
                            raise
                        # A filesystem that opens O_DIRECT files but refuses their reads.
                        self.refused = True
                        for later in pending:
                            with contextlib.suppress(Exception):
                                later.result()
                        pending.clear()
                        self.close_direct()
                        return done + self.windows(read.at, [kv for later in reads[i:] for kv in later.views])
                    if n == read.nbytes and i + _READS_AHEAD < len(reads):
                        start(reads[i + _READS_AHEAD])
                    self._report(read, n, through.get(id(read)))
                    done += n
                    if n < read.nbytes:
                        break
            finally:
                for later in pending:  # no read may land once this returns
                    with contextlib.suppress(Exception):
                        later.result()
        return done

    def _read_window(self, offset: int, views: list[memoryview]) -> int:
        """Fill ``views`` from ``offset`` on through the buffered descriptor;
        the bytes read (fewer only where the file ends)."""
        want = sum(view.nbytes for view in views)
        got = 0
        while got < want:
            n = os.preadv(self.fd, slice_buffers(views, got, want - got), offset + got)  # releases the GIL
            if n == 0:
                break
            got += n
        return got

    def _report(self, read: _Read, n: int, bounce: memoryview | None) -> None:
        """Hand the first ``n`` bytes of ``read`` to ``each``: a bounce
        buffer's copied out first, :data:`_PIECE` bytes at a time, each
        piece reported while in cache."""
        if bounce is None:
            for k, view in read.views:
                if n <= 0:
                    break
                self._each(k, view[: min(view.nbytes, n)])
                n -= view.nbytes
            return
        ((k, view),) = read.views
        at, source = buffer_address(view), buffer_address(bounce)
        for p in range(0, n, _PIECE):
            q = min(n, p + _PIECE)
            ctypes.memmove(at + p, source + p, q - p)  # releases the GIL
            self._each(k, view[p:q])

    def _ahead(self) -> ThreadPoolExecutor:
        """The threads that run this call's reads ahead, started at the first."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(_READS_AHEAD, thread_name_prefix="dcpstore-direct-read")
        return self._reader

    def close_direct(self) -> None:
        if self._direct_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._direct_fd)
        self._direct_fd = -1

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown()
        self.close_direct()
        os.close(self.fd)


def _direct_twin(fd: int, full: str) -> int:
    """A read descriptor with ``O_DIRECT`` on the file ``fd`` has open (its
    path opened again, then checked to be the same file: one renamed over
    it since is read through ``fd`` alone); -1 where there is none."""
    twin = open_direct(full, os.O_RDONLY)
    if twin >= 0:
        a, b = os.fstat(fd), os.fstat(twin)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(twin)
            return -1
    return twin


def _pread(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes of ``fd`` at ``offset``; fewer only where the file ends."""
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)  # releases the GIL
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _opened_path(fd: int, full: str) -> str:
    """Where the open ``fd`` (opened as ``full``) really is: Linux names the
    opened file itself; elsewhere, ``full`` resolved (checked after the open)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
    except OSError:
        return os.path.realpath(full)
