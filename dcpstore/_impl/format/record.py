"""The tensor record codec: how one item lies in a data file, both ways.

A DCP data file is a run of items: a bytes item is its bytes, a tensor item
is one ``torch.save`` record. Before the record of a large tensor goes a
pad of zeros that belongs to no item (shorter than
:data:`~.layout.PAD_LIMIT`), so that the tensor's bytes lie where the
kernel moves them cheapest:

* a tensor of :data:`ALIGN_MIN` bytes or more: its record starts at a
  multiple of :data:`~.layout.DATA_ALIGN`. Torch aligns a tensor's bytes to
  64 inside its record, so they then lie on cache lines in the file as in
  memory: the kernel's copy between the page cache and a tensor costs more
  CPU when the two are misaligned (``BENCHMARKS.md``, "The local disk at
  its limit");
* a tensor of :data:`DIRECT_MIN` bytes or more stored as it lies, into a
  file written with direct I/O (the sink's ``direct_align``): its bytes lie
  at the same offset in a page as in memory, found by a dry run of the
  record's headers (:func:`_data_offset`), so that every whole page of it
  goes from the tensor's memory to the disk with no copy
  (``StorageOptions(direct_io=True)``).

Readers find items by offset, stock DCP's too, so the pads change nothing
for them. This module writes the records (:class:`RecordStream`: records
one after another into an :class:`~dcpstore.storage.ObjectWriter`, each
item's and the file's CRC32C computed on the way) and reads a tensor back
out of an item's bytes (:func:`item_tensor`: a view where it can, no copy).

``torch.save`` without its zip CRC-32, per call. Stock ``torch.save``
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

import io
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import IO, Any, Protocol, cast

import torch
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from dcpstore._impl.format.layout import DATA_ALIGN
from dcpstore._impl.format.record_zip import RecordBytes, record_entries, tensor_declaration
from dcpstore._impl.storage.byte_ranges import buffer_address
from dcpstore._impl.util.checksum import COMBINE_MIN, DualCrc, crc32c
from dcpstore._impl.util.torch_compat import (
    StorageReaderTransforms,
    StorageWriterTransforms,
    neg_view,
    save_without_crc,
)
from dcpstore._impl.util.warning_filters import ignoring

Saver = Callable[[Any, IO[bytes]], None]

#: Tensors this large have their records aligned (:data:`DATA_ALIGN`);
#: below it the copy's cost is noise and the pad is not (many small tensors).
ALIGN_MIN = 64 << 10
#: Tensors this large are placed for direct I/O where the file is written
#: so (a pad of up to a page each; below this, direct I/O saves little).
DIRECT_MIN = 1 << 20


def _torch_save(obj: Any, stream: IO[bytes]) -> None:
    torch.save(obj, stream)


@cache
def record_saver() -> Saver:
    """The fastest record writer this torch supports (decided once).

    The probe saves a small tensor both ways and keeps the CRC-free writer
    only if ``torch.load`` reads its record back equal.
    """
    probe = torch.arange(4, dtype=torch.float32)
    try:
        buf = io.BytesIO()
        save_without_crc(probe, buf)
        buf.seek(0)
        if torch.equal(torch.load(buf, weights_only=True), probe):
            return save_without_crc
    except Exception:  # a torch whose private writer API moved: use the public one
        pass
    return _torch_save


def save_record(obj: Any, stream: IO[bytes]) -> None:
    """Write ``obj`` to ``stream`` as one ``torch.save`` record (no zip CRC)."""
    record_saver()(obj, stream)


def compact_cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose record to write: detached, on the CPU, and no larger
    than itself (a view of a larger storage is cloned: torch.save would write
    the whole storage; stock DCP saves only the projection too)."""
    tensor = tensor.detach()
    if tensor._is_zerotensor():
        # An efficient zero tensor has no storage to write: write real zeros.
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


# ---------------------------------------------------------------------------
# Writing items
# ---------------------------------------------------------------------------


class Sink(Protocol):
    """Where a :class:`RecordStream` writes: an ObjectWriter's three calls,
    and whether it writes lent buffers' whole pages directly (see
    :attr:`~dcpstore.storage.ObjectWriter.direct_align`)."""

    direct_align: int | None

    def write(self, data: Any) -> Any: ...

    def write_lent(self, data: Any, owner: object) -> Any: ...

    def tell(self) -> int: ...


@dataclass(frozen=True)
class WrittenItem:
    """Where one item landed in its data file, and its CRC32C.

    ``raw`` is ``(offset in the item, nbytes)`` of the tensor's bytes when
    the record holds them row-major and contiguous, so that a load can read
    them straight into the destination tensor; ``None`` otherwise.
    """

    offset: int
    length: int
    crc32c: int
    raw: tuple[int, int] | None = None


class RecordStream:
    """One data file being written, item by item (:meth:`write_item`), then
    :meth:`finish`.

    Keeps the item and file CRC32Cs (:class:`DualCrc`: one pass over the
    bytes), and coalesces small writes: torch.save emits ~40 tiny writes (zip
    headers) per tensor, and 20,000 small tensors would otherwise cost
    ~800,000 storage calls. Large writes (tensor data) pass straight through
    without a copy, and one from the tensor's own storage is *lent* to the
    sink (``write_lent``, the tensor its owner): the data file is written
    before the save returns, and nothing changes a tensor that a save is
    writing. ``write``/``tell``/``flush`` are the file interface
    torch.save writes a record through.
    """

    SMALL = 64 << 10
    BUFFER = 1 << 20
    #: Large writes are checksummed and forwarded in pieces of this size:
    #: small enough to stay in a core's L2 between the two passes, large
    #: enough that a piece's Python round trip is noise beside its copy.
    PIECE = 1 << 20

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._buf = bytearray()
        # Small writes are checksummed in one call per batch, not one per
        # write (torch.save makes ~40 per record): ``_buf[_crc_from:]`` is
        # what the CRCs have not seen yet.
        self._crc_from = 0
        self._crc = DualCrc()
        # While a tensor is written: the size of the one write that carries
        # its bytes, where those bytes live, and where that write landed.
        self._raw_nbytes = 0
        self._raw_ptr = 0
        self._raw: tuple[int, int] | None = None
        # The tensor being written, and where its storage's bytes lie.
        self._owner: torch.Tensor | None = None
        self._storage_end = 0
        # The first storage error. torch.save's C++ writer swallows
        # exceptions raised by ``write`` and reports its own RuntimeError
        # ("unexpected pos ..."); we re-raise this one instead.
        self._error: BaseException | None = None

    def write_item(self, data: io.BytesIO | torch.Tensor) -> WrittenItem:
        """Append one item: a bytes blob as it is, a tensor (already a
        :func:`compact_cpu_tensor`) as one record."""
        if isinstance(data, torch.Tensor):
            direct = self._sink.direct_align
            if direct and data.nbytes >= DIRECT_MIN and is_raw(data):
                # The tensor's bytes at its memory's offset in a page: whole pages then go straight to the disk.
                at = data.untyped_storage().data_ptr() - self.tell() - _data_offset(data)
                self._pad(at % direct)
            elif data.nbytes >= ALIGN_MIN:
                self._pad(-self.tell() % DATA_ALIGN)
        offset = self.tell()
        self._crc.start_item()
        raw = None
        if isinstance(data, io.BytesIO):
            self.write(data.getbuffer())
        else:
            self._save_tensor(data)
            if self._raw is not None:
                raw = (self._raw[0] - offset, self._raw[1])
        self._crc_catch_up()
        return WrittenItem(offset, self.tell() - offset, self._crc.item, raw)

    def _pad(self, pad: int) -> None:
        """``pad`` zero bytes: in the file's CRC, in no item's (the next
        item's starts after them)."""
        if pad:
            self._buf += bytes(pad)
            self._crc_catch_up()

    def finish(self) -> tuple[int, int]:
        """Hand the buffered bytes on; the file's size and CRC32C."""
        self._drain()
        return self._sink.tell(), self._crc.file

    def _save_tensor(self, tensor: torch.Tensor) -> None:
        # torch hands a CPU storage's bytes to ``write`` in one call, from the
        # storage's own memory: for a tensor that is its whole storage,
        # row-major, that call (same size, same address) is the raw tensor.
        self._raw = None
        self._raw_nbytes = tensor.nbytes if is_raw(tensor) else 0
        storage = tensor.untyped_storage()
        self._raw_ptr = storage.data_ptr()
        self._owner, self._storage_end = tensor, self._raw_ptr + storage.nbytes()
        try:
            save_record(tensor, cast(IO[bytes], self))
        except Exception:
            if self._error is not None:
                raise self._error  # noqa: B904 (keeps its own __cause__, the OSError)
            raise
        finally:
            self._raw_nbytes = 0
            self._owner = None

    # -- the file torch.save writes into ----------------------------------
    def write(self, data: Any) -> int:
        view = memoryview(data)
        size = view.nbytes
        # Where the bytes lie, for the raw-tensor check and the lending check.
        address = buffer_address(view) if size >= self.SMALL or size == self._raw_nbytes else -1
        if size == self._raw_nbytes and self._raw is None and address == self._raw_ptr:
            self._raw = (self.tell(), size)
        if size < self.SMALL:
            self._buf += data
            if len(self._buf) >= self.BUFFER:
                self._drain()
        else:
            self._drain()
            lent = self._owner is not None and self._raw_ptr <= address and address + size <= self._storage_end
            self._write_large(view.cast("B"), self._owner if lent else None)
        return size

    def _write_large(self, view: memoryview, owner: torch.Tensor | None) -> None:
        """Checksum and forward ``view`` piece by piece: each piece's CRC
        pass brings it into the cache that the sink's copy (a local file's
        ``write``) then reads it from, instead of two passes over memory.
        One CRC combine per write, not per piece; a write too small to
        repay a combine updates both running CRCs."""
        if view.nbytes < COMBINE_MIN:
            self._crc.update(view)
            self._forward(view, owner)
            return
        direct = self._sink.direct_align
        if owner is not None and direct and (buffer_address(view) - self.tell()) % direct == 0:
            # Placed for direct I/O: whole, its pages go to the disk in large
            # direct writes, not through the cache, so the CRC reads memory
            # either way.
            self._forward(view, owner)
            self._crc.update(view)
            return
        crc = 0
        for start in range(0, view.nbytes, self.PIECE):
            piece = view[start : start + self.PIECE]
            self._forward(piece, owner)
            crc = crc32c(piece, crc)
        self._crc.append(crc, view.nbytes)

    def tell(self) -> int:
        return self._sink.tell() + len(self._buf)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """torch.save flushes after every tensor; batching across tensors is
        the point of the buffer, so this is deliberately a no-op."""

    def _crc_catch_up(self) -> None:
        if self._crc_from < len(self._buf):
            with memoryview(self._buf) as whole, whole[self._crc_from :] as pending:
                self._crc.update(pending)
            self._crc_from = len(self._buf)

    def _drain(self) -> None:
        self._crc_catch_up()
        if self._buf:
            buf, self._buf, self._crc_from = self._buf, bytearray(), 0
            self._forward(buf)

    def _forward(self, data: Any, owner: torch.Tensor | None = None) -> None:
        try:
            if owner is None:
                self._sink.write(data)
            else:
                self._sink.write_lent(data, owner)
        except BaseException as e:
            self._error = self._error or e
            raise


def is_raw(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage bytes, as they lie, are its values.

    A conjugate or negative view stores the un-conjugated / un-negated bytes
    plus a flag (torch.save keeps the flag in the record): its bytes are not
    its values, so a load must go through the record.
    """
    return (
        tensor.nbytes > 0
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
    )


class _Landing:
    """A file that keeps nothing and notes where a record's one write of
    ``nbytes`` (its tensor's bytes) lands: :func:`_data_offset`'s."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes
        self.pos = 0
        self.at = -1

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n == self._nbytes and self.at < 0:
            self.at = self.pos
        self.pos += n
        return n

    def tell(self) -> int:
        return self.pos

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


def _data_offset(tensor: torch.Tensor) -> int:
    """Where a raw tensor's bytes start in its record: a dry run of the
    record, which writes nothing and reads no tensor byte (the record's
    headers depend only on the tensor's metadata)."""
    landing = _Landing(tensor.nbytes)
    save_record(tensor, cast(IO[bytes], landing))
    return max(landing.at, 0)


# ---------------------------------------------------------------------------
# Reading items
# ---------------------------------------------------------------------------


class _ViewReader(io.RawIOBase):
    """A read-only file over a memoryview, for ``torch.load``.

    ``io.BytesIO(view)`` copies the whole item before torch reads it (and
    torch then copies it again into the tensor's storage); torch's zip reader
    uses ``readinto``, so this reader hands it the bytes with one copy only.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B") if view.format != "B" else view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._view) - self._pos))
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


#: Items smaller than this are copied by torch.load: parsing the header twice
#: costs more than copying a small tensor (measured on 20,000 x 3 KiB items).
VIEW_MIN_BYTES = 1 << 20
#: torch warns (once per process) that a tensor over read-only bytes must not
#: be written to; item views are only ever read.
_READ_ONLY_WARNING = r"The given buffer is not writable"


def item_tensor(item: memoryview) -> torch.Tensor:
    """The tensor one ``torch.save`` item holds, as a view on ``item`` (no copy).

    ``torch.load`` copies the tensor's bytes into a new storage, which the
    reader then copies into the caller's tensor: on a VM where fresh memory
    costs page faults that extra copy dominated loads. Instead, read the
    record's directory and the tensor its ``data.pkl`` declares
    (:mod:`.record_zip`: no bytes of the tensor, nothing built) and view its
    single storage where it lies in ``item``. Anything else -- small items,
    several storages, another byte order, a pickle that is not a plain
    tensor's, a storage it does not name -- goes through ``torch.load``,
    which decides (and raises what it raises).
    """
    if len(item) >= VIEW_MIN_BYTES:
        try:
            view = _view_record(item)
        except Exception:  # an unexpected layout: the general path below decides
            view = None
        if view is not None:
            return view
    loaded: torch.Tensor = torch.load(cast(IO[bytes], _ViewReader(item)), map_location="cpu", weights_only=True)
    return loaded


#: The view flags a record's tensor metadata may carry, and how to set them on a view.
_VIEW_FLAGS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"conj": torch.conj, "neg": neg_view}


def _view_record(item: memoryview) -> torch.Tensor | None:
    record = RecordBytes.whole(item)
    entries = record_entries(record)
    order = entries.get("byteorder")
    storages = [name for name in entries if name.startswith("data/")]
    if storages != ["data/0"] or "data.pkl" not in entries:
        return None
    if order is not None and bytes(record.get(order.start, order.size)) != sys.byteorder.encode():
        return None
    pickled, data = entries["data.pkl"], entries["data/0"]
    declared = tensor_declaration(bytes(record.get(pickled.start, pickled.size)))
    if declared.storage_key != "0" or declared.storage_nbytes != data.size or data.size == 0:
        return None  # torch.load says what is wrong
    if not set(declared.flags) <= _VIEW_FLAGS.keys():
        return None
    with ignoring(_READ_ONLY_WARNING):
        raw = torch.frombuffer(record.get(data.start, data.size), dtype=torch.uint8)
    view = raw.view(declared.dtype).as_strided(declared.size, declared.stride, declared.storage_offset)
    for flag in sorted(declared.flags):  # the record's view bits, as torch.load would set them
        view = _VIEW_FLAGS[flag](view)
    return view


# ---------------------------------------------------------------------------
# Items under DCP's stream transforms (``_extensions``)
# ---------------------------------------------------------------------------
#
# DCP's StreamTransformExtensions (ZStandard, or a user's) turn an item's
# bytes into other bytes; ``_StorageInfo.transform_descriptors`` in
# ``.metadata`` names them, outermost last, so that any reader with the same
# registry undoes them. dcpstore applies and undoes them with DCP's own
# helpers, so its items are what stock DCP writes and reads. The stored
# (transformed) bytes are what the manifest's CRC32Cs cover.

#: The most bytes an item may decode to beyond what its metadata declares (a
#: tensor record's zip headers and alignment); a bytes item, whose size no
#: metadata declares, may decode to at most :data:`BYTES_ITEM_LIMIT`. A
#: crafted checkpoint must not inflate one item into all of memory.
RECORD_OVERHEAD = 1 << 20
BYTES_ITEM_LIMIT = 1 << 30


def encode_item(
    data: io.BytesIO | torch.Tensor, item: WriteItem, transforms: StorageWriterTransforms
) -> tuple[io.BytesIO, tuple[str, ...]]:
    """The item's bytes after ``transforms`` (a bytes blob to store as it
    is), and the descriptors ``.metadata`` records for it."""
    out = io.BytesIO()
    sink, descriptors = transforms.transform_save_stream(item, out)
    if isinstance(data, io.BytesIO):
        sink.write(data.getbuffer())
    else:
        save_record(data, sink)
    sink.close()
    return out, tuple(descriptors)


def decode_item(
    stored: memoryview, descriptors: Sequence[str], item: ReadItem, transforms: StorageReaderTransforms, limit: int
) -> memoryview:
    """Undo the stream transforms an item was stored with; at most ``limit``
    decoded bytes (raises ``ValueError`` beyond, or for an unknown
    transform)."""
    stream = transforms.transform_load_stream(item, descriptors, cast(IO[bytes], _ViewReader(stored)))
    decoded = stream.read(limit + 1)
    if len(decoded) > limit:
        raise ValueError(f"decodes to more than {limit} bytes")
    return memoryview(decoded)
