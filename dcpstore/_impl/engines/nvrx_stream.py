"""The NVRx engine's write streams: whole writes, the storage's own error,
and where each tensor's bytes landed.

NVRx writes each item with torch's ``_write_item``, i.e. ``torch.save`` into
the bucket's file. A storage error raised inside ``torch.save`` (ENOSPC,
EIO) reaches torch's C++ zip writer, which reports only its own
``RuntimeError`` ("unexpected pos ..."); and a disk that fills mid-write
first returns a *short* write, which the zip writer counts as written.
Where ``_write_item`` takes stream transforms (torch >= 2.7; NVRx passes
them on), :class:`CheckedTransforms` puts :class:`_WholeWrites` under every
item's stream: short writes are completed (so a full disk surfaces as its
ENOSPC) and the first ``OSError`` is kept, for the engine to raise instead
of torch's report of it.

The same stream sees every byte of the record, so it also locates each
row-major tensor's raw bytes in its item, the way the native writer's
:class:`~dcpstore._impl.format.record.RecordStream` does: torch's zip writer hands
a CPU storage's bytes to ``write`` in one call, from the storage's own
memory, so the write of that size from that address *is* the tensor's data,
and the bytes counted before it are its offset in the item. Without these
locations a load would parse every record (about 0.65x of a native-written
checkpoint's speed); with them it reads the bytes straight into place.
Nothing is predicted: a location is recorded only when that write was seen,
and only when no stream extension (compression) sits between torch and the
file.
"""

from __future__ import annotations

import errno
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from dcpstore._impl.format.record import is_raw
from dcpstore._impl.storage.byte_ranges import buffer_address


class CheckedTransforms:
    """torch's stream transforms for one bucket, every write made whole and
    the first ``OSError`` kept in :attr:`error`.

    ``tensors``: the bucket's ``(write item, tensor)`` pairs; after the
    bucket is written, :attr:`raw` maps each located tensor's item index to
    ``(offset of its bytes in the item, nbytes)``.
    """

    def __init__(self, inner: Any, tensors: Iterable[tuple[Any, torch.Tensor]] = ()) -> None:
        self._inner = inner
        self.error: OSError | None = None
        self.raw: dict[Hashable, tuple[int, int]] = {}
        self._expect = {item.index: (t.nbytes, t.untyped_storage().data_ptr()) for item, t in tensors if is_raw(t)}

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> Any:
        whole = _WholeWrites(raw_stream, self)
        out = self._inner.transform_save_stream(write_item, whole)
        expect = self._expect.get(write_item.index)
        # (stream, descriptors); no descriptors: the file gets exactly what torch writes
        if expect is not None and isinstance(out, tuple) and len(out) == 2 and not out[1]:
            whole.locate(write_item.index, expect)
        return out


class _WholeWrites:
    """Writes all of every buffer to ``raw`` and records the first
    ``OSError``. (Not an ``io.IOBase``: its finaliser would flush ``raw``
    again at garbage collection, long after NVRx closed it.)"""

    def __init__(self, raw: Any, owner: CheckedTransforms) -> None:
        self._raw = raw
        self._owner = owner
        self._written = 0  # bytes of this item so far
        self._index: Hashable = None
        self._expect: tuple[int, int] | None = None

    def locate(self, index: Hashable, expect: tuple[int, int]) -> None:
        """Record in the owner's ``raw[index]`` where the write of
        ``expect`` (nbytes, address) lands in this item."""
        self._index, self._expect = index, expect

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if self._expect is not None and size == self._expect[0] and buffer_address(view) == self._expect[1]:
            self._owner.raw[self._index] = (self._written, size)
            self._expect = None
        try:
            while view.nbytes:
                n = self._raw.write(view)
                if not n:  # neither progress nor an error: say so rather than spin
                    raise OSError(errno.EIO, f"write made no progress ({view.nbytes} bytes left)")
                view = view[n:]
        except OSError as e:
            self._owner.error = self._owner.error or e
            raise
        self._written += size
        return size

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            self._owner.error = self._owner.error or e
            raise

    def close(self) -> None:
        """The bucket's file stays open for its next item; NVRx closes it."""
        self.flush()
