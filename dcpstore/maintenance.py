"""Operations on checkpoints at rest: list, inspect, verify, garbage-collect.

These back the ``dcpstore`` CLI and are plain functions so that scripts (and
tests) can call them directly. They work on every backend through
:class:`~dcpstore.storage.base.Storage`. Listing and ``gc`` read no content
and live in :mod:`dcpstore.listing` (no torch; re-exported here);
``inspect`` and ``verify`` read ``.metadata`` and the items, through the
restricted loaders only: nothing read is ever executed.

Layer: front door (beside :mod:`dcpstore.api`). Imports the DCP protocol's
read side, the format, :mod:`dcpstore.storage` and the foundation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .dcp.commit import read_checkpoint_metadata
from .errors import CheckpointCorrupt, CheckpointNotFound, StorageNotFound, UnsafeCheckpoint
from .format.layout import is_data_file, item_key
from .format.manifest import Manifest
from .format.record import item_tensor
from .format.safe_pickle import check_record_end, load_object
from .listing import CheckpointEntry, GcReport, gc, list_checkpoints
from .storage import MiB, Storage

__all__ = [
    "CheckpointEntry",
    "GcReport",
    "VerifyReport",
    "gc",
    "inspect_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
]

#: How much ``verify`` reads per request.
VERIFY_CHUNK = 16 * MiB


def inspect_checkpoint(storage: Storage) -> dict[str, Any]:
    """Keys, shapes, dtypes and sizes of a committed checkpoint, plus its files."""
    metadata, manifest = read_checkpoint_metadata(storage)
    keys: dict[str, Any] = {}
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for dim in md.size:
                numel *= dim
            keys[fqn] = {
                "kind": "tensor",
                "dtype": str(md.properties.dtype).removeprefix("torch."),
                "shape": list(md.size),
                "bytes": numel * md.properties.dtype.itemsize,
                "chunks": len(md.chunks),
            }
        elif isinstance(md, BytesStorageMetadata):
            keys[fqn] = {"kind": "object"}
    files = (
        {name: dict(entry) for name, entry in manifest["files"].items()}
        if manifest
        else _files_without_manifest(storage)
    )
    return {
        "uri": storage.uri,
        "verified_format": manifest is not None,
        "keys": keys,
        "files": files,
        "tensor_bytes": sum(k.get("bytes", 0) for k in keys.values()),
        "file_bytes": sum(f["size"] for f in files.values()),
    }


def _files_without_manifest(storage: Storage) -> dict[str, dict[str, int]]:
    return {o["path"]: {"size": o["size"]} for o in storage.list() if is_data_file(o["path"])}


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` found.

    Attributes:
        uri: the checkpoint (redacted).
        files_checked: data files checked.
        bytes_checked: their total size.
        problems: damage found, one line each (naming the file and item).
        refused: content a load refuses without an opt-in (a class off the
            allowlist).
        checksums: ``False`` for a checkpoint without dcpstore's manifest
            (written by stock DCP): its sizes were checked and every item
            decoded, but there was nothing to compare the bytes with.
    """

    uri: str
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    checksums: bool = True

    @property
    def ok(self) -> bool:
        return not (self.problems or self.refused)


#: (offset, length, label) of one stored item within its file.
_Span = tuple[int, int, str]


def verify_checkpoint(storage: Storage, progress: Callable[[int], Any] | None = None) -> VerifyReport:
    """Check everything ``dcpstore.load`` checks, reading every byte: OK
    exactly when a load with default arguments would get every item past
    its checks.

    That is: ``.metadata`` and the manifest (capped reads, schema, CRC, the
    restricted unpickle, every stored item listed and inside its file); each
    data file's size and CRC32C, and each item's CRC32C, in one pass per
    file; each non-tensor item through the restricted loader (nothing is
    executed; a class off the allowlist is a problem naming it). Problems
    are collected (not raised) so one run reports all damage; a checkpoint
    that does not exist raises :class:`CheckpointNotFound`.

    A checkpoint without a manifest (written by stock ``dcp.save``) has no
    checksums to compare with: there, every item must lie inside its file
    and decode (tensors as ``torch.load(weights_only=True)`` reads them, with
    the dtype and shape ``.metadata`` declares; other items through the
    restricted loader), and the report says ``checksums=False``.
    """
    report = VerifyReport(storage.uri)
    try:
        metadata, manifest = read_checkpoint_metadata(storage)
    except CheckpointNotFound:
        raise
    except CheckpointCorrupt as e:
        report.problems.append(str(e))
        return report
    except UnsafeCheckpoint as e:
        report.refused.append(str(e))
        return report
    if manifest is None:
        report.checksums = False
        _verify_without_checksums(storage, metadata, report, progress)
        return report
    spans: dict[str, list[_Span]] = {}
    objects: list[tuple[str, int, int, str]] = []
    for index, info in metadata.storage_data.items():
        label = index.fqn if index.offset is None else f"{index.fqn} chunk at {list(index.offset)}"
        if info.transform_descriptors:
            report.problems.append(
                f"{storage.describe(info.relative_path)}: item {label} uses DCP stream extensions "
                f"{list(info.transform_descriptors)}, which dcpstore does not read"
            )
        spans.setdefault(info.relative_path, []).append((info.offset, info.length, label))
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            objects.append((info.relative_path, info.offset, info.length, repr(index.fqn)))
    for name, entry in sorted(manifest["files"].items()):
        try:
            problems = _verify_file(storage, manifest, name, sorted(spans.get(name, [])), progress)
        except UnsafeCheckpoint as e:  # a file a load does not read (a link out of the checkpoint)
            report.refused.append(str(e))
            continue
        report.files_checked += 1
        report.bytes_checked += entry["size"]
        report.problems += problems
    if report.ok:  # the bytes are as saved: now what they hold
        for path, offset, length, item in objects:
            try:
                check_record_end(storage, path, offset, length, item)
                load_object(storage.read_range(path, offset, length), f"checkpoint item {item}")
            except CheckpointCorrupt as e:
                report.problems.append(str(e))
            except UnsafeCheckpoint as e:
                report.refused.append(str(e))
    return report


def _verify_without_checksums(
    storage: Storage, metadata: Metadata, report: VerifyReport, progress: Callable[[int], Any] | None
) -> None:
    """A stock DCP checkpoint: every data file there, every item inside its
    file, and every item decoded as a load would (see :func:`verify_checkpoint`)."""
    by_file: dict[str, list[tuple[int, int, str, Any]]] = {}
    for index, info in metadata.storage_data.items():
        label = repr(index.fqn) if index.offset is None else f"{index.fqn!r} chunk at {list(index.offset)}"
        by_file.setdefault(info.relative_path, []).append((info.offset, info.length, label, index))
    for name, items in sorted(by_file.items()):
        where = storage.describe(name)
        try:
            size = storage.size(name)
        except StorageNotFound:
            report.problems.append(f"{where}: data file is missing")
            continue
        except UnsafeCheckpoint as e:
            report.refused.append(str(e))
            continue
        report.files_checked += 1
        report.bytes_checked += size
        for offset, length, label, index in sorted(items, key=lambda item: item[0]):
            if offset + length > size:
                report.problems.append(
                    f"{where}: item {label} ({length} bytes at offset {offset}) extends past the end of the file "
                    f"({size} bytes; truncated?)"
                )
                continue
            try:
                check_record_end(storage, name, offset, length, label)
                blob = storage.read_range(name, offset, length)
                if len(blob) != length:
                    raise CheckpointCorrupt(f"{where}: short read of item {label} ({len(blob)} of {length} bytes)")
                md = metadata.state_dict_metadata.get(index.fqn)
                if isinstance(md, TensorStorageMetadata):
                    _check_tensor_item(blob, md, index.offset, f"{where}: item {label}")
                else:
                    load_object(blob, f"checkpoint item {label}")
            except CheckpointCorrupt as e:
                report.problems.append(str(e))
            except UnsafeCheckpoint as e:
                report.refused.append(str(e))
            if progress:
                progress(length)


def _check_tensor_item(blob: bytes, md: TensorStorageMetadata, offsets: Any, where: str) -> None:
    """The item decodes (``torch.load(weights_only=True)``: nothing runs) to
    the dtype and chunk shape ``.metadata`` declares."""
    try:
        tensor = item_tensor(memoryview(blob))
    except Exception as e:  # torch.load's errors have no common base: any is damage
        raise CheckpointCorrupt(f"{where} is not a readable tensor record ({type(e).__name__})") from e
    chunk = next((c for c in md.chunks if offsets is None or tuple(c.offsets) == tuple(offsets)), None)
    want = (md.properties.dtype, tuple(chunk.sizes) if chunk is not None else tuple(md.size))
    got = (tensor.dtype, tuple(tensor.shape))
    if got != want:
        raise CheckpointCorrupt(f"{where} holds {got[0]} {list(got[1])}; .metadata declares {want[0]} {list(want[1])}")


def _verify_file(
    storage: Storage, manifest: Manifest, name: str, spans: list[_Span], progress: Callable[[int], Any] | None
) -> list[str]:
    """Size, CRC32C of the file and of each item in it, in one pass."""
    size, expected_crc = manifest["files"][name]["size"], manifest["files"][name]["crc32c"]
    try:
        actual_size = storage.size(name)
    except StorageNotFound:
        return [f"{storage.describe(name)}: data file is missing"]
    if actual_size != size:
        return [f"{storage.describe(name)}: size {actual_size} bytes, expected {size} (truncated or damaged)"]
    crc, offset = 0, 0
    item_crcs = [0] * len(spans)
    first = 0  # spans before it end before ``offset``
    while offset < size:
        chunk = memoryview(storage.read_range(name, offset, min(VERIFY_CHUNK, size - offset)))
        if not chunk:
            return [f"{storage.describe(name)}: short read at offset {offset}"]
        crc = crc32c.crc32c(chunk, crc)
        end = offset + len(chunk)
        while first < len(spans) and spans[first][0] + spans[first][1] <= offset:
            first += 1
        for i in range(first, len(spans)):
            start, length, _ = spans[i]
            if start >= end:
                break
            lo, hi = max(offset, start), min(end, start + length)
            if lo < hi:
                item_crcs[i] = crc32c.crc32c(chunk[lo - offset : hi - offset], item_crcs[i])
        offset = end
        if progress:
            progress(len(chunk))
    if crc != expected_crc:
        return [f"{storage.describe(name)}: checksum mismatch (damaged data file)"]
    return [
        f"{storage.describe(name)}: checksum mismatch in item {label} at offset {start} ({length} bytes)"
        for (start, length, label), got in zip(spans, item_crcs)
        if got != manifest["items"][item_key(name, start)]
    ]


