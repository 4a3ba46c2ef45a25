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

``commit`` and ``abort`` come from :class:`~dcpstore.storage.base.ObjectWriter`
(a failed ``_publish`` is followed by ``_discard``). All of them run on the
thread that writes the object; a backend may hand parts to threads of its
own (S3 uploads several parts of one object at once).
"""

from __future__ import annotations

import abc

from ..errors import StorageError
from .base import ObjectWriter, Storage


class BufferedObjectWriter(ObjectWriter):
    """Position, ``tell`` and part buffering for one object being written.

    ``part_size=None`` (streaming backends: a file descriptor, or a library
    file object that buffers by itself): each ``write`` goes to
    :meth:`_write_part` at once, as a byte view of the caller's memory that
    is valid only during the call; ``_publish`` gets an empty tail.

    ``part_size=n`` (object stores): bytes are gathered into parts of
    exactly ``n`` bytes; :meth:`_write_part` gets each whole part as
    ``bytes``/``bytearray`` that it owns (it may keep it, e.g. to upload on
    another thread), and :meth:`_publish` the rest, fewer than ``n`` bytes
    (possibly none). A write of at least a part from an empty buffer costs
    one copy per part, no more.

    ``_write_part`` and ``_publish`` run inside the storage's error mapping,
    so they may raise their library's exceptions; the caller gets the
    dcpstore family, naming ``cannot write <uri>``.
    """

    def __init__(self, storage: Storage, path: str, part_size: int | None = None) -> None:
        super().__init__()
        self._storage = storage
        self._path = path
        self._what = f"cannot write {storage.describe(path)}"
        self._part_size = part_size
        self._buf = bytearray()
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
            with self._storage._mapped(self._what):
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
            if not self._buf and view.nbytes >= part_size:
                # A whole part straight from the caller's memory: its one copy.
                self._write_part(bytes(view[:part_size]))
                view = view[part_size:]
                continue
            take = min(part_size - len(self._buf), view.nbytes)
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == part_size:
                part, self._buf = self._buf, bytearray()
                self._write_part(part)

    def seal(self) -> None:
        if self._closed or self._sealed:
            return
        self._sealed = True
        tail, self._buf = self._buf, bytearray()
        with self._storage._mapped(self._what):
            self._buf = self._seal(tail)

    def _commit(self) -> None:
        tail, self._buf = self._buf, bytearray()
        with self._storage._mapped(self._what):
            self._publish(tail)

    def _abort(self) -> None:
        self._buf = bytearray()
        self._discard()
