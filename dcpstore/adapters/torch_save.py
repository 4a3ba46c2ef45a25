"""``torch.save`` without its zip CRC-32, per call.

A DCP data file is a run of ``torch.save`` records, and stock ``torch.save``
computes a software CRC-32 over every byte it writes: measured here, that one
checksum caps ``torch.save`` at ~2.7 GB/s per core, while the record itself
(a memoryview of the tensor's storage handed to ``write``) costs next to
nothing. dcpstore already checksums every record with hardware CRC32C and
verifies it on load, so the zip CRC is a second, slower checksum of the same
bytes.

torch offers only a process-global switch
(``torch.serialization.set_crc32_options``), which would change every
``torch.save`` in the user's process, from any thread. Instead we build the
zip writer ourselves with ``compute_crc32=False`` and run torch's own
``_save`` on it: the record is byte-for-byte what ``torch.save`` writes with
that switch off (CRC fields zero), and stock ``torch.load`` -- hence stock
``dcp.load`` -- reads it, as it reads any file saved with the switch off.

Both pieces are private torch API, so they are feature-detected once; if a
torch release changes them, :func:`save_record` falls back to plain
``torch.save`` (slower, same format).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from functools import cache
from typing import IO, Any

import torch
from torch import serialization as _ser

Saver = Callable[[Any, IO[bytes]], None]


def _save_without_crc(obj: Any, stream: IO[bytes]) -> None:
    alignment = _ser._get_storage_alignment()
    writer = torch._C.PyTorchFileWriter(stream, False, alignment)
    _ser._save(obj, writer, pickle, _ser.DEFAULT_PROTOCOL, False)  # type: ignore[no-untyped-call]
    writer.write_end_of_file()


def _torch_save(obj: Any, stream: IO[bytes]) -> None:
    torch.save(obj, stream)


@cache
def record_saver() -> Saver:
    """The fastest record writer this torch supports (decided once).

    The probe saves a small tensor both ways and keeps the CRC-free writer
    only if ``torch.load`` reads its record back equal.
    """
    import io

    probe = torch.arange(4, dtype=torch.float32)
    try:
        buf = io.BytesIO()
        _save_without_crc(probe, buf)
        buf.seek(0)
        if torch.equal(torch.load(buf, weights_only=True), probe):
            return _save_without_crc
    except Exception:  # a torch whose private writer API moved: use the public one
        pass
    return _torch_save


def save_record(obj: Any, stream: IO[bytes]) -> None:
    """Write ``obj`` to ``stream`` as one ``torch.save`` record (no zip CRC)."""
    record_saver()(obj, stream)
