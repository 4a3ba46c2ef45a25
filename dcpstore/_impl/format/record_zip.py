"""What a ``torch.save`` record is, checked before anything trusts it.

A tensor or object item is one ``torch.save`` record: a zip archive whose
entries torch writes *stored* (never compressed), each named
``<archive>/<name>``: ``data.pkl`` (the pickle), ``byteorder``,
``data/<key>`` (a storage's bytes), ``version`` and a few more. torch's
reader (miniz) trusts the central directory: an entry declared DEFLATE-
compressed is inflated to whatever size it declares before anything checks
it (a 896 KiB record of a 4-float tensor inflated to 900 MiB). So every
record is checked here first (:func:`record_entries`): a well-formed end
record and central directory, every entry stored, its sizes equal, its local
header agreeing with the directory, its bytes inside the item and apart from
the others. Nothing a record declares is then larger than the record.

A load that reads a tensor's bytes straight into the destination trusts the
manifest's location of those bytes; :func:`check_raw_location` proves it
from the record itself: the entry ``data/0`` starts exactly there and is as
long, it is the record's only storage, and ``data.pkl`` declares a plain
row-major tensor of the dtype and shape ``.metadata`` declares, in this
machine's byte order. It reads only the record's bytes around the tensor
(the header and trailer a direct read lands in scratch), through
:class:`RecordBytes`.

Errors are :class:`RecordError` (a ``ValueError``); callers name the item.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dcpstore._impl.util.warning_filters import ignoring


class RecordError(ValueError):
    """The bytes are not a record torch.save writes, or not the one declared."""


_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header, 30 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_END = struct.Struct("<4sHHHHIIH")  # end of central directory, 22 bytes
_END64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes
_END64 = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
#: A record's data.pkl for one tensor is ~200 bytes; no plain tensor's is larger.
_TENSOR_PICKLE_LIMIT = 64 << 10


class RecordBytes:
    """The bytes of one record (``length`` in all) that a read holds: the
    whole item, or pieces of it (``(offset in the item, bytes)``). A check
    that needs bytes no piece holds fails: then the record is not laid out
    as the location claims."""

    def __init__(self, length: int, pieces: Sequence[tuple[int, memoryview]]) -> None:
        self.length = length
        self._pieces = [(start, view.cast("B") if view.format != "B" else view) for start, view in pieces]

    @classmethod
    def whole(cls, item: memoryview) -> RecordBytes:
        return cls(item.nbytes, [(0, item)])

    def get(self, offset: int, size: int) -> memoryview:
        if offset >= 0 and size >= 0:
            for start, view in self._pieces:
                if start <= offset and offset + size <= start + view.nbytes:
                    return view[offset - start : offset - start + size]
        raise RecordError(
            f"its layout points at bytes {offset}..{offset + size} of its {self.length}, which are not there"
        )


class Entry(NamedTuple):
    """One stored entry: its name (without the archive's directory) and
    where its local header and its bytes lie in the record (``start``: -1
    where its local header was not read)."""

    name: str
    header: int
    start: int
    size: int

    @property
    def end(self) -> int:
        """Where its bytes end (at the least: a local header is 30 bytes or more)."""
        return (self.start if self.start >= 0 else self.header + _LOCAL.size) + self.size


def record_entries(record: RecordBytes, headers: Collection[str] | None = None) -> dict[str, Entry]:
    """Every entry of the record, checked (see the module docstring), by name
    without the archive directory (``"data.pkl"``, ``"data/0"``, ...).
    ``headers``: check only these entries' local headers (None: all); the
    directory alone says where the others lie, and nothing reads them."""
    cd_offset, cd_size, count = _central_directory(record)
    entries: dict[str, Entry] = {}
    for short, raw_name, header, size in _directory(bytes(record.get(cd_offset, cd_size)), count):
        checked = headers is None or short in headers
        start = _local_start(record, header, raw_name, short) if checked else -1
        entries[short] = Entry(short, header, start, size)
    ordered = sorted(entries.values(), key=lambda e: e.header)
    for before, after in zip(ordered, [*ordered[1:], None]):
        if (after.header if after is not None else cd_offset) < before.end:
            what = f"entries {before.name!r} and {after.name!r} overlap" if after else f"entry {before.name!r} runs"
            raise RecordError(what + (" into the central directory" if after is None else ""))
    return entries


@functools.lru_cache(maxsize=256)
def _directory(directory: bytes, count: int) -> tuple[tuple[str, bytes, int, int], ...]:
    """The central directory's entries, checked: ``(name without the archive
    directory, raw name, local header offset, size)`` (cached: records of
    one dtype and shape have the same directory)."""
    out = []
    seen = set()
    archive = None
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(directory):
            raise RecordError("its central directory is truncated")
        sig, _, _, flags, method, _, _, _, csize, usize, n, m, k, _, _, _, header = _CENTRAL.unpack_from(directory, pos)
        if sig != b"PK\x01\x02":
            raise RecordError("its central directory is damaged")
        at = pos + _CENTRAL.size
        raw_name = directory[at : at + n]
        pos = at + n + m + k
        if pos > len(directory):
            raise RecordError("its central directory is truncated")
        if _U32 in (usize, csize, header):
            usize, csize, header = _zip64_sizes(directory[at + n : at + n + m], usize, csize, header)
        name = raw_name.decode("utf-8", "replace")
        if method != 0 or flags & 1:
            kind = "encrypted" if flags & 1 else f"compressed (method {method})"
            raise RecordError(f"entry {name!r} is {kind}; torch.save stores every entry as it is")
        if csize != usize:
            raise RecordError(f"entry {name!r} declares {usize} bytes stored in {csize}")
        head, _, short = name.partition("/")
        if not short or (archive is not None and head != archive):
            raise RecordError(f"entry {name!r} is outside the record's archive directory")
        archive = head
        if short in seen:
            raise RecordError(f"entry {name!r} appears twice")
        seen.add(short)
        out.append((short, raw_name, header, csize))
    if pos != len(directory):
        raise RecordError("its central directory holds more than its entries")
    return tuple(out)


def _central_directory(record: RecordBytes) -> tuple[int, int, int]:
    """(offset, size, entry count) of the central directory, from the end
    record (and the zip64 one torch always writes before it)."""
    if record.length < _END.size:
        raise RecordError("it is too short to be a torch.save record")
    end_at = record.length - _END.size
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = _END.unpack(record.get(end_at, _END.size))
    if sig != b"PK\x05\x06" or comment or disk or cd_disk:
        raise RecordError("it does not end as a torch.save record does")
    directory_end = end_at
    locator_at = end_at - _END64_LOCATOR.size
    if locator_at >= 0 and bytes(record.get(locator_at, 4)) == b"PK\x06\x07":
        _, _, end64_at, _ = _END64_LOCATOR.unpack(record.get(locator_at, _END64_LOCATOR.size))
        if end64_at + _END64.size > locator_at:
            raise RecordError("its zip64 end record is misplaced")
        fields = _END64.unpack(record.get(end64_at, _END64.size))
        if fields[0] != b"PK\x06\x06":
            raise RecordError("its zip64 end record is damaged")
        count64, cd_size64, cd_offset64 = fields[7], fields[8], fields[9]
        # Both end records must say the same, so that every reader sees one directory.
        for short, long in ((count, count64), (cd_size, cd_size64), (cd_offset, cd_offset64)):
            if short not in (long, _U16, _U32):
                raise RecordError("its two end records disagree")
        count, cd_size, cd_offset = count64, cd_size64, cd_offset64
        directory_end = end64_at
    if cd_offset + cd_size != directory_end:
        raise RecordError("its central directory is not where its end record says")
    return cd_offset, cd_size, count


def _zip64_sizes(extra: bytes, usize: int, csize: int, header: int) -> tuple[int, int, int]:
    """The sizes and header offset, from the zip64 extra field where the
    32-bit fields hold their sentinel."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x0001:
            values = extra[pos + 4 : pos + 4 + size]
            at = 0
            out = []
            for value in (usize, csize, header):
                if value == _U32:
                    if at + 8 > len(values):
                        raise RecordError("its zip64 sizes are truncated")
                    value = struct.unpack_from("<Q", values, at)[0]
                    at += 8
                out.append(value)
            return out[0], out[1], out[2]
        pos += 4 + size
    return usize, csize, header


def _local_start(record: RecordBytes, header: int, raw_name: bytes, short: str) -> int:
    """Where the entry's bytes start: after its local header, which must name
    it and store it as the directory says."""
    sig, _, flags, method, _, _, _, _, _, n, m = _LOCAL.unpack(record.get(header, _LOCAL.size))
    if sig != b"PK\x03\x04" or flags & 1 or method != 0:
        raise RecordError(f"the local header of entry {short!r} is damaged or disagrees with the directory")
    if bytes(record.get(header + _LOCAL.size, n)) != raw_name:
        raise RecordError(f"the local header of entry {short!r} names another entry")
    return int(header + _LOCAL.size + n + m)


def check_stored(item: memoryview) -> None:
    """Refuse an item that is not a well-formed record with stored entries
    (what torch.load reads it as, checked before torch.load inflates or
    allocates anything)."""
    record_entries(RecordBytes.whole(item))


# ---------------------------------------------------------------------------
# A tensor record's declaration, and the proof of a raw location
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Declared:
    """What a record's ``data.pkl`` declares for a plain tensor."""

    dtype: torch.dtype
    storage_key: str
    storage_nbytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    #: The view bits torch's tensor metadata sets (``"conj"``, ``"neg"``); empty for plain tensors.
    flags: frozenset[str]


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype | None  # None: an UntypedStorage (its numel is in bytes)
    key: str
    numel: int


def _typed_storages() -> dict[str, torch.dtype]:
    """``torch.FloatStorage`` and its kin (what data.pkl names a typed
    storage by) -> its dtype."""
    out = {}
    with ignoring(_TYPED_STORAGE_WARNING):
        for name in dir(torch):
            cls = getattr(torch, name)
            dtype = getattr(cls, "dtype", None) if name.endswith("Storage") and isinstance(cls, type) else None
            if isinstance(dtype, torch.dtype):
                out[f"torch.{name}"] = dtype
    return out


#: Asking a typed storage class for its dtype warns that the class is deprecated.
_TYPED_STORAGE_WARNING = "TypedStorage is deprecated"


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> tuple[Any, ...]:
    metadata = rest[2] if len(rest) > 2 else None
    return (storage, None, offset, size, stride, metadata)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> tuple[Any, ...]:
    return (storage, dtype, offset, size, stride, rest[0] if rest else None)


class _DeclarationUnpickler(pickle.Unpickler):
    """Reads a tensor record's data.pkl without building anything: the
    rebuild functions are replaced by recorders, storages by their ids."""

    def find_class(self, module: str, name: str) -> Any:
        key = f"{module}.{name}"
        allowed = _declaration_globals()
        if key in allowed:
            return allowed[key]
        raise RecordError(f"its data.pkl names {key}, not a plain tensor")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise RecordError("its data.pkl names a storage torch.save does not write")
        _, kind, key, _, numel = pid
        if not (isinstance(key, str) and type(numel) is int and numel >= 0):
            raise RecordError("its data.pkl names a malformed storage")
        return _Storage(kind if isinstance(kind, torch.dtype) else None, key, numel)


@functools.cache
def _declaration_globals() -> dict[str, Any]:
    allowed: dict[str, Any] = {
        "torch._utils._rebuild_tensor_v2": _rebuild_v2,
        "torch._utils._rebuild_tensor_v3": _rebuild_v3,
        "collections.OrderedDict": collections.OrderedDict,
        "torch.storage.UntypedStorage": "untyped",
    }
    allowed.update(_typed_storages())
    allowed.update((f"torch.{name}", v) for name, v in vars(torch).items() if isinstance(v, torch.dtype))
    return allowed


@functools.lru_cache(maxsize=1024)
def tensor_declaration(pickled: bytes) -> Declared:
    """The plain tensor a record's ``data.pkl`` declares (cached: records of
    one shape and dtype share their pickle)."""
    try:
        result = _DeclarationUnpickler(io.BytesIO(pickled)).load()
    except RecordError:
        raise
    except Exception as e:  # any malformed pickle
        raise RecordError(f"its data.pkl is not a tensor's ({type(e).__name__})") from e
    if not (isinstance(result, tuple) and len(result) == 6 and isinstance(result[0], _Storage)):
        raise RecordError("its data.pkl does not hold one tensor")
    storage, dtype, offset, size, stride, metadata = result
    dtype = storage.dtype if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise RecordError("its data.pkl declares no dtype")
    ints = (offset, *size, *stride) if isinstance(size, tuple) and isinstance(stride, tuple) else None
    if ints is None or not all(type(v) is int and v >= 0 for v in ints) or len(size) != len(stride):
        raise RecordError("its data.pkl declares a malformed shape")
    nbytes = storage.numel if storage.dtype is None else storage.numel * dtype.itemsize
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(k, str) for k in metadata)):
        raise RecordError("its data.pkl declares malformed tensor metadata")
    flags = frozenset(k for k, v in (metadata or {}).items() if v)
    return Declared(dtype, storage.key, nbytes, offset, tuple(size), tuple(stride), flags)


def _row_major(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``size`` and ``stride`` lies row-major and dense
    (as torch's ``is_contiguous``: a dimension of one element may have any
    stride; an empty tensor is)."""
    if 0 in size:
        return True
    expected = 1
    for dim, step in zip(reversed(size), reversed(stride)):
        if dim != 1 and step != expected:
            return False
        expected *= dim
    return True


#: The entries a raw location's proof reads.
_PROOF_HEADERS = frozenset({"data/0", "data.pkl", "byteorder"})


def check_raw_location(record: RecordBytes, location: Sequence[int], dtype: torch.dtype, shape: Sequence[int]) -> None:
    """Prove that the record's tensor bytes are exactly ``location``
    (``[offset in the item, nbytes]``) and hold a ``dtype`` tensor of
    ``shape``, row-major, as they lie (see the module docstring)."""
    entries = record_entries(record, _PROOF_HEADERS)
    data = entries.get("data/0")
    if data is None or (data.start, data.size) != (location[0], location[1]):
        found = "no entry data/0" if data is None else f"data/0 is {data.size} bytes at {data.start}"
        raise RecordError(f"its tensor bytes are not at {list(location)}: {found}")
    storages = [name for name in entries if name.startswith("data/")]
    if storages != ["data/0"]:
        raise RecordError(f"it holds {len(storages)} storages, not one")
    order = entries.get("byteorder")
    if order is not None and bytes(record.get(order.start, order.size)) != sys.byteorder.encode():
        raise RecordError(f"its bytes are {bytes(record.get(order.start, order.size))!r}-endian")
    pickled = entries.get("data.pkl")
    if pickled is None or pickled.size > _TENSOR_PICKLE_LIMIT:
        raise RecordError("it has no data.pkl of a tensor")
    declared = tensor_declaration(bytes(record.get(pickled.start, pickled.size)))
    want = (dtype, "0", data.size, 0, tuple(shape), True, frozenset[str]())
    got = (
        declared.dtype,
        declared.storage_key,
        declared.storage_nbytes,
        declared.storage_offset,
        declared.size,
        _row_major(declared.size, declared.stride),
        declared.flags,
    )
    if got != want:
        raise RecordError(
            f"it holds {str(declared.dtype).removeprefix('torch.')} {list(declared.size)} "
            f"(stride {list(declared.stride)}, storage offset {declared.storage_offset}, storage "
            f"{declared.storage_nbytes} bytes{', with view flags' if declared.flags else ''}), not "
            f"{str(dtype).removeprefix('torch.')} {list(shape)} in {data.size} bytes as declared"
        )
