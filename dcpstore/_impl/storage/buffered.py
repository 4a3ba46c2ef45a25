"""The object writer every backend builds on.

:class:`BufferedObjectWriter` owns what all writers share -- the position,
``tell``, the part buffer, and mapping errors -- so that a backend fills in
only how bytes leave and land, in three steps (the split of fsspec's
``AbstractBufferedFile``, whose backends fill in upload-chunk, commit and
discard)::

    write(data)  -> _write_part(part)   zero or more times, in order
    seal()       -> _seal(tail)         at most once, optional: no more bytes
                                        follow; send what may go before the commit
    commit()     -> _publish(tail)      once: send the rest, make it visible
    abort()      -> _discard()          once: leave nothing visible

``commit`` and ``abort`` come from :class:`~dcpstore._impl.storage.base.ObjectWriter`
(a failed ``_publish`` is followed by ``_discard``). All of them run on the
thread that writes the object; a backend may hand parts to threads of its
own (S3 uploads several parts of one object at once).
"""

from __future__ import annotations

import abc
import os
import threading
from collections import OrderedDict

from dcpstore._impl.storage.backend_base import errors_mapped
from dcpstore._impl.storage.base import ObjectWriter, Storage
from dcpstore._impl.storage.storage_options import MiB
from dcpstore._impl.util.errors import StorageError


class BufferedObjectWriter(ObjectWriter):
    """Position, ``tell`` and part buffering for one object being written.

    ``part_size=None`` (streaming backends: a file descriptor, or a library
    file object that buffers by itself): each ``write`` goes to
    :meth:`_write_part` at once, as a byte view of the caller's memory that
    is valid only during the call; ``_publish`` gets an empty tail.

    ``part_size=n`` (object stores): bytes are gathered into parts of
    exactly ``n`` bytes; :meth:`_write_part` gets each whole part as a
    ``bytearray`` that it owns (it may keep it, e.g. to upload on another
    thread, and hands it to :meth:`_recycle` once nothing reads it), and
    :meth:`_publish` the rest, fewer than ``n`` bytes (possibly none). Every
    byte is copied once, into a part buffer taken from :data:`PARTS` (so
    that a process saving the same structure again writes into memory it
    already has, instead of faulting in fresh pages for every part); an
    object whose ``size_hint`` is under one part gets a buffer of that size.

    ``_write_part`` and ``_publish`` run inside the storage's error mapping,
    so they may raise their library's exceptions; the caller gets the
    dcpstore family, naming ``cannot write <uri>``.
    """

    def __init__(self, storage: Storage, path: str, part_size: int | None = None, size_hint: int | None = None) -> None:
        super().__init__()
        self._storage = storage
        self._path = path
        self._what = f"cannot write {storage.describe(path)}"
        self._part_size = part_size
        # An object expected to be smaller than a part is gathered in a buffer
        # of its own size: zero-filling a whole part (8 MiB or more) for a
        # few KiB was the largest CPU cost of a small save.
        self._small = size_hint if part_size and size_hint and size_hint < part_size else None
        self._part: bytearray | None = None  # the part being gathered, _fill bytes of it so far
        self._fill = 0
        self._kept = bytearray()  # what _seal left for _publish
        self._pos = 0
        self._sealed = False

    # -- the three steps a backend fills in ----------------------------------
    @abc.abstractmethod
    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        """Send the next bytes of the object on (see the class docstring for
        what ``part`` is in each mode)."""

    @abc.abstractmethod
    def _publish(self, tail: bytearray) -> None:
        """Send ``tail`` (the last, partial part) and make the whole object
        durable and visible under its final name, atomically."""

    def _seal(self, tail: bytearray) -> bytearray:
        """No byte follows ``tail`` (the buffered rest, fewer than a part):
        send what can go before the commit; return what ``_publish`` is to
        get. The default keeps it all for ``_publish``."""
        return tail

    @abc.abstractmethod
    def _discard(self) -> None:
        """Drop whatever was sent; nothing becomes visible. Best effort: it
        runs while another error propagates, so it must not raise (it logs
        what it could not clean up)."""

    # -- what the writer above calls -----------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n and self._sealed:
            raise StorageError(f"{self._what}: write after seal() (the object's bytes were declared complete)")
        if n:
            with errors_mapped(self._storage, self._what):
                if self._part_size is None:
                    self._write_part(view)
                else:
                    self._gather(view, self._part_size)
            self._pos += n
        return n

    def tell(self) -> int:
        return self._pos

    def _gather(self, view: memoryview, part_size: int) -> None:
        while view.nbytes:
            if self._part is None:
                self._part, self._fill = PARTS.take(part_size) if self._small is None else bytearray(self._small), 0
            elif self._fill == len(self._part) < part_size:
                self._part += bytearray(part_size - self._fill)  # longer than its hint said: whole parts after all
                self._small = None
            take = min(len(self._part) - self._fill, view.nbytes)
            self._part[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == part_size:
                part, self._part = self._part, None
                self._write_part(part)

    def _tail(self) -> bytearray:
        """The bytes gathered and not sent yet (fewer than a part), as a
        bytearray of exactly that length."""
        part, self._part = self._part, None
        if part is None:
            return bytearray()
        del part[self._fill :]  # no copy: the buffer keeps its memory
        return part

    def _recycle(self, part: bytearray | bytes | memoryview) -> None:
        """``part``, one that :meth:`_write_part` got, is read by nobody any
        more: its buffer may serve the next part (see :data:`PARTS`)."""
        if isinstance(part, bytearray) and len(part) == self._part_size:
            PARTS.give(part)

    def _last(self) -> bytearray:
        """What ``_seal`` or ``_publish`` gets: :meth:`_tail`, unless a
        subclass gathers parts of another kind."""
        return self._tail()

    def seal(self) -> None:
        if self._closed or self._sealed:
            return
        self._sealed = True
        tail = self._last()
        with errors_mapped(self._storage, self._what):
            self._kept = self._seal(tail)

    def _commit(self) -> None:
        tail = self._kept if self._sealed else self._last()
        self._kept = bytearray()
        with errors_mapped(self._storage, self._what):
            self._publish(tail)

    def _abort(self) -> None:
        self._part, self._kept = None, bytearray()
        self._discard()


#: Part buffers a process keeps between writes, at most this many bytes in all.
PART_CACHE_BYTES = 256 * MiB


class PartCache:
    """Part buffers for reuse, by size, up to ``limit`` bytes in all.

    An upload's part is a buffer of exactly the part size; a fresh one costs a
    page fault per 4 KiB as it fills (kernel time about a third of the
    copy's, measured on this project's VM), every part of every save. A
    process that saves the same structure again asks for the same part
    sizes, so buffers handed back when their upload is done serve the next
    parts (within a save, from its second round on; across saves, from the
    first). Sizes not asked for any more are dropped first when the cache is
    full. Thread-safe; a forked child starts empty.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free: OrderedDict[int, list[bytearray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _mine(self) -> None:
        if self._pid != os.getpid():  # a forked child: the lock may be held, the buffers are the parent's
            self._free, self._bytes, self._lock, self._pid = OrderedDict(), 0, threading.Lock(), os.getpid()

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes (its contents are to be overwritten)."""
        self._mine()
        with self._lock:
            free = self._free.get(size)
            if free:
                self._bytes -= size
                return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        """Keep ``buf`` for a later :meth:`take` of its size, if it fits."""
        self._mine()
        size = len(buf)
        with self._lock:
            while self._bytes + size > self.limit and self._free:
                oldest, bufs = next(iter(self._free.items()))
                if oldest == size:
                    break  # the size in use is the last to go
                self._bytes -= oldest * len(bufs)
                del self._free[oldest]
            if self._bytes + size > self.limit:
                return
            self._free.setdefault(size, []).append(buf)
            self._free.move_to_end(size)
            self._bytes += size

    def cached_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0


#: The process's part buffers (see :class:`PartCache`).
PARTS = PartCache(PART_CACHE_BYTES)
