"""Hugging Face safetensors through dcpstore's storage and commit:
:class:`SafetensorsWriter` and :class:`SafetensorsReader`, DCP's own
writer and reader for ``dcp.save`` / ``dcp.load`` / ``dcp.async_save``.

The writer is the drop-in :class:`~dcpstore.StorageWriter` (any URI
dcpstore serves, the claim, the owner check, the commit, staging for
``dcp.async_save``) with its data files replaced by safetensors shards:

* every tensor whole on one rank (one process, or rank 0 holding the full
  state dict): ``model-{i}-of-{n}.safetensors``, ``i`` from
  ``fqn_to_index_mapping`` (default: one file), and Hugging Face's index
  ``model.safetensors.index.json`` (``weight_map``), which ``transformers``
  and ``safetensors`` load;
* otherwise (DTensor shards, as FSDP saves): rank ``r``'s part of file
  ``i`` in ``shard-{r+1}-model-{i}-of-{n}.safetensors``, each chunk's
  offsets in the header's ``DCP_SHARDING_INFO`` as torch's
  ``HuggingFaceStorageWriter(save_distributed=True)`` writes them, and no
  index (a tensor lies in several files).

Each tensor chunk's bytes are one DCP item: the manifest records every
shard's size and CRC32C and every chunk's CRC32C, ``.metadata`` (DCP's
metadata, the commit point) records where each chunk lies, and the index
is a commit file: over a committed checkpoint the shards get save-unique
names (``model-00001-of-00002.{tag}.safetensors``, which the index names)
and the previous checkpoint stays whole until ``.metadata`` lands.

The reader loads such a checkpoint into any state dict DCP's planner
reshards to (one process or many), reading each chunk with one ranged read
and checking its CRC32C before a byte is used. Nothing read is executed:
``.metadata`` goes through dcpstore's restricted unpickle.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, WriteResult
from torch.futures import Future

from dcpstore._impl.dcp.commit.from_listing import read_commit
from dcpstore._impl.dcp.commit.reading import read_checkpoint_metadata
from dcpstore._impl.dcp.commit.session import ItemRecord
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate
from dcpstore._impl.dcp.writer import NO_DIST_WARNING, SaveToken, rebind, serves
from dcpstore._impl.dropin import StorageWriter, _Opener
from dcpstore._impl.format.layout import SAFETENSORS_INDEX, is_safetensors_file, item_key, safetensors_file_name
from dcpstore._impl.format.manifest import Manifest
from dcpstore._impl.format.safe_pickle import Trust
from dcpstore._impl.storage import Storage, StorageOptions, open_storage
from dcpstore._impl.util.checksum import crc32c, crc32c_concat
from dcpstore._impl.util.errors import CheckpointCorrupt, InvalidArgument, LoadError, SaveError
from dcpstore._impl.util.threads import run_parallel
from dcpstore._impl.util.warning_filters import ignoring
from dcpstore._impl.values.options import SaveOptions

#: torch dtype -> the safetensors header's name for it.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
#: The header's keys for DCP's chunk offsets (torch's HuggingFaceStorageWriter's).
SHARDING_INFO = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"


@dataclasses.dataclass
class ShardToken(SaveToken):
    """A rank's plan data in a safetensors save: the save's token, the
    rank's file names' shard number (None: whole tensors, no shard part)
    and how many files the save's mapping numbers."""

    shard: int | None = None
    files: int = 1


def chunk_nbytes(item: WriteItem) -> int:
    """The bytes of the chunk of its tensor that ``item`` saves (a DTensor
    shard's, not the whole tensor's)."""
    assert item.tensor_data is not None  # the writer refuses other items
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def header(items: Sequence[WriteItem], metadata: Mapping[str, str]) -> bytes:
    """A safetensors header (its 8-byte length, the JSON padded with spaces
    to a multiple of 8, as the format allows) for ``items`` laid out in
    order after it, each chunk under its tensor's name."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    start = 0
    for item in items:
        assert item.tensor_data is not None  # the writer refuses other items
        name, dtype = item.index.fqn, item.tensor_data.properties.dtype
        if name in entries:
            raise InvalidArgument(
                f"{name!r}: two chunks of one tensor on one rank; a safetensors file holds one chunk per name"
            )
        if dtype not in DTYPES:
            raise InvalidArgument(
                f"{name!r}: dtype {dtype} has no safetensors name (supported: {sorted(DTYPES.values())})"
            )
        end = start + chunk_nbytes(item)
        entries[name] = {
            "dtype": DTYPES[dtype],
            "shape": list(item.tensor_data.chunk.sizes),
            "data_offsets": [start, end],
        }
        start = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s elements as bytes, row-major, on the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data).cast("B")


class SafetensorsWriter(StorageWriter):
    """DCP's ``StorageWriter`` writing Hugging Face safetensors through any
    dcpstore backend, with dcpstore's commit (see the module docstring).
    Non-tensor values cannot be stored in safetensors and are refused
    naming them.

    Args:
        path: a local path or a URI (``s3://``, ``msc://``, an fsspec scheme).
        fqn_to_index_mapping: tensor name -> shard file number (from 1;
            torch's ``HuggingFaceStorageWriter``'s argument, e.g. from a
            model's own index); names left out go to file 1.
        thread_count, overwrite, region, options: as
            :class:`~dcpstore.StorageWriter`'s.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fqn_to_index_mapping: Mapping[str, int] | None = None,
        thread_count: int | None = None,
        overwrite: bool = True,
        region: str | None = None,
        options: Any = None,
    ) -> None:
        super().__init__(path, thread_count=thread_count, overwrite=overwrite, region=region, options=options)
        mapping = dict(fqn_to_index_mapping or {})
        for name, index in mapping.items():
            if isinstance(index, bool) or not isinstance(index, int) or index < 1:
                raise InvalidArgument(f"fqn_to_index_mapping[{name!r}] must be a file number >= 1, got {index!r}")
        self.fqn_to_index_mapping = mapping
        self.spread_prefixes = 1  # Hugging Face's layout is flat

    def _index_of(self, fqn: str) -> int:
        return self.fqn_to_index_mapping.get(fqn, 1)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        for plan in plans:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                    raise InvalidArgument(
                        f"{item.index.fqn!r} is not a tensor: safetensors stores tensors only; "
                        "save it elsewhere or leave it out of the state dict"
                    )
        plans = super().prepare_global_plan(plans)
        whole = _whole_tensors_once(plans)
        files = max([1, *self.fqn_to_index_mapping.values()])
        return [
            dataclasses.replace(
                plan,
                storage_data=ShardToken(**vars(plan.storage_data), shard=None if whole else rank + 1, files=files),
            )
            for rank, plan in enumerate(plans)
        ]

    def named_buckets(self, plan: SavePlan) -> list[tuple[str, list[WriteItem]]]:
        token: ShardToken = plan.storage_data
        by_index: dict[int, list[WriteItem]] = {}
        for item in plan.items:
            by_index.setdefault(self._index_of(item.index.fqn), []).append(item)
        return [
            (safetensors_file_name(i, token.files, token.shard, self.session.tag), items)
            for i, items in sorted(by_index.items())
        ]

    def write_file(
        self,
        storage: Storage,
        name: str,
        items: list[WriteItem],
        data_of: Callable[[WriteItem], Any],
        gate: OwnerGate,
        batch: int,
    ) -> list[WriteResult]:
        """Write the shard ``name``: ``items``' header, then each chunk's bytes
        (``data_of``), published once ``gate`` passes (``storage``, ``batch``:
        as the base hook's). Returns the items' write results."""
        sharding = {it.index.fqn: {SAVED_OFFSETS: list(it.tensor_data.chunk.offsets)} for it in items if it.tensor_data}
        head = header(items, {"format": "pt", SHARDING_INFO: json.dumps(sharding)})
        spans: list[tuple[int, int]] = [(crc32c(head), len(head))]
        written: list[tuple[WriteItem, int, int, int]] = []
        offset = len(head)
        size = offset + sum(chunk_nbytes(it) for it in items)
        with storage.open_write(name, size_hint=size, batch_hint=batch) as writer:
            writer.write(head)
            for item in items:
                data = tensor_bytes(data_of(item))
                if data.nbytes != chunk_nbytes(item):
                    raise SaveError(f"{item.index.fqn!r}: {data.nbytes} bytes, its plan says {chunk_nbytes(item)}")
                crc = crc32c(data)
                writer.write(data)
                written.append((item, offset, data.nbytes, crc))
                spans.append((crc, data.nbytes))
                offset += data.nbytes
                self.progress.update(data.nbytes)
            writer.seal()
            gate.wait()  # leaving the block publishes the file: only while the URI is still this save's
        file_crc = crc32c_concat(spans)
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=ItemRecord(name, start, length, crc, offset, file_crc),
            )
            for item, start, length, crc in written
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files = {wr.index.fqn: wr.storage_data.relative_path for rank in results for wr in rank}
        if not any(_is_sharded_name(path) for path in files.values()):
            index = {
                "metadata": {"total_size": sum(wr.storage_data.length for rank in results for wr in rank)},
                "weight_map": dict(sorted(files.items())),
            }
            save = self._save()
            save.commit_files = {**save.commit_files, SAFETENSORS_INDEX: json.dumps(index, indent=2).encode()}
        super().finish(metadata, results)


def _is_sharded_name(path: str) -> bool:
    return path.startswith("shard-")


def _whole_tensors_once(plans: Sequence[SavePlan]) -> bool:
    """Whether every tensor is saved whole, by one rank: then the files need
    no shard part and Hugging Face's index can name each tensor's file."""
    seen: set[str] = set()
    for plan in plans:
        for item in plan.items:
            data = item.tensor_data
            if item.index.fqn in seen or data is None or any(data.chunk.offsets) or data.chunk.sizes != data.size:
                return False
            seen.add(item.index.fqn)
    return True


class SafetensorsReader(StorageReader):
    """DCP's ``StorageReader`` for a checkpoint :class:`SafetensorsWriter`
    committed, on any URI dcpstore serves: ``dcp.load`` reshards it into
    whatever the state dict holds (plain tensors or DTensors, on any number
    of ranks). Each chunk is one ranged read, its CRC32C checked against
    the manifest before it is used (:class:`~dcpstore.CheckpointCorrupt`
    naming the file otherwise).

    Args:
        path: a local path or a URI dcpstore serves.
        thread_count: parallel reads per rank (default: the backend's).
        storage_options: how the storage is reached
            (:class:`~dcpstore.StorageOptions`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int | None = None,
        storage_options: StorageOptions | None = None,
    ) -> None:
        super().__init__()
        self._opener = _Opener(storage_options)
        self.storage = open_storage(path, storage_options=storage_options)
        self.workers = thread_count if thread_count is not None else self.storage.default_workers()
        self._metadata: Metadata | None = None
        self._manifest: Manifest | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage = rebind(self.storage, checkpoint_id, self._opener, "reader")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return serves(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The committed ``.metadata``, verified with its manifest (which a
        safetensors checkpoint of dcpstore's always has)."""
        metadata, manifest = read_checkpoint_metadata(self.storage, Trust.of())
        if manifest is None:
            raise LoadError(
                f"{self.storage.uri} has no integrity manifest: not a checkpoint dcpstore's SafetensorsWriter "
                "committed (a plain safetensors folder loads with torch's HuggingFaceStorageReader)"
            )
        self._metadata, self._manifest = metadata, manifest
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._manifest is None:
            self.read_metadata()
        per_chunk: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            per_chunk.setdefault(req.storage_index, []).append(req)

        def load(chunk: MetadataIndex) -> None:
            stored = self.chunk(chunk)
            for req in per_chunk[chunk]:
                piece = stored
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    piece = piece.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != piece.size():
                    raise LoadError(
                        f"{req.storage_index.fqn!r}: stored {tuple(piece.size())}, wanted {tuple(target.size())}"
                    )
                target.copy_(piece)
                planner.commit_tensor(req, target)

        run_parallel(load, list(per_chunk), max(1, self.workers), "dcpstore-safetensors-read")
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def chunk(self, index: MetadataIndex) -> torch.Tensor:
        """The stored chunk ``index`` (after :meth:`read_metadata`), read and
        checked against its CRC32C. Returns it as a tensor of its own."""
        assert self._metadata is not None and self._manifest is not None
        info = self._metadata.storage_data[index]
        path, offset, length = info.relative_path, info.offset, info.length
        tensor_md = self._metadata.state_dict_metadata[index.fqn]
        if not isinstance(tensor_md, TensorStorageMetadata):
            raise LoadError(f"{index.fqn!r} is not a tensor in {self.storage.uri}")
        sizes = next((c.sizes for c in tensor_md.chunks if c.offsets == index.offset), None)
        if sizes is None:
            raise CheckpointCorrupt(
                f"{self.storage.describe('.metadata')}: no chunk of {index.fqn!r} at {index.offset}"
            )
        data = self.storage.read_range(path, offset, length)
        if len(data) != length or crc32c(data) != self._manifest["items"].get(item_key(path, offset)):
            raise CheckpointCorrupt(
                f"{self.storage.describe(path)}: checksum mismatch in {index.fqn!r} ({length} bytes at offset {offset})"
            )
        if not length:
            return torch.empty(sizes, dtype=tensor_md.properties.dtype)  # frombuffer refuses no bytes
        return torch.frombuffer(bytearray(data), dtype=tensor_md.properties.dtype).reshape(sizes)


def is_dcpstore_safetensors(uri: str | os.PathLike[str], storage_options: StorageOptions | None = None) -> bool:
    """Whether ``uri`` holds a committed :class:`SafetensorsWriter` save
    (a ``.metadata`` whose files are safetensors shards), not a plain
    safetensors folder; reads only the commit."""
    storage = open_storage(uri, storage_options=storage_options)
    try:
        commit = read_commit(storage)
    finally:
        storage.close()
    return commit is not None and any(is_safetensors_file(p) for p in commit.manifest["files"])


class _FromSource(DefaultSavePlanner):
    """Plans the save of a state dict of meta tensors (shapes and dtypes
    only) and gives the writer each tensor when it asks for it, assembled
    from the source's chunks: one tensor per writer thread in memory."""

    def __init__(self, source: SafetensorsReader, metadata: Metadata) -> None:
        super().__init__()
        # Not self.metadata: DefaultSavePlanner keeps the new save's there.
        self.source, self.stored = source, metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        fqn = write_item.index.fqn
        stored = self.stored.state_dict_metadata[fqn]
        assert isinstance(stored, TensorStorageMetadata)  # the writer refuses other values
        whole = torch.empty(stored.size, dtype=stored.properties.dtype)
        for chunk in stored.chunks:
            piece = whole
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                piece = piece.narrow(dim, start, length)
            piece.copy_(self.source.chunk(MetadataIndex(fqn, chunk.offsets)))
        return whole


def consolidate_safetensors(
    uri: str | os.PathLike[str],
    to: str | os.PathLike[str] | None = None,
    *,
    fqn_to_index_mapping: Mapping[str, int] | None = None,
    storage_options: StorageOptions | None = None,
    workers: int | None = None,
) -> None:
    """Rewrite a safetensors checkpoint :class:`SafetensorsWriter` committed
    with tensors split over ranks (``shard-*-model-*.safetensors``) as whole
    tensors (``model-*-of-*.safetensors`` and Hugging Face's index), on any
    backend, reading and writing through dcpstore's storage: nothing is
    staged on local disk, and memory holds one tensor per writer thread.
    One process; run it once the save has committed.

    Args:
        uri: the committed checkpoint.
        to: where to write the consolidated checkpoint (None: ``uri``
            itself, replaced by the new commit as any save over it is).
        fqn_to_index_mapping: tensor name -> output file number (from 1).
        storage_options: how both URIs are reached.
        workers: files written at once (default: the backend's).

    Raises:
        CheckpointError: the source is not such a checkpoint, is damaged
            (``CheckpointCorrupt``), or the save fails (the destination
            keeps what it held).
    """
    source = SafetensorsReader(uri, storage_options=storage_options)
    metadata = source.read_metadata()
    meta_state: dict[str, Any] = {}
    for fqn, stored in metadata.state_dict_metadata.items():
        if not isinstance(stored, TensorStorageMetadata):
            raise LoadError(
                f"{source.storage.uri}: {fqn!r} is not a tensor; not a safetensors checkpoint of dcpstore's"
            )
        meta_state[fqn] = torch.empty(stored.size, dtype=stored.properties.dtype, device="meta")
    writer = SafetensorsWriter(
        uri if to is None else to,
        fqn_to_index_mapping=fqn_to_index_mapping,
        thread_count=workers,
        options=SaveOptions(storage_options=storage_options),
    )
    with ignoring(NO_DIST_WARNING):  # one process, on purpose
        dcp_save(meta_state, storage_writer=writer, planner=_FromSource(source, metadata), no_dist=True)
