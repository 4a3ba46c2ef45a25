"""Local POSIX backend.

Atomic commit: each object is written to a hidden temporary file in its final
directory (``.<name>.dcpstore-tmp-<random>``), fsynced, renamed over its
final name, and then the directory is fsynced so the rename itself is durable.
A crash at any point leaves either the old state or the complete new object,
plus at most a temporary file that is never listed and that
``dcpstore gc`` removes (:meth:`LocalStorage.incomplete_writes`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence

from ..errors import StorageError, StorageNotFound
from .base import ObjectInfo, ObjectWriter, Storage
from .pending import IncompleteWrite
from .buffered import BufferedObjectWriter
from .kit import disk_workers, fsync_dir, slice_buffers

_TMP_MARK = ".dcpstore-tmp-"
#: Buffers per preadv call (the kernel's UIO_MAXIOV).
_IOV_MAX = getattr(os, "IOV_MAX", 1024)


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
    """Unbuffered: each write goes to the temporary file's descriptor."""

    def __init__(self, storage: LocalStorage, path: str, final: str, durable: bool = True) -> None:
        super().__init__(storage, path)
        self._final = final
        self._durable = durable
        directory, name = os.path.split(final)
        self._dir = directory
        self._tmp = os.path.join(directory, f".{name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
        with storage._mapped(self._what):
            self._fd = _create(self._tmp)

    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        view = memoryview(part)
        while view:
            n = os.write(self._fd, view)  # releases the GIL
            view = view[n:]

    def _publish(self, tail: bytearray) -> None:
        if self._durable:
            os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self._final)
        if self._durable:
            fsync_dir(self._dir)

    def _discard(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


class LocalStorage(Storage):
    """A directory on a local (or locally mounted) POSIX filesystem."""

    backend = "local"
    _library_errors = (OSError,)

    def default_workers(self) -> int:
        """Threads are a disk's parallelism: see :func:`~dcpstore.storage.kit.disk_workers`."""
        return disk_workers()

    @property
    def root(self) -> str:
        return self.url.path

    def local_path(self) -> str:
        return self.root

    def _full(self, path: str) -> str:
        path = self._relpath(path)
        return os.path.join(self.root, path) if path else self.root

    def open_write(self, path: str, *, size_hint: int | None = None) -> ObjectWriter:
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
        The check is on the opened file, so a swap after it cannot fool it."""
        fd = os.open(self._full(path), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StorageNotFound(f"{self.describe(path)} is not a file")
        return fd

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with self._mapped(f"cannot read {self.describe(path)}"):
            fd = self._open_file(path)
            try:
                chunks = []
                while length > 0:
                    chunk = os.pread(fd, length, offset)  # releases the GIL
                    if not chunk:
                        break
                    chunks.append(chunk)
                    offset += len(chunk)
                    length -= len(chunk)
            finally:
                os.close(fd)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def read_into(self, path: str, offset: int, buffers: Sequence[memoryview]) -> int:
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

    def size(self, path: str) -> int:
        with self._mapped(f"cannot stat {self.describe(path)}"):
            st = os.stat(self._full(path))
        if not os.path.isfile(self._full(path)):
            raise StorageNotFound(f"{self.describe(path)} is not a file")
        return st.st_size

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self._full(prefix.rstrip("/"))
        if os.path.isfile(base):
            st = os.stat(base)
            yield {"path": prefix.rstrip("/"), "size": st.st_size, "mtime": st.st_mtime}
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in sorted(filenames):
                if _is_tmp(name):
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # deleted while we walked
                    continue
                yield {"path": os.path.relpath(full, self.root), "size": st.st_size, "mtime": st.st_mtime}

    def delete(self, paths: Iterable[str]) -> None:
        parents = set()
        for path in paths:
            full = self._full(path)
            with self._mapped(f"cannot delete {self.describe(path)}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)
            parents.add(os.path.dirname(full))
        # Drop directories the deletes emptied (a retired step), never the root.
        for parent in sorted(parents, key=len, reverse=True):
            while parent.startswith(self.root + os.sep):
                try:
                    os.rmdir(parent)
                except OSError:
                    break
                parent = os.path.dirname(parent)

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        """The temporary files under the root, with the time since each was
        last written to."""
        found: list[IncompleteWrite] = []
        if not os.path.isdir(self.root):
            return found
        now = time.time()
        for dirpath, _, filenames in os.walk(self.root):
            for name in sorted(filenames):
                if _is_tmp(name):
                    full = os.path.join(dirpath, name)
                    with contextlib.suppress(FileNotFoundError):
                        found.append(IncompleteWrite(os.path.relpath(full, self.root), now - os.path.getmtime(full)))
        return found

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """Each temporary file's name is unique to its write; one written to
        within ``older_than_s`` seconds (looked at again now) is kept."""
        removed = 0
        for write in writes:
            full = self._full(write.path)
            with contextlib.suppress(FileNotFoundError):
                if time.time() - os.path.getmtime(full) >= older_than_s:
                    os.unlink(full)
                    removed += 1
        return removed
