"""Operations on checkpoints at rest: list, inspect, verify, garbage-collect.

These back the ``dcpstore`` CLI and are plain functions so that scripts (and
tests) can call them directly. They work on every backend through
:class:`~dcpstore._impl.storage.base.Storage`. Listing and ``gc`` read no content
and live in :mod:`dcpstore._impl.tools.listing` (no torch; re-exported here);
``inspect`` and ``verify`` read ``.metadata`` and the items, through the
restricted loaders only: nothing read is ever executed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from dcpstore._impl.dcp.commit.reading import read_checkpoint_metadata, read_commit_file
from dcpstore._impl.dcp.item_checks import ItemChecks, item_label
from dcpstore._impl.format.layout import is_data_file, item_key
from dcpstore._impl.format.manifest import Manifest, commit_files
from dcpstore._impl.format.record_zip import RecordBytes
from dcpstore._impl.storage import MiB, Storage, StorageOptions
from dcpstore._impl.storage.backend_registry import opened
from dcpstore._impl.tools.listing import CheckpointEntry, GcReport, gc, list_checkpoints
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointCorrupt, CheckpointNotFound, StorageNotFound, UnsafeCheckpoint
from dcpstore._impl.util.torch_compat import StorageInfo

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
            (written by stock DCP, or its manifest is gone: a load logs a
            warning for one dcpstore committed): its sizes were checked and every item
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


def verify_checkpoint(storage: Storage, progress: Callable[[int], Any] | None = None) -> VerifyReport:
    """Check everything ``dcpstore.load`` checks, reading every byte: OK
    exactly when a load with default arguments of the whole checkpoint would
    pass, because it runs the load's own checks.

    That is: ``.metadata`` and the manifest (capped reads, schema, CRC, the
    restricted unpickle, every stored item listed and inside its file, the
    chunks tiling each tensor: :func:`read_checkpoint_metadata`); each data
    file's size and CRC32C, and each item's CRC32C, in one pass per file;
    and each item as a load takes it (:class:`~dcpstore._impl.dcp.item_checks.ItemChecks`):
    a tensor whose bytes a load reads straight into its destination, the
    manifest's location of them proven from its record; any other tensor
    decoded as a load decodes it, of the declared dtype and shape; each
    non-tensor item through the restricted loader (nothing is executed; a
    class off the allowlist is a problem naming it). Stream transforms are
    undone with the default registry, as a default load does. Problems are
    collected (not raised) so one run reports all damage; a checkpoint that
    does not exist raises :class:`CheckpointNotFound`.

    A checkpoint without a manifest (written by stock ``dcp.save``, or one
    of dcpstore's whose manifest alone is gone) has no
    checksums to compare with: there, every item must lie inside its file
    and pass the same item checks, and the report says ``checksums=False``.
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
    report.checksums = manifest is not None
    checks = ItemChecks(metadata, storage)
    items: dict[str, list[_Item]] = {}
    for index, info in metadata.storage_data.items():
        items.setdefault(info.relative_path, []).append(_Item(index, info))
    for name in commit_files(manifest, items):  # a caller's own files of the commit: size and CRC32C
        items[name] = []
    for name in sorted(items):
        _FileCheck(storage, manifest, name, checks, report, progress).run(sorted(items[name], key=_Item.offset))
    return report


@dataclass
class _Item:
    """One stored item as verify reads it: what it keeps of the item's bytes
    (``keep``: ranges within the item, for its checks) and its CRC32C."""

    index: MetadataIndex
    info: StorageInfo
    keep: list[tuple[int, bytearray]] = field(default_factory=list)
    crc: int = 0
    #: Where a load reads its tensor bytes straight into the destination from (None: through the record).
    raw: tuple[int, int] | None = None
    skip: bool = False  # refused before reading: no check of its bytes

    def offset(self) -> int:
        return int(self.info.offset)

    @property
    def end(self) -> int:
        return int(self.info.offset + self.info.length)


class _FileCheck:
    """One data file: its size, then one pass over its bytes (its CRC32C and
    each item's), each item checked as it completes."""

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest | None,
        name: str,
        checks: ItemChecks,
        report: VerifyReport,
        progress: Callable[[int], Any] | None,
    ) -> None:
        self.storage, self.manifest, self.name, self.checks = storage, manifest, name, checks
        self.report, self.progress = report, progress
        self.where = storage.describe(name)
        self.tensors = manifest["tensors"] if manifest is not None else {}
        #: Items whose bytes are not as saved (reported unless the whole file's CRC already says so).
        self.mismatched: list[str] = []

    def run(self, items: list[_Item]) -> None:
        try:
            self._run(items)
        except UnsafeCheckpoint as e:  # a file no load reads (a link out of the checkpoint)
            self.report.refused.append(str(e))

    def _run(self, items: list[_Item]) -> None:
        try:
            size = self.storage.size(self.name)
        except StorageNotFound:
            self.report.problems.append(f"{self.where}: data file is missing")
            return
        if self.manifest is not None and size != self.manifest["files"][self.name]["size"]:
            expected = self.manifest["files"][self.name]["size"]
            self.report.problems.append(f"{self.where}: size {size} bytes, expected {expected} (truncated or damaged)")
            return
        self.report.files_checked += 1
        self.report.bytes_checked += size
        inside = []
        for item in items:
            if item.end > size:  # only without a manifest: the commit checks check it against the manifest's sizes
                self.report.problems.append(
                    f"{self.where}: item {item_label(item.index)} ({item.info.length} bytes at offset "
                    f"{item.info.offset}) extends past the end of the file ({size} bytes; truncated?)"
                )
                continue
            self._plan(item)
            inside.append(item)
        crc, read = self._stream(inside, size)
        if read < size:
            self.report.problems.append(f"{self.where}: short read at offset {read}")
        elif self.manifest is not None and crc != self.manifest["files"][self.name]["crc32c"]:
            self.report.problems.append(f"{self.where}: checksum mismatch (damaged data file)")
        else:
            self.report.problems += self.mismatched

    def _plan(self, item: _Item) -> None:
        """What of the item to keep for its checks: the record around its raw
        tensor bytes, or all of it; nothing if it is refused before reading."""
        info, index = item.info, item.index
        try:
            self.checks.before_read(self.name, info, index)
        except CheckpointCorrupt as e:
            self.report.problems.append(str(e))
            item.skip = True
            return
        item.raw = loc = self.checks.raw_location(self.name, info, index, self.tensors)
        spans = [(0, info.length)] if loc is None else self.checks.record_around_raw(info.length, loc)
        item.keep = [(start, bytearray(end - start)) for start, end in spans if end > start]

    def _stream(self, items: list[_Item], size: int) -> tuple[int, int]:
        """Read the file front to back once; returns its CRC32C and how much
        was read."""
        crc, offset = 0, 0
        pending = list(items)  # in offset order; checked (and dropped) as the pass moves past their end
        while offset < size:
            chunk = memoryview(self.storage.read_range(self.name, offset, min(VERIFY_CHUNK, size - offset)))
            if not chunk:
                break
            crc = crc32c(chunk, crc)
            end = offset + len(chunk)
            for item in pending:
                if item.info.offset >= end:
                    break
                lo, hi = max(offset, item.info.offset), min(end, item.end)
                if lo < hi:
                    item.crc = crc32c(chunk[lo - offset : hi - offset], item.crc)
                    for start, buf in item.keep:
                        a, b = max(lo, item.info.offset + start), min(hi, item.info.offset + start + len(buf))
                        if a < b:
                            at = a - item.info.offset - start
                            buf[at : at + b - a] = chunk[a - offset : b - offset]
            done = [item for item in pending if item.end <= end]
            pending = [item for item in pending if item.end > end]
            for item in done:
                self._check(item)
            offset = end
            if self.progress:
                self.progress(len(chunk))
        for item in pending:
            if item.end <= offset:  # empty items at the very end
                self._check(item)
        return crc, offset

    def _check(self, item: _Item) -> None:
        """An item whose bytes have all been read: its CRC32C, then what a load checks of it."""
        info, index = item.info, item.index
        keep, item.keep = item.keep, []
        if self.manifest is not None:
            if item.crc != self.manifest["items"][item_key(self.name, info.offset)]:
                self.mismatched.append(
                    f"{self.where}: checksum mismatch in item {item_label(index)} at offset {info.offset} "
                    f"({info.length} bytes)"
                )
                return
        if item.skip:
            return
        try:
            if item.raw is not None:
                assert self.manifest is not None  # only the manifest locates tensor bytes
                record = RecordBytes(info.length, [(start, memoryview(buf)) for start, buf in keep])
                self.checks.check_raw(self.name, info, index, item.raw, record, self.manifest["where"])
                return
            whole = memoryview(keep[0][1]) if keep else memoryview(b"")
            if self.checks.declared(index) is not None:
                self.checks.tensor(self.name, info, index, whole)
            else:
                self.checks.object_bytes(self.name, info, index, whole)
        except CheckpointCorrupt as e:
            self.report.problems.append(str(e))
        except UnsafeCheckpoint as e:
            self.report.refused.append(str(e))


# -- by URI: dcpstore.tools ------------------------------------------------------------


def inspect(uri: str | os.PathLike[str], *, storage_options: StorageOptions | None = None) -> dict[str, Any]:
    """What the checkpoint at ``uri`` holds (:func:`inspect_checkpoint`).

    Args:
        uri: the checkpoint, on any backend.
        storage_options: how to open it (:class:`~dcpstore.StorageOptions`).

    Returns:
        Its items, files and sizes, as ``dcpstore inspect --json`` prints them.

    Raises:
        CheckpointNotFound: no committed checkpoint there.
        CheckpointCorrupt: its commit does not hold together.
        UnsafeCheckpoint: its ``.metadata`` names what is not unpickled.
    """
    with opened(uri, storage_options) as storage:
        return inspect_checkpoint(storage)


def verify(
    uri: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    progress: Callable[[int], Any] | None = None,
) -> VerifyReport:
    """Read every byte of the checkpoint at ``uri`` and check it against its
    commit, as a load would (:func:`verify_checkpoint`: the same judgement).

    Args:
        uri: the checkpoint, on any backend.
        storage_options: how to open it.
        progress: called with each count of bytes read.

    Returns:
        The report: ``ok``, and each problem found, naming its file or item.

    Raises:
        CheckpointNotFound: no committed checkpoint there.
    """
    with opened(uri, storage_options) as storage:
        return verify_checkpoint(storage, progress=progress)


def commit_file(uri: str | os.PathLike[str], name: str, *, storage_options: StorageOptions | None = None) -> bytes:
    """A small file of the caller's that the checkpoint at ``uri`` holds in
    its commit (``dcpstore.StorageWriter(..., commit_files={name: blob})``,
    Lightning's ``meta.pt``): the copy its manifest records, its size and
    CRC32C checked.

    Args:
        uri: the checkpoint, on any backend.
        name: the file's name, as it was given to ``commit_files``.
        storage_options: how to open it.

    Returns:
        The file's bytes.

    Raises:
        CheckpointNotFound: no committed checkpoint there, or its commit
            records no such file.
        CheckpointCorrupt: the file does not match what the manifest records.
    """
    with opened(uri, storage_options) as storage:
        _, manifest = read_checkpoint_metadata(storage)
        return read_commit_file(storage, manifest, name)
