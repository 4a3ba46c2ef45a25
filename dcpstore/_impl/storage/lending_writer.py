"""Parts that send lent bytes from where they lie: :class:`LendingObjectWriter`
and the :class:`PartBody` it hands its backend.

A part of an upload usually spans several records: a tensor's bytes and the
few hundred bytes of zip headers around them. Copying all of it into one
contiguous buffer is a pass over every byte, on the order of the request's
own digest (BENCHMARKS.md, "S3 parts lent from the tensors", has what
lending took off a save's client CPU). A :class:`PartBody` instead keeps the pieces
where they are -- slices of the tensors' own memory, and small copied
buffers for the headers -- and is read by the HTTP client as a file, one
piece at a time.

The pieces must not change until the request is answered: a piece is a
slice of a tensor the writer was *lent* (see
:meth:`~dcpstore._impl.storage.base.ObjectWriter.write_lent`), and the part
keeps that tensor alive (``owners``) until it is released.
"""

from __future__ import annotations

import abc
import io
from collections.abc import Sequence
from typing import Any

from dcpstore._impl.storage.backend_base import errors_mapped
from dcpstore._impl.storage.base import Storage
from dcpstore._impl.storage.buffered import BufferedObjectWriter
from dcpstore._impl.util.checksum import crc32c

#: Lent writes smaller than this are copied: a piece of its own in a part
#: costs more than copying a few KiB.
LEND_MIN = 64 << 10


class PartBody(io.RawIOBase):
    """A read-only, seekable file over ``pieces`` (byte views), in order.

    ``read(n)`` returns a view into the piece under the position (at most
    the rest of that piece: a short read, which every reader of a file
    allows) rather than a copy; ``read()`` copies the rest. ``owners`` are kept alive with the pieces;
    ``buffers`` are the part buffers among the pieces, which the writer
    recycles once the part is answered. :meth:`release` drops all of them.
    """

    def __init__(
        self, pieces: Sequence[memoryview], owners: Sequence[Any] = (), buffers: Sequence[bytearray] = ()
    ) -> None:
        super().__init__()
        self._pieces = [p for p in pieces if p.nbytes]
        self._starts: list[int] = []
        total = 0
        for p in self._pieces:
            self._starts.append(total)
            total += p.nbytes
        self.nbytes = total
        self.owners = list(owners)
        self.buffers = list(buffers)
        self._pos = 0
        self._index = 0  # the piece that holds ``_pos`` (or len(pieces) at the end)

    def __len__(self) -> int:
        return self.nbytes

    def __bool__(self) -> bool:
        return self.nbytes > 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.nbytes}[whence]
        pos = base + offset
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        self._index = 0
        while self._index < len(self._pieces) and self._starts[self._index] + self._pieces[self._index].nbytes <= pos:
            self._index += 1
        return pos

    def read(self, size: int | None = -1) -> memoryview | bytes:
        if self._index >= len(self._pieces) or size == 0:
            return b""
        if size is None or size < 0:  # the rest, as one bytes (a copy)
            rest = [self.read(self.nbytes) for _ in range(self._index, len(self._pieces))]
            return b"".join(rest)
        piece = self._pieces[self._index]
        start = self._pos - self._starts[self._index]
        end = min(piece.nbytes, start + size)
        out = piece[start:end]
        self._pos += out.nbytes
        if end == piece.nbytes:
            self._index += 1
        return out

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = 0
        while n < out.nbytes:
            chunk = self.read(out.nbytes - n)
            if not chunk:
                break
            out[n : n + len(chunk)] = chunk
            n += len(chunk)
        return n

    def crc32c(self) -> int:
        """The CRC32C of all the bytes (the position is left alone)."""
        crc = 0
        for piece in self._pieces:
            crc = crc32c(piece, crc)
        return crc

    def getvalue(self) -> bytes:
        """All the bytes, copied (for tests and small bodies)."""
        return b"".join(self._pieces)

    def release(self) -> list[bytearray]:
        """Drop the pieces and owners; return the part buffers for reuse."""
        buffers, self.buffers = self.buffers, []
        for piece in self._pieces:
            try:
                piece.release()  # a part buffer may be resized once reused: no view of it may outlive the part
            except BufferError:
                buffers = []  # something still reads it: let the buffers go rather than reuse them
        self._pieces, self._starts, self.owners = [], [], []
        self.nbytes = self._pos = self._index = 0
        return buffers


#: What a lending writer's parts and tail are.
Part = bytearray | PartBody


class LendingObjectWriter(BufferedObjectWriter):
    """A :class:`BufferedObjectWriter` with a part size whose lent bytes
    (:meth:`write_lent`, :data:`LEND_MIN` or more) are not copied.

    A part that holds lent bytes is a :class:`PartBody` over its pieces in
    order: the bytes copied before the first lent slice (in their part
    buffer), the lent slices, and the copied runs between them. So
    ``_write_part``, ``_seal`` and ``_publish`` get a bytearray or a body;
    :meth:`_recycle` releases a body (its lenders, and its part buffer to
    :data:`~dcpstore._impl.storage.buffered.PARTS`) once nothing reads it.
    """

    def __init__(self, storage: Storage, path: str, part_size: int, size_hint: int | None = None) -> None:
        super().__init__(storage, path, part_size, size_hint)
        self._pieces: list[memoryview] = []
        self._owners: list[object] = []
        self._buffers: list[bytearray] = []
        self._lent_fill = 0  # bytes in _pieces
        self._loose = bytearray()  # bytes copied since the last lent slice

    @abc.abstractmethod
    def _write_part(self, part: bytes | bytearray | memoryview | PartBody) -> None: ...

    @abc.abstractmethod
    def _publish(self, tail: Part) -> None: ...

    # The base's seal() and _commit() hand _seal and _publish what _last()
    # returns, which here may be a body: the base types them for bytearrays.
    def _seal(self, tail: Part) -> Part:  # type: ignore[override]
        return tail

    def write_lent(self, data: bytes | bytearray | memoryview, owner: object) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < LEND_MIN or self._sealed or self._part_size is None:
            return self.write(view)
        with errors_mapped(self._storage, self._what):
            self._lend(view, owner, self._part_size)
        self._pos += view.nbytes
        return view.nbytes

    def _lend(self, view: memoryview, owner: object, part_size: int) -> None:
        if self._part is not None:  # the bytes copied so far open this part
            self._pieces.append(memoryview(self._part)[: self._fill])
            self._buffers.append(self._part)
            self._lent_fill, self._part, self._fill = self._fill, None, 0
        while view.nbytes:
            self._close_loose()
            take = min(part_size - self._lent_fill, view.nbytes)
            self._pieces.append(view[:take])
            self._owners.append(owner)
            self._lent_fill += take
            view = view[take:]
            if self._lent_fill == part_size:
                self._write_part(self._body())

    def _gather(self, view: memoryview, part_size: int) -> None:
        while view.nbytes and self._pieces:  # copies between lent slices
            take = min(part_size - self._lent_fill - len(self._loose), view.nbytes)
            self._loose += view[:take]
            view = view[take:]
            if self._lent_fill + len(self._loose) == part_size:
                self._write_part(self._body())
        if view.nbytes:
            super()._gather(view, part_size)

    def _close_loose(self) -> None:
        if self._loose:
            self._pieces.append(memoryview(self._loose))
            self._lent_fill += len(self._loose)
            self._loose = bytearray()

    def _body(self) -> PartBody:
        """The part with lent bytes gathered so far; the next one starts empty."""
        self._close_loose()
        body = PartBody(self._pieces, self._owners, self._buffers)
        self._pieces, self._owners, self._buffers, self._lent_fill = [], [], [], 0
        return body

    def _last(self) -> Part:  # type: ignore[override]
        """What is gathered and not sent yet (fewer than a part)."""
        return self._body() if self._pieces else self._tail()

    def _recycle(self, part: bytearray | bytes | memoryview | PartBody) -> None:
        for buf in part.release() if isinstance(part, PartBody) else [part]:
            super()._recycle(buf)

    def _abort(self) -> None:
        self._pieces, self._owners, self._buffers, self._lent_fill, self._loose = [], [], [], 0, bytearray()
        super()._abort()
