"""DCP ``StorageWriter`` / ``StorageReader`` written once over :class:`Storage`.

Nothing here knows which backend it talks to: local files, S3, MSC and fsspec
all arrive through the same few byte-level calls (see
:mod:`dcpstore.storage.base`).

Save, as ``torch.distributed.checkpoint.save`` drives it::

    (all ranks)   set_up_storage_writer -> prepare_local_plan
    (coordinator) prepare_global_plan   assigns each rank its ``__{rank}_`` prefix
                                        and retracts an older commit at this URI
    (all ranks)   write_data            ``workers`` threads, one data file each,
                                        size-balanced buckets, largest first;
                                        every file committed (durable) on return
    (coordinator) finish                runs only if *every* rank's write_data
                                        succeeded (DCP gathers the results):
                                        manifest, then ``.metadata`` last

Load: ``read_metadata`` (verifying ``.metadata`` against the manifest), then
``read_data`` checks every planned file's size against the manifest, and
reads the planned items with ``workers`` threads, coalescing neighbouring
items of a file into one ranged read. Each item's CRC32C is verified before
it is copied into the caller's state, except for tensors of 64 KiB or more,
which are read straight into their destination and verified there; a failed
load says which keys it changed (see :mod:`.load_progress`).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import operator
import os
import pickle
import sys
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, cast

import crc32c
import numpy as np
import torch
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ..errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    InvalidArgument,
    SaveError,
    StateDictMismatch,
    StorageNotFound,
)
from ..adapters.torch_save import save_record
from ..storage.base import MiB, ObjectWriter, Storage
from .layout import (
    INFLIGHT,
    MANIFEST,
    METADATA,
    FileEntry,
    Manifest,
    build_manifest,
    data_file_name,
    is_data_file,
    item_key,
    parse_manifest,
)
from .bitcopy import copy_values
from .checksum import DualCrc
from .load_progress import LoadProgress
from .state_checks import load_mismatches
from .threads import run_parallel

log = logging.getLogger(__name__)

#: Neighbouring items of one file are read together up to this many bytes.
COALESCE_LIMIT = 64 * MiB
#: Read-back piece size when checksumming a file another writer produced.
CHECKSUM_CHUNK = 16 * MiB


def check_workers(workers: int | None, default: int) -> int:
    """Validate a ``workers`` argument (``None`` means ``default``)."""
    if workers is None:
        return default
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgument(f"workers must be a positive int, got {workers!r}")
    return workers


def default_workers() -> int:
    return max(2, min(8, os.cpu_count() or 1))


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemRecord:
    """``WriteResult.storage_data`` for one item: where it lives and its CRC.

    Carries its file's size and CRC too, so that the coordinator's
    ``finish`` can build the manifest from the gathered results alone.
    """

    relative_path: str
    offset: int
    length: int
    crc32c: int
    file_size: int
    file_crc32c: int
    #: ``(offset in the item, nbytes)`` of the tensor's bytes when the
    #: record holds them row-major and contiguous, so that a load can read
    #: them straight into the destination tensor (see ``_read_run``).
    raw: tuple[int, int] | None = None


@dataclass
class SaveToken(_StoragePrefix):
    """The coordinator's per-rank plan data: the file prefix (``__{rank}_``,
    as stock DCP) and the save id every rank checks before publishing."""

    save_id: str = ""


@dataclass
class SaveStats:
    """Phase timings and volume of one save on this rank (seconds, bytes)."""

    plan_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    _t0: float = 0.0


class _ChecksummingStream:
    """File-like adapter between torch.save and an :class:`ObjectWriter`.

    Keeps the item and file CRC32Cs (:class:`DualCrc`: one pass over the
    bytes), and coalesces small writes: torch.save
    emits ~40 tiny writes (zip headers) per tensor, and 20,000 small tensors
    would otherwise cost ~800,000 storage calls. Large writes (tensor data)
    pass straight through without a copy.
    """

    SMALL = 64 << 10
    BUFFER = 1 << 20

    def __init__(self, writer: ObjectWriter) -> None:
        self._writer = writer
        self._buf = bytearray()
        self.crc = DualCrc()
        #: Set by :meth:`save_tensor`: the size of the one write that carries
        #: the tensor's bytes, and where that write landed (see ItemRecord.raw).
        self._raw_nbytes = 0
        self._raw_ptr = 0
        self.raw: tuple[int, int] | None = None
        #: The first storage error. torch.save's C++ writer swallows
        #: exceptions raised by ``write`` and reports its own RuntimeError
        #: ("unexpected pos ..."); we re-raise this one instead.
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        size = view.nbytes
        if size == self._raw_nbytes and self.raw is None and _address(view) == self._raw_ptr:
            self.raw = (self.tell(), size)
        self.crc.update(view)
        if size < self.SMALL:
            self._buf += data
            if len(self._buf) >= self.BUFFER:
                self.drain()
        else:
            self.drain()
            self._forward(data)
        return size

    def drain(self) -> None:
        """Hand buffered bytes to the writer (before commit, and when full)."""
        if self._buf:
            buf, self._buf = self._buf, bytearray()
            self._forward(buf)

    def _forward(self, data: Any) -> None:
        try:
            self._writer.write(data)
        except BaseException as e:
            self.error = self.error or e
            raise

    def save_tensor(self, tensor: torch.Tensor) -> None:
        # torch hands a CPU storage's bytes to ``write`` in one call, from the
        # storage's own memory: for a tensor that is its whole storage,
        # row-major, that call (same size, same address) is the raw tensor.
        self.raw = None
        self._raw_nbytes = tensor.nbytes if _is_raw(tensor) else 0
        self._raw_ptr = tensor.untyped_storage().data_ptr()
        try:
            save_record(tensor, cast(IO[bytes], self))
        except Exception:
            if self.error is not None:
                raise self.error  # keeps its own __cause__ (the OSError)
            raise
        finally:
            self._raw_nbytes = 0

    def tell(self) -> int:
        return self._writer.tell() + len(self._buf)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        """torch.save flushes after every tensor; batching across tensors is
        the point of the buffer, so this is deliberately a no-op."""


def _is_raw(tensor: torch.Tensor) -> bool:
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


def _address(view: memoryview) -> int:
    """Where a (non-empty) buffer's bytes start in memory."""
    if view.nbytes == 0:
        return -1
    address: int = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return address


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    numel = 1
    for dim in item.tensor_data.size:
        numel *= dim
    return numel * item.tensor_data.properties.dtype.itemsize


def split_buckets(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Size-balanced buckets: tensors largest first into the lightest bucket,
    byte blobs round-robin. Empty buckets are dropped."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    blobs = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensors = sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True)
    for i, item in enumerate(blobs):
        buckets[i % bins].append(item)
    for item in tensors:
        idx = min(range(bins), key=sizes.__getitem__)
        buckets[idx].append(item)
        sizes[idx] += _item_nbytes(item)
    return [b for b in buckets if b]


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor._is_zerotensor():
        # An efficient zero tensor has no storage to write: write real zeros.
        return torch.zeros(tensor.shape, dtype=tensor.dtype)
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        # A view of a larger storage: torch.save would write the whole
        # storage; save only the projection (what stock DCP does too).
        tensor = tensor.clone()
    return tensor


def _resolve(planner: SavePlanner, item: WriteItem, lock: threading.Lock) -> io.BytesIO | torch.Tensor:
    """The bytes or CPU tensor to write for ``item``; errors name the key."""
    try:
        with lock:
            data = planner.resolve_data(item)
        return data if isinstance(data, io.BytesIO) else _cpu_tensor(data)
    except Exception as e:
        raise SaveError(f"cannot serialise {item.index.fqn!r}: {type(e).__name__}: {e}") from e


class DcpStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` over any :class:`Storage`.

    ``workers`` threads write one data file each per rank. Use it directly
    with ``torch.distributed.checkpoint.save(sd, storage_writer=...)`` or
    through :func:`dcpstore.save`.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        workers: int | None = None,
        reopen: Callable[[str], Storage] | None = None,
    ) -> None:
        super().__init__()
        self.storage = storage
        self.workers = check_workers(workers, default_workers())
        self._reopen = reopen
        self.rank = 0
        self.is_coordinator = True
        self.stats = SaveStats()
        self.save_id = ""
        self._old_data: frozenset[str] | None = None  # what claim() found (coordinator)

    # -- DCP protocol -----------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.storage.url.uri:
            if self._reopen is None:
                raise InvalidArgument(
                    f"this writer is bound to {self.storage.uri}; cannot switch to another checkpoint_id"
                )
            self.storage = self._reopen(os.fspath(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP calls reset() only when given a checkpoint_id; this runs on
        # every save, so per-save state starts here.
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        self.stats = SaveStats(_t0=time.perf_counter())
        self.save_id = os.urandom(8).hex()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.storage.makedirs()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Retract any older commit at this URI *before* any rank overwrites
        # its data files: a crash mid-save must never leave an old .metadata
        # pointing at new, partial data.
        self._old_data = claim(self.storage, self.save_id)
        return [
            dataclasses.replace(plan, storage_data=SaveToken(f"__{i}_", self.save_id)) for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t_start = time.perf_counter()
        self.stats.plan_s = t_start - self.stats._t0
        token: SaveToken = plan.storage_data
        buckets = split_buckets(plan.items, self.workers)
        lock = threading.Lock()  # planners are not promised to be thread-safe
        future: Future[list[WriteResult]] = Future()
        named = [(data_file_name(token.prefix, i), bucket) for i, bucket in enumerate(buckets)]
        try:
            per_file = run_parallel(
                lambda nb: self._write_file(nb[0], nb[1], token.save_id, planner, lock),
                named,
                len(named),
                "dcpstore-write",
            )
        except BaseException as e:  # DCP gathers exceptions across ranks
            future.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the value
            return future
        results = [r for rs in per_file for r in rs]
        self.stats.write_s = time.perf_counter() - t_start
        self.stats.bytes_written = sum(r.storage_data.file_size for r in results if r.storage_data.offset == 0)
        self.stats.files = sorted({r.storage_data.relative_path for r in results})
        future.set_result(results)
        return future

    def _write_file(
        self, name: str, items: list[WriteItem], save_id: str, planner: SavePlanner, lock: threading.Lock
    ) -> list[WriteResult]:
        pending: list[tuple[WriteItem, int, int, int, tuple[int, int] | None]] = []
        size_hint = sum(_item_nbytes(it) for it in items)
        with self.storage.open_write(name, size_hint=size_hint) as writer:
            stream = _ChecksummingStream(writer)
            for item in items:
                data = _resolve(planner, item, lock)
                offset = stream.tell()
                stream.crc.item = 0
                raw = None
                if isinstance(data, io.BytesIO):
                    stream.write(data.getbuffer())
                else:
                    stream.save_tensor(data)
                    if stream.raw is not None:
                        raw = (stream.raw[0] - offset, stream.raw[1])
                pending.append((item, offset, stream.tell() - offset, stream.crc.item, raw))
            stream.drain()
            file_size, file_crc = writer.tell(), stream.crc.file
            # Leaving the block publishes the file; a save that lost its
            # URI to a later save must not clobber that save's files.
            self._check_still_ours(save_id)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=ItemRecord(name, offset, length, crc, file_size, file_crc, raw),
            )
            for item, offset, length, crc, raw in pending
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        t_start = time.perf_counter()
        commit_checkpoint(self.storage, metadata, results, self.storage_meta(), self.save_id, self._old_data)
        self.stats.commit_s = time.perf_counter() - t_start

    def _check_still_ours(self, save_id: str) -> None:
        check_still_ours(self.storage, save_id)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.uri, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.storage.url.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        from ..storage.uri import parse_uri

        try:
            parse_uri(checkpoint_id)
        except CheckpointError:
            return False
        return True


def commit_checkpoint(
    storage: Storage,
    metadata: Metadata,
    results: list[list[WriteResult]],
    storage_meta: StorageMeta | None,
    save_id: str,
    old_data: frozenset[str] | None = None,
) -> None:
    """The coordinator's commit, shared by every writer: check the URI is
    still this save's (``save_id`` in the in-flight marker), then the
    manifest, then ``.metadata`` last; then drop the marker and the data
    files an older checkpoint at this URI left behind (``old_data``, what
    :func:`claim` found; None: list them now).

    ``results`` are every rank's write results whose ``storage_data`` is an
    :class:`ItemRecord`. Call only after *every* rank's data files are
    durable (DCP and NVRx both gather the results first).
    """
    storage_data: dict[MetadataIndex, _StorageInfo] = {}
    files: dict[str, FileEntry] = {}
    items: dict[str, int] = {}
    tensors: dict[str, list[int]] = {}
    for rank_results in results:
        for wr in rank_results:
            rec: ItemRecord = wr.storage_data
            storage_data[wr.index] = _StorageInfo(rec.relative_path, rec.offset, rec.length)
            files[rec.relative_path] = {"size": rec.file_size, "crc32c": rec.file_crc32c}
            key = item_key(rec.relative_path, rec.offset)
            items[key] = rec.crc32c
            if rec.raw is not None:
                tensors[key] = list(rec.raw)
    metadata.storage_data = storage_data
    metadata.storage_meta = storage_meta
    blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    check_still_ours(storage, save_id)
    storage.put(MANIFEST, build_manifest(files, items, crc32c.crc32c(blob), tensors))
    storage.put(METADATA, blob)  # the commit point
    remove_stale_data(storage, files, old_data)


def claim(storage: Storage, save_id: str) -> frozenset[str]:
    """Start a save at ``storage`` (coordinator, before any rank writes):
    retract an older commit, so that a crash mid-save never leaves an old
    ``.metadata`` pointing at new, partial data, and mark the URI as this
    save's. Returns the data files already there, for the commit to delete
    those it did not rewrite: one listing per save, at its start (a file
    that appears later belongs to a save that replaced our marker, and then
    this save never commits)."""
    present = {o["path"] for o in storage.list()}
    old_commit = [p for p in (METADATA, MANIFEST) if p in present]
    if old_commit:
        storage.delete(old_commit)
    storage.put(INFLIGHT, save_id.encode())
    return frozenset(p for p in present if is_data_file(p))


def check_still_ours(storage: Storage, save_id: str) -> None:
    """Refuse to publish a file or commit once another save to this URI
    has started (it replaced our in-flight marker): the later save wins,
    this one fails clearly and never writes over the winner's files."""
    try:
        owner = storage.read(INFLIGHT).decode(errors="replace")
    except StorageNotFound:
        owner = "<none>"
    if owner != save_id:
        raise SaveError(
            f"another save to {storage.uri} started while this one was writing "
            f"(its save id {owner}, ours {save_id}); nothing was committed by this save"
        )


def checksum_written_file(storage: Storage, path: str, results: list[WriteResult]) -> list[WriteResult]:
    """Checksum a data file that another writer (NVRx) produced, by reading it
    back once in ``CHECKSUM_CHUNK`` pieces, and return ``results`` with
    :class:`ItemRecord` storage data for the manifest.

    ``results`` are that file's DCP write results (``_StorageInfo`` storage
    data: offset and length of each item).
    """
    spans = sorted(results, key=lambda wr: wr.storage_data.offset)
    size = storage.size(path)
    file_crc = 0
    item_crcs = [0] * len(spans)
    pos = first = 0  # spans before ``first`` end before ``pos``
    while pos < size:
        chunk = memoryview(storage.read_range(path, pos, min(CHECKSUM_CHUNK, size - pos)))
        if not chunk:
            break
        file_crc = crc32c.crc32c(chunk, file_crc)
        end = pos + len(chunk)
        while first < len(spans) and _span_end(spans[first]) <= pos:
            first += 1
        i = first
        while i < len(spans) and spans[i].storage_data.offset < end:
            lo, hi = max(pos, spans[i].storage_data.offset), min(end, _span_end(spans[i]))
            if lo < hi:
                item_crcs[i] = crc32c.crc32c(chunk[lo - pos : hi - pos], item_crcs[i])
            i += 1
        pos = end
    if pos != size:
        raise CheckpointCorrupt(f"{storage.describe(path)}: read back {pos} of {size} bytes right after writing it")
    return [
        WriteResult(
            index=wr.index,
            size_in_bytes=wr.size_in_bytes,
            storage_data=ItemRecord(path, wr.storage_data.offset, wr.storage_data.length, crc, size, file_crc),
        )
        for wr, crc in zip(spans, item_crcs)
    ]


def _span_end(wr: WriteResult) -> int:
    return int(wr.storage_data.offset + wr.storage_data.length)


def remove_stale_data(storage: Storage, live: dict[str, FileEntry], old_data: frozenset[str] | None = None) -> None:
    """After the commit: delete the in-flight marker and the data files an
    older checkpoint at this URI left behind, in one request."""
    try:
        if old_data is None:
            old_data = frozenset(o["path"] for o in storage.list() if is_data_file(o["path"]))
        storage.delete([INFLIGHT, *sorted(old_data - live.keys())])
    except CheckpointError as e:  # the commit already happened; cleanup is best effort
        log.warning("could not remove the in-flight marker or stale data files under %s: %s", storage.uri, e)


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def read_checkpoint_metadata(storage: Storage) -> tuple[Metadata, Manifest | None]:
    """Read and verify ``.metadata`` (and the manifest, if there is one)."""
    try:
        blob = storage.read(METADATA)
    except StorageNotFound as e:
        raise CheckpointNotFound(_why_missing(storage)) from e
    manifest = None
    try:
        manifest = parse_manifest(storage.read(MANIFEST), storage.describe(MANIFEST))
    except StorageNotFound:
        log.debug("%s has no integrity manifest (written by stock DCP?); loading unverified", storage.uri)
    if manifest is not None and crc32c.crc32c(blob) != manifest["metadata_crc32c"]:
        raise CheckpointCorrupt(f"{storage.describe(METADATA)}: checksum mismatch (damaged commit object)")
    try:
        metadata = pickle.loads(blob)
    except Exception as e:
        raise CheckpointCorrupt(f"{storage.describe(METADATA)}: cannot be unpickled ({e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointCorrupt(f"{storage.describe(METADATA)}: holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata, manifest


def _why_missing(storage: Storage) -> str:
    try:
        leftovers = [o["path"] for o in storage.list() if is_data_file(o["path"]) or o["path"] == MANIFEST]
    except StorageNotFound as e:  # e.g. the bucket itself does not exist: say so
        return f"no checkpoint at {storage.uri}: {e}"
    except CheckpointError as e:
        return f"no checkpoint at {storage.uri} (and listing it failed: {e})"
    if leftovers:
        return (
            f"no committed checkpoint at {storage.uri}: data files exist but no {METADATA} "
            f"(an interrupted save; 'dcpstore gc {storage.uri}' removes it)"
        )
    return f"no checkpoint at {storage.uri} (no {METADATA} found)"


@dataclass
class _Span:
    """One ranged read covering neighbouring items of one file."""

    path: str
    offset: int
    length: int
    reqs: list[tuple[ReadItem, _StorageInfo]]


@dataclass
class _Direct:
    """One tensor read straight into its destination."""

    path: str
    info: _StorageInfo
    req: ReadItem
    dtype: torch.dtype  # as stored
    data_offset: int  # of the tensor's bytes, within the item
    nbytes: int

    @property
    def length(self) -> int:
        return int(self.info.length)

    @property
    def start(self) -> int:
        """Where the tensor's bytes start in the file."""
        return int(self.info.offset + self.data_offset)

    @property
    def end(self) -> int:
        """Where the item (its record) ends in the file."""
        return int(self.info.offset + self.info.length)


@dataclass
class _DirectRun:
    """Direct reads of one file, in file order, for one worker: each worker
    then streams through its own stretch of a file, as a plain sequential
    reader would (measured faster from a cold cache than items dealt out
    across files)."""

    items: list[_Direct]

    @property
    def length(self) -> int:
        return sum(d.length for d in self.items)


#: Tensors smaller than this are read with their record into scratch and
#: copied out (measured on 20,000 x 3 KiB tensors).
SMALL_TENSOR_COPY = 64 * 1024

#: Neighbouring tensors further apart than this are read separately rather
#: than through a scratch buffer for the bytes between them.
SCATTER_GAP_LIMIT = 1 * MiB


def _scatter_groups(
    placed: list[tuple[_Direct, torch.Tensor, memoryview]],
) -> list[list[tuple[_Direct, torch.Tensor, memoryview]]]:
    """Split file-ordered direct reads where the gap between their items is large."""
    groups: list[list[tuple[_Direct, torch.Tensor, memoryview]]] = []
    end = -1
    for entry in placed:
        d = entry[0]
        if groups and 0 <= d.info.offset - end <= SCATTER_GAP_LIMIT:
            groups[-1].append(entry)
        else:
            groups.append([entry])
        end = d.end
    return groups


def _sequential_runs(direct: list[_Direct], workers: int) -> list[_DirectRun]:
    """Split each file's direct reads, in offset order, into runs of about
    equal bytes: one run per file, or more when workers outnumber files."""
    per_file: dict[str, list[_Direct]] = defaultdict(list)
    for d in direct:
        per_file[d.path].append(d)
    per_worker = -(-workers // max(1, len(per_file)))  # ceil
    runs: list[_DirectRun] = []
    for items in per_file.values():
        items.sort(key=lambda d: d.info.offset)
        share = -(-sum(d.length for d in items) // per_worker)
        run: list[_Direct] = []
        run_bytes = 0
        for d in items:
            run.append(d)
            run_bytes += d.length
            if run_bytes >= share:
                runs.append(_DirectRun(run))
                run, run_bytes = [], 0
        if run:
            runs.append(_DirectRun(run))
    return runs


def _whole_tensor_dtype(req: ReadItem, metadata: Metadata, nbytes: int) -> torch.dtype | None:
    """The stored dtype, if ``req`` asks for the whole stored tensor of
    ``nbytes`` bytes (else None)."""
    if req.type != LoadItemType.TENSOR or any(req.storage_offsets):
        return None
    md = metadata.state_dict_metadata.get(req.storage_index.fqn)
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    numel = 1
    for n in req.lengths:
        numel *= n
    # A sub-box that starts at 0 and is as large as the stored chunk is all of it.
    return dtype if numel * dtype.itemsize == nbytes else None


def _byte_view(target: torch.Tensor, dtype: torch.dtype, nbytes: int) -> memoryview | None:
    """``target``'s bytes as a writable memoryview, if it can take the raw
    bytes as they lie (contiguous, on the CPU, same dtype and size, and no
    conjugate or negative bit: such a view's bytes are not its values; not
    quantized: its values need its quantizer, which copy_ applies)."""
    ok = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous() and target.nbytes == nbytes
    ok = ok and not target.is_conj() and not target.is_neg() and not target.is_quantized
    if not ok or nbytes == 0:
        return None
    # as_strided, not reshape(-1): a contiguous one-element view (x[:1, 2])
    # may carry any stride, which view(uint8) refuses.
    array: Any = target.as_strided((target.numel(),), (1,)).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _coalesce(path: str, reqs: list[tuple[ReadItem, _StorageInfo]]) -> list[_Span]:
    reqs.sort(key=lambda r: r[1].offset)
    spans: list[_Span] = []
    for req, info in reqs:
        last = spans[-1] if spans else None
        end = info.offset + info.length
        if last and info.offset <= last.offset + last.length and end - last.offset <= COALESCE_LIMIT:
            last.length = max(last.length, end - last.offset)
            last.reqs.append((req, info))
        else:
            spans.append(_Span(path, info.offset, info.length, [(req, info)]))
    return spans


class DcpStorageReader(StorageReader):
    """A DCP ``StorageReader`` over any :class:`Storage`; verifies as it reads."""

    def __init__(
        self,
        storage: Storage,
        *,
        workers: int | None = None,
        reopen: Callable[[str], Storage] | None = None,
        verify: bool = True,
    ) -> None:
        super().__init__()
        self.storage = storage
        self.workers = check_workers(workers, default_workers())
        self.verify = verify
        self._reopen = reopen
        self._manifest: Manifest | None = None
        self._metadata: Metadata | None = None
        self._storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self._mismatches: list[str] = []
        self._progress = LoadProgress(())
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.storage.url.uri:
            if self._reopen is None:
                raise InvalidArgument(f"this reader is bound to {self.storage.uri}")
            self.storage = self._reopen(os.fspath(checkpoint_id))
            self._metadata = None

    def preload_metadata(self) -> Metadata:
        """Read and verify the commit now (every rank), so that a missing or
        damaged checkpoint fails fast with a clear error, outside DCP."""
        if self._metadata is None:
            self._metadata, self._manifest = read_checkpoint_metadata(self.storage)
        return self._metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self.preload_metadata()
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointCorrupt(f"{self.storage.describe(METADATA)}: no storage_data")
        self._storage_data = metadata.storage_data
        self.bytes_read = 0

    def check_destination(self, state_dict: dict[str, Any]) -> None:
        """Compare the caller's ``state_dict`` with the checkpoint before
        ``dcp.load`` (see :func:`~dcpstore.writers.state_checks.load_mismatches`).
        What it finds is raised from :meth:`prepare_local_plan`, inside DCP's
        planning step, which gathers every rank's failure: all ranks then
        raise together and none is left waiting in a collective."""
        self._mismatches = load_mismatches(state_dict, self.preload_metadata())

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._mismatches:
            raise StateDictMismatch(
                f"cannot load {self.storage.uri} into this state_dict; nothing was loaded: " + "; ".join(self._mismatches)
            )
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]] = defaultdict(list)
        for req in plan.items:
            info = self._storage_data[req.storage_index]
            if info.transform_descriptors:
                raise CheckpointError(
                    f"{self.storage.describe(info.relative_path)} uses DCP stream extensions "
                    f"{list(info.transform_descriptors)}, which dcpstore does not read"
                )
            per_file[info.relative_path].append((req, info))
        if self.verify and self._manifest is not None:
            self._check_sizes(per_file)
        direct = _sequential_runs(self._split_direct(per_file), self.workers)
        spans = [span for path, reqs in per_file.items() for span in _coalesce(path, reqs)]
        jobs: list[_Span | _DirectRun] = [*spans, *direct]
        jobs.sort(key=operator.attrgetter("length"), reverse=True)
        lock = threading.Lock()
        future: Future[None] = Future()
        self._progress = LoadProgress(req.dest_index.fqn for req in plan.items)
        try:
            run_parallel(lambda job: self._read_job(job, planner, lock), jobs, self.workers, "dcpstore-read")
        except BaseException as e:
            error = self._progress.annotate(e, self.storage.uri)  # what this rank's state now holds
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the value
            return future
        future.set_result(None)
        return future

    def _check_sizes(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]) -> None:
        assert self._manifest is not None
        for path in per_file:
            entry = self._manifest["files"].get(path)
            if entry is None:
                raise CheckpointCorrupt(f"{self.storage.describe(path)}: not listed in the integrity manifest")
            try:
                actual = self.storage.size(path)
            except StorageNotFound as e:
                raise CheckpointCorrupt(f"{self.storage.describe(path)}: data file is missing") from e
            if actual != entry["size"]:
                raise CheckpointCorrupt(
                    f"{self.storage.describe(path)}: size {actual} bytes, expected {entry['size']} (truncated or damaged)"
                )

    def _split_direct(self, per_file: dict[str, list[tuple[ReadItem, _StorageInfo]]]) -> list[_Direct]:
        """Take out of ``per_file`` the requests that read a whole tensor whose
        raw bytes the manifest locates: those are read straight into their
        destination (see :meth:`_read_run`)."""
        raw = self._manifest["tensors"] if self._manifest is not None else {}
        if not raw:
            return []
        assert self._metadata is not None
        direct: list[_Direct] = []
        for path, reqs in per_file.items():
            keep = []
            for req, info in reqs:
                entry = raw.get(item_key(path, info.offset))
                if entry is not None and not 0 <= entry[0] <= entry[0] + entry[1] <= info.length:
                    raise CheckpointCorrupt(
                        f"{self.storage.describe(MANIFEST)}: tensor location {entry} lies outside its item "
                        f"({path} at offset {info.offset}, {info.length} bytes)"
                    )
                dtype = _whole_tensor_dtype(req, self._metadata, entry[1]) if entry is not None else None
                if entry is not None and dtype is not None:
                    direct.append(_Direct(path, info, req, dtype, entry[0], entry[1]))
                else:
                    keep.append((req, info))
            reqs[:] = keep
        return direct

    def _read_job(self, job: _Span | _DirectRun, planner: LoadPlanner, lock: threading.Lock) -> None:
        try:
            self._progress.check()
            if isinstance(job, _DirectRun):
                self._read_run(job, planner, lock)
            else:
                self._read_span(job, planner, lock)
        except BaseException as e:
            self._progress.fail(e)  # the other jobs start no new item
            raise

    def _read_run(self, run: _DirectRun, planner: LoadPlanner, lock: threading.Lock) -> None:
        """Read tensors' bytes straight into their destinations, verify each
        item's CRC32C, and commit them.

        A destination must be a contiguous CPU tensor of the stored dtype and
        size (a plain state dict's tensors are); any other goes through its
        record as :meth:`_read_span` does. Neighbouring tensors are read with
        one scatter read (:meth:`Storage.read_into`), the record bytes between
        them landing in scratch buffers.
        """
        with lock:
            targets = [planner.resolve_tensor(d.req).detach() for d in run.items]
        placed: list[tuple[_Direct, torch.Tensor, memoryview]] = []
        for d, target in zip(run.items, targets):
            dest = _byte_view(target, d.dtype, d.nbytes)
            if dest is None:
                span = _Span(d.path, d.info.offset, d.info.length, [(d.req, d.info)])
                self._read_span(span, planner, lock, target)
            else:
                placed.append((d, target, dest))
        for group in _scatter_groups(placed):
            self._progress.check()
            verified, error = self._scatter_read(group)
            with lock:
                for (d, target, _), exposed in verified:
                    self.bytes_read += d.length
                    planner.commit_tensor(d.req, target)
                    self._progress.loaded([d.req.dest_index.fqn], exposed=exposed)
            if error is not None:
                raise error

    def _scatter_read(
        self, group: list[tuple[_Direct, torch.Tensor, memoryview]]
    ) -> tuple[list[tuple[tuple[_Direct, torch.Tensor, memoryview], bool]], CheckpointCorrupt | None]:
        """One scatter read of every byte of the group's items: each record's
        header and trailer into scratch buffers, its tensor bytes into the
        destination; then each item's CRC32C over all three, as recorded.

        Returns the verified entries (with whether their bytes went straight
        into the destination), and the first checksum failure, if any. A
        failed or short read raises: the destinations read into directly
        then hold unverified bytes (recorded in ``self._progress``)."""
        path = group[0][0].path
        start = pos = group[0][0].info.offset
        buffers: list[memoryview] = []
        parts: list[tuple[_Direct, list[memoryview], memoryview]] = []
        for d, _, dest in group:
            if d.info.offset > pos:
                buffers.append(memoryview(bytearray(d.info.offset - pos)))  # another item, not ours
            if d.nbytes < SMALL_TENSOR_COPY:
                # Small: the whole record in one scratch buffer, then a copy
                # (3 buffers and 3 CRC calls per tiny tensor cost more).
                pieces = [memoryview(bytearray(d.length))]
            else:
                pieces = [memoryview(bytearray(d.data_offset)), dest, memoryview(bytearray(d.end - d.start - d.nbytes))]
            buffers += pieces
            parts.append((d, pieces, dest))
            pos = d.end
        exposed = [d.req.dest_index.fqn for d, pieces, _ in parts if len(pieces) > 1]
        self._progress.exposing(exposed)
        try:
            n = self.storage.read_into(path, start, buffers)
        except StorageNotFound as e:
            self._progress.exposing(exposed, undo=True)  # never opened: nothing was written
            raise CheckpointCorrupt(f"{self.storage.describe(path)}: data file is missing") from e
        if n != pos - start:
            raise CheckpointCorrupt(
                f"{self.storage.describe(path)}: short read at offset {start} ({n} of {pos - start} bytes; truncated?)"
            )
        verified = []
        error = None
        for entry, (d, pieces, dest) in zip(group, parts):
            try:
                self._verify_item(path, d.info, *pieces)
            except CheckpointCorrupt as e:
                error = error or e
                continue
            if len(pieces) == 1:
                dest[:] = pieces[0][d.data_offset : d.data_offset + d.nbytes]
            verified.append((entry, len(pieces) > 1))
        return verified, error

    def _read_span(
        self, span: _Span, planner: LoadPlanner, lock: threading.Lock, target: torch.Tensor | None = None
    ) -> None:
        """Read a run of neighbouring items with one ranged read; ``target``:
        the destination of its single tensor item, if already resolved."""
        try:
            blob = self.storage.read_range(span.path, span.offset, span.length)
        except StorageNotFound as e:
            raise CheckpointCorrupt(f"{self.storage.describe(span.path)}: data file is missing") from e
        if len(blob) != span.length:
            raise CheckpointCorrupt(
                f"{self.storage.describe(span.path)}: short read at offset {span.offset} "
                f"({len(blob)} of {span.length} bytes; truncated?)"
            )
        view = memoryview(blob)
        with lock:
            self.bytes_read += len(blob)
        for req, info in span.reqs:
            start = info.offset - span.offset
            item = view[start : start + info.length]
            self._verify_item(span.path, info, item)
            self._progress.check()  # verified, and the load goes on: change the destination
            if req.type == LoadItemType.BYTE_IO:
                with lock:
                    planner.load_bytes(req, io.BytesIO(item))
                self._progress.loaded([req.dest_index.fqn])
                continue
            tensor = _narrow(item_tensor(item), req.storage_offsets, req.lengths)
            if target is None:
                with lock:
                    target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointCorrupt(
                    f"{self.storage.describe(span.path)}: item {req.storage_index.fqn} has shape "
                    f"{tuple(tensor.size())}, the plan expects {tuple(target.size())}"
                )
            copy_values(target, tensor)
            with lock:
                planner.commit_tensor(req, target)
            self._progress.loaded([req.dest_index.fqn])
            target = None

    def _verify_item(self, path: str, info: _StorageInfo, *pieces: memoryview) -> None:
        """Check an item's CRC32C; ``pieces`` are its bytes, in order."""
        if not self.verify or self._manifest is None:
            return
        expected = self._manifest["items"].get(item_key(path, info.offset))
        if expected is None:
            raise CheckpointCorrupt(f"{self.storage.describe(path)}: item at offset {info.offset} not in the manifest")
        crc = 0
        for piece in pieces:
            crc = crc32c.crc32c(piece, crc)
        if crc != expected:
            raise CheckpointCorrupt(
                f"{self.storage.describe(path)}: checksum mismatch in item at offset {info.offset} "
                f"({info.length} bytes): the data file is damaged"
            )

    @property
    def checkpoint_id(self) -> str:
        return self.storage.url.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return DcpStorageWriter.validate_checkpoint_id(checkpoint_id)


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


# item_tensor views read-only bytes (it only ever reads them); torch warns
# once per process that such tensors must not be written to. Silence only that.
warnings.filterwarnings("ignore", message=r"The given buffer is not writable")

_SKIP_DATA = getattr(torch.serialization, "skip_data", None)
#: Items smaller than this are copied by torch.load: parsing the header twice
#: costs more than copying a small tensor (measured on 20,000 x 3 KiB items).
VIEW_MIN_BYTES = 1 * MiB


def item_tensor(item: memoryview) -> torch.Tensor:
    """The tensor one ``torch.save`` item holds, as a view on ``item`` (no copy).

    ``torch.load`` copies the tensor's bytes into a new storage, which the
    reader then copies into the caller's tensor: on a VM where fresh memory
    costs page faults that extra copy dominated loads. Instead, read only the
    item's header (``skip_data``: shape, dtype, strides, no bytes) and view
    its single storage record where it lies in ``item``. Anything else --
    small items, several storages, another byte order, an older torch -- goes
    through ``torch.load``.
    """
    if _SKIP_DATA is not None and len(item) >= VIEW_MIN_BYTES:
        try:
            view = _view_record(item)
        except Exception:  # an unexpected layout: the general path below decides
            view = None
        if view is not None:
            return view
    loaded: torch.Tensor = torch.load(cast(IO[bytes], _ViewReader(item)), map_location="cpu", weights_only=True)
    return loaded


def _view_record(item: memoryview) -> torch.Tensor | None:
    reader = torch._C.PyTorchFileReader(cast(IO[bytes], _ViewReader(item)))
    records = [r for r in reader.get_all_records() if r.startswith("data/")]
    if records != ["data/0"] or bytes(reader.get_record("byteorder")).decode() != sys.byteorder:
        return None
    assert _SKIP_DATA is not None
    with _SKIP_DATA():
        meta = torch.load(cast(IO[bytes], _ViewReader(item)), map_location="cpu", weights_only=True)
    if not isinstance(meta, torch.Tensor):
        return None
    offset = reader.get_record_offset("data/0")  # type: ignore[attr-defined]  # missing from the stubs
    nbytes = meta.untyped_storage().nbytes()
    if nbytes == 0 or offset + nbytes > len(item):
        return None
    raw = torch.frombuffer(item[offset : offset + nbytes], dtype=torch.uint8)
    view = raw.view(meta.dtype).as_strided(meta.size(), meta.stride(), meta.storage_offset())
    # The record's view bits, as torch.load would set them.
    if meta.is_conj():
        view = view.conj()
    if meta.is_neg():
        view = torch._neg_view(view)
    return view


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = torch.narrow(tensor, dim, start, length)
    return tensor
