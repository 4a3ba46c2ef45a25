"""A rank's data files: how its items are bucketed, named and written.

Every writer of dcpstore's (DCP's own save through
:class:`~dcpstore._impl.dcp.writer.DcpStorageWriter`, the NVRx engine, Megatron's
async worker) splits a rank's items into buckets, one data file each, names
each file after the rank's DCP prefix (:func:`rank_prefix`, in the rank's
spread directory) and the save's session, and writes it here
(:func:`write_data_file`) or through its own per-bucket writer.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcpstore._impl.dcp.commit.session import ItemRecord
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate
from dcpstore._impl.format.layout import spread_file_prefix
from dcpstore._impl.format.record import RecordStream, compact_cpu_tensor, encode_item
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import SaveError
from dcpstore._impl.util.progress import Progress
from dcpstore._impl.util.torch_compat import StorageWriterTransforms
from dcpstore._impl.values.results import SaveStats

#: About what a tensor record adds to its bytes (zip headers, pickle,
#: alignment; ~1.3 KiB measured), rounded up.
RECORD_HEADERS_ESTIMATE = 4096


def item_nbytes(item: WriteItem) -> int:
    """The bytes of a tensor item's data (0 for a bytes item)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for dim in item.tensor_data.size:
        numel *= dim
    return numel * item.tensor_data.properties.dtype.itemsize


def file_size_hint(items: Sequence[WriteItem]) -> int:
    """The expected size of a data file holding ``items``: the tensor bytes
    and an upper estimate of each record's headers."""
    return sum(item_nbytes(it) + RECORD_HEADERS_ESTIMATE for it in items)


def split_buckets(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Size-balanced buckets: tensors largest first into the lightest bucket,
    byte blobs round-robin. Empty buckets are dropped."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    blobs = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensors = sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=item_nbytes, reverse=True)
    for i, item in enumerate(blobs):
        buckets[i % bins].append(item)
    for item in tensors:
        idx = min(range(bins), key=sizes.__getitem__)
        buckets[idx].append(item)
        sizes[idx] += item_nbytes(item)
    return [b for b in buckets if b]


def rank_prefix(rank: int, spread: int) -> str:
    """The DCP file prefix of ``rank``'s data files (``__{rank}_``, as stock
    DCP), in its spread directory when the storage spreads them."""
    return spread_file_prefix(f"__{rank}_", rank, spread)


def resolve_item(planner: SavePlanner, item: WriteItem, lock: threading.Lock) -> io.BytesIO | torch.Tensor:
    """The bytes or compact CPU tensor to write for ``item`` (``lock``: one
    per save, as planners are not promised to be thread-safe); errors name
    the key."""
    try:
        with lock:
            data = planner.resolve_data(item)
        return data if isinstance(data, io.BytesIO) else compact_cpu_tensor(data)
    except Exception as e:
        raise SaveError(f"cannot serialise {item.index.fqn!r}: {type(e).__name__}: {e}") from e


def write_stats(stats: SaveStats, results: Sequence[WriteResult], started: float) -> None:
    """Fill in ``stats``' write phase from this rank's write results."""
    stats.write_s = time.perf_counter() - started
    # Once per file (a safetensors shard's first item follows its header, not offset 0).
    stats.bytes_written = sum({r.storage_data.relative_path: r.storage_data.file_size for r in results}.values())
    stats.files = sorted({r.storage_data.relative_path for r in results})


def write_data_file(
    storage: Storage,
    name: str,
    items: Sequence[WriteItem],
    data_of: Callable[[WriteItem], io.BytesIO | torch.Tensor],
    transforms: StorageWriterTransforms | None,
    progress: Progress,
    gate: OwnerGate,
    batch_hint: int | None = None,
) -> list[WriteResult]:
    """Write one data file ``name`` holding ``items`` (``data_of(item)``: its
    bytes or CPU tensor, asked for one item at a time), published once
    ``gate`` passes; returns the items' write results, each carrying its
    :class:`ItemRecord`. ``batch_hint``: the bytes of all the files this
    rank writes now, over which object stores share their connection budget
    (:meth:`~dcpstore.storage.StorageOptions.upload_part_size`). Every data
    file dcpstore's own record writer makes is written here."""
    written = []
    with storage.open_write(name, size_hint=file_size_hint(items), batch_hint=batch_hint) as writer:
        stream = RecordStream(writer)
        for item in items:
            data = data_of(item)
            descriptors: tuple[str, ...] = ()
            if transforms is not None:
                data, descriptors = encode_item(data, item, transforms)
            written.append((item, stream.write_item(data), descriptors))
            progress.update(item_nbytes(item))
        file_size, file_crc = stream.finish()
        writer.seal()  # the last part leaves now, not after the gate's round trip
        # Leaving the block publishes the file; a save that lost its
        # URI to a later save must not clobber that save's files.
        gate.wait()
    return [
        WriteResult(
            index=item.index,
            size_in_bytes=w.length,
            storage_data=ItemRecord(name, w.offset, w.length, w.crc32c, file_size, file_crc, w.raw, descriptors),
        )
        for item, w, descriptors in written
    ]
