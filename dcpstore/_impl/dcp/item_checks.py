"""What every stored item must be before a load trusts it: one function per
check, run by the reader (:mod:`.reader`) and by ``dcpstore verify``
alike, so that verify says OK exactly when a load would get past them.

:class:`ItemChecks` holds what ``.metadata`` declares of each chunk (dtype
and shape) and the stream transforms a load may undo:

* :meth:`~ItemChecks.raw_location` -- whether a load may read an item's
  tensor bytes straight into its destination, and where the manifest says
  they lie; :meth:`~ItemChecks.check_raw` -- the proof of that location
  from the record's own header and trailer (the bytes a direct read lands
  in scratch), before the destination counts as loaded;
* :meth:`~ItemChecks.before_read` -- what a non-tensor item must look like
  before it is read whole: the end of a torch.save record (stored as is),
  or its start once decoded (under stream transforms);
* :meth:`~ItemChecks.tensor` -- the tensor an item holds: decoded (bounded
  by its declared size), its record well formed with every entry stored
  (nothing inflates), loaded as ``torch.load(weights_only=True)`` does, of
  the dtype and chunk shape ``.metadata`` declares;
* :meth:`~ItemChecks.object_bytes` -- a non-tensor item's record: decoded,
  well formed, and unpickled through the allowlist (unless trusted) before
  anyone else unpickles it.

Errors are :class:`~dcpstore._impl.util.errors.CheckpointCorrupt` (or
:class:`~dcpstore._impl.util.errors.UnsafeCheckpoint`) naming the file and the item.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcpstore._impl.format.layout import item_key
from dcpstore._impl.format.record import BYTES_ITEM_LIMIT, RECORD_OVERHEAD, decode_item, item_tensor
from dcpstore._impl.format.record_zip import RecordBytes, RecordError, check_raw_location, check_stored
from dcpstore._impl.format.safe_pickle import RECORD_PEEK_MIN, TOOLS, Trust, check_record_end, load_object
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import CheckpointCorrupt
from dcpstore._impl.util.torch_compat import StorageInfo, StorageReaderTransforms

#: Tensors smaller than this are read with their record into scratch and
#: copied out (measured on 20,000 x 3 KiB tensors); larger ones land in the
#: destination, their record's header and trailer in scratch.
SMALL_TENSOR_COPY = 64 * 1024
#: A torch.save record starts with a zip local header.
_RECORD_START = b"PK\x03\x04"


def item_label(index: MetadataIndex) -> str:
    """An item as messages name it: ``'w'``, or ``'w' chunk at [0, 4]``."""
    return repr(index.fqn) if index.offset is None else f"{index.fqn!r} chunk at {list(index.offset)}"


#: A quantized tensor's stored bytes need its quantizer to be values.
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def is_raw_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor's stored bytes are its values as they lie."""
    return dtype not in _QUANTIZED


class ItemChecks:
    """The checks of one checkpoint's items (see the module docstring):
    ``storage`` is the checkpoint's (it names files in errors and serves the
    peeks before a read); ``transforms`` undo DCP's stream transforms (the
    default registry if None); ``trust``: what the load lets an unpickle
    build (trusted loads skip the allowlist and the peeks)."""

    def __init__(
        self,
        metadata: Metadata,
        storage: Storage,
        transforms: StorageReaderTransforms | None = None,
        trust: Trust = TOOLS,
    ) -> None:
        self.storage = storage
        self.transforms = transforms if transforms is not None else StorageReaderTransforms()
        self.trust = trust
        #: (fqn, chunk offsets) -> (dtype, chunk sizes), for every chunk .metadata declares.
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (md.properties.dtype, tuple(chunk.sizes))

    def declared(self, index: MetadataIndex) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and shape ``.metadata`` declares for a tensor item (None: a non-tensor item)."""
        if index.offset is None:
            return None
        return self._chunks.get((index.fqn, tuple(index.offset)))

    def _where(self, path: str, info: StorageInfo, index: MetadataIndex) -> str:
        return f"{self.storage.describe(path)}: item {item_label(index)} (offset {info.offset})"

    # -- tensors read straight into their destination ------------------------
    def raw_location(
        self, path: str, info: StorageInfo, index: MetadataIndex, tensors: Mapping[str, Sequence[int]]
    ) -> tuple[int, int] | None:
        """Where the item's raw tensor bytes lie in it (``tensors``: the
        manifest's), if a load may read them straight into a destination: a
        tensor item stored as it is, whose location is as long as its
        declared chunk; None: read through its record."""
        loc = tensors.get(item_key(path, info.offset))
        declared = self.declared(index)
        if loc is None or declared is None or info.transform_descriptors or not is_raw_dtype(declared[0]):
            return None
        numel = 1
        for dim in declared[1]:
            numel *= dim
        return (loc[0], loc[1]) if numel * declared[0].itemsize == loc[1] else None

    @staticmethod
    def record_around_raw(length: int, loc: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(start, end)`` ranges of an item a direct read of ``loc``
        puts in scratch (all of it for a small tensor): what
        :meth:`check_raw` proves the location from."""
        if loc[1] < SMALL_TENSOR_COPY:
            return [(0, length)]
        return [(0, loc[0]), (loc[0] + loc[1], length)]

    def check_raw(
        self, path: str, info: StorageInfo, index: MetadataIndex, loc: Sequence[int], record: RecordBytes, manifest: str
    ) -> None:
        """Prove ``loc`` from the record's bytes around it (``record``: its
        header and trailer, or all of it); ``manifest`` names the manifest
        that claimed it."""
        declared = self.declared(index)
        assert declared is not None  # raw_location chose this item
        try:
            check_raw_location(record, loc, *declared)
        except RecordError as e:
            raise CheckpointCorrupt(
                f"{manifest}: damaged integrity manifest: tensor location {list(loc)} of item {item_label(index)} "
                f"({path} at offset {info.offset}) does not match its record: {e}"
            ) from e

    # -- items read whole ------------------------------------------------------
    def before_read(self, path: str, info: StorageInfo, index: MetadataIndex) -> None:
        """Before a large non-tensor item is read whole (one small read): it
        must end as a torch.save record does or, under stream transforms,
        start as one once decoded; a declared size over a hole of a sparse
        file is refused cheaply. Trusted loads skip it (they never unpickle
        through the allowlist either)."""
        if self.declared(index) is not None or self.trust.trusted or info.length <= RECORD_PEEK_MIN:
            return
        if not info.transform_descriptors:
            check_record_end(self.storage, path, info.offset, info.length, item_label(index))
            return
        head = _StoredBytes(self.storage, path, info.offset, info.length)
        try:
            stream = self.transforms.transform_load_stream(
                _read_item(index), info.transform_descriptors, cast(IO[bytes], head)
            )
            start = stream.read(len(_RECORD_START))
        except Exception as e:  # an unknown transform, damaged or hostile encoded bytes
            raise self._undecodable(path, info, index, e) from e
        if start != _RECORD_START:
            raise CheckpointCorrupt(
                f"{self._where(path, info, index)} ({info.length} bytes) does not decode to a torch.save "
                f"record with its stream transforms {list(info.transform_descriptors)}; not read"
            )

    def decode(self, path: str, info: StorageInfo, index: MetadataIndex, stored: memoryview) -> memoryview:
        """The item's bytes with its stream transforms undone (as they are
        when it names none): at most its declared tensor's bytes plus a
        record's headers, or :data:`BYTES_ITEM_LIMIT` for a non-tensor item."""
        if not info.transform_descriptors:
            return stored
        declared = self.declared(index)
        limit = BYTES_ITEM_LIMIT
        if declared is not None:
            numel = 1
            for dim in declared[1]:
                numel *= dim
            limit = numel * declared[0].itemsize + RECORD_OVERHEAD
        try:
            return decode_item(stored, info.transform_descriptors, _read_item(index), self.transforms, limit)
        except Exception as e:  # an unknown transform, damaged or hostile encoded bytes
            raise self._undecodable(path, info, index, e) from e

    def _undecodable(self, path: str, info: StorageInfo, index: MetadataIndex, e: Exception) -> CheckpointCorrupt:
        return CheckpointCorrupt(
            f"{self.storage.describe(path)}: item {index.fqn} at offset {info.offset} cannot be decoded with its "
            f"stream transforms {list(info.transform_descriptors or ())}: {type(e).__name__}: {e}"
        )

    def tensor(self, path: str, info: StorageInfo, index: MetadataIndex, stored: memoryview) -> torch.Tensor:
        """The tensor the item holds (a view on its bytes where it can be;
        see the module docstring)."""
        item = self.decode(path, info, index, stored)
        where = self._where(path, info, index)
        try:
            check_stored(item)
            tensor = item_tensor(item)
        except Exception as e:  # torch.load's errors have no common base: any is damage
            raise CheckpointCorrupt(
                f"{where} is not a readable tensor record ({type(e).__name__}: {str(e)[:200]})"
            ) from e
        declared = self.declared(index)
        got = (tensor.dtype, tuple(tensor.shape))
        if declared is not None and got != declared:
            raise CheckpointCorrupt(
                f"{where} holds {got[0]} {list(got[1])}; .metadata declares {declared[0]} {list(declared[1])}"
            )
        return tensor

    def object_bytes(self, path: str, info: StorageInfo, index: MetadataIndex, stored: memoryview) -> memoryview:
        """The non-tensor item's record, decoded and checked: unpickled
        through the allowlist (a class off it raises UnsafeCheckpoint) unless
        the load is trusted; the caller hands these bytes on."""
        item = self.decode(path, info, index, stored)
        subject = f"checkpoint item {index.fqn!r}"
        try:
            check_stored(item)
        except RecordError as e:
            raise CheckpointCorrupt(f"{subject} is not a readable torch.save record ({e})") from e
        if not self.trust.trusted:
            load_object(item, subject, self.trust)
        return item


def _read_item(index: MetadataIndex) -> ReadItem:
    """A read request for the whole item (what DCP's transforms are handed;
    they do not look at it)."""
    offsets = torch.Size(index.offset or ())
    kind = LoadItemType.BYTE_IO if index.offset is None else LoadItemType.TENSOR
    return ReadItem(kind, index, offsets, index, torch.Size([0] * len(offsets)), torch.Size())


class _StoredBytes(io.RawIOBase):
    """An item's stored bytes, read from storage as a decoder asks for them
    (so a decoder that stops early reads little)."""

    CHUNK = 1 << 20

    def __init__(self, storage: Storage, path: str, offset: int, length: int) -> None:
        super().__init__()
        self._storage, self._path, self._offset, self._length = storage, path, offset, length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), self._length - self._pos, self.CHUNK)
        if n <= 0:
            return 0
        data = self._storage.read_range(self._path, self._offset + self._pos, n)
        out[: len(data)] = data
        self._pos += len(data)
        return len(data)
