"""The NVRx engine's write streams: whole writes, and the storage's own error.

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

Layer: engines. Imports nothing of ours.
"""

from __future__ import annotations

import errno
from typing import Any


class CheckedTransforms:
    """torch's stream transforms for one bucket, every write made whole and
    the first ``OSError`` kept in :attr:`error`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.error: OSError | None = None

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> Any:
        return self._inner.transform_save_stream(write_item, _WholeWrites(raw_stream, self))


class _WholeWrites:
    """Writes all of every buffer to ``raw`` and records the first
    ``OSError``. (Not an ``io.IOBase``: its finaliser would flush ``raw``
    again at garbage collection, long after NVRx closed it.)"""

    def __init__(self, raw: Any, owner: CheckedTransforms) -> None:
        self._raw = raw
        self._owner = owner

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        try:
            while view.nbytes:
                n = self._raw.write(view)
                if not n:  # neither progress nor an error: say so rather than spin
                    raise OSError(errno.EIO, f"write made no progress ({view.nbytes} bytes left)")
                view = view[n:]
        except OSError as e:
            self._owner.error = self._owner.error or e
            raise
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
