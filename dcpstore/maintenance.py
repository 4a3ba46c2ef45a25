"""Operations on checkpoints at rest: list, inspect, verify, garbage-collect.

These back the ``dcpstore`` CLI and are plain functions so that scripts (and
tests) can call them directly. They work on every backend through
:class:`~dcpstore.storage.base.Storage`.

Layer: front door (beside :mod:`dcpstore.api`). Imports the DCP protocol's
read side, the format, :mod:`dcpstore.storage` and the foundation.
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .errors import CheckpointCorrupt, StorageNotFound
from .storage import MiB, Storage
from .dcp.commit import read_checkpoint_metadata
from .format.layout import INFLIGHT, MANIFEST, METADATA, is_data_file, split_data_path

#: How much ``verify`` reads per request.
VERIFY_CHUNK = 16 * MiB


@dataclass
class CheckpointEntry:
    """One checkpoint (committed or not) found under a root."""

    path: str  # relative to the listed root ("" for the root itself)
    committed: bool
    files: int = 0
    bytes: int = 0
    newest_mtime: float | None = None
    leftovers: list[str] = field(default_factory=list)


def list_checkpoints(storage: Storage) -> list[CheckpointEntry]:
    """Every checkpoint directory under ``storage``'s root, committed or not.

    A directory counts as a checkpoint if it holds ``.metadata`` (committed)
    or DCP data files / a manifest without one (an interrupted save).
    """
    by_dir: dict[str, CheckpointEntry] = {}
    for obj in storage.list():
        directory, name = posixpath.split(obj["path"])
        data = split_data_path(obj["path"])
        if data is not None:
            directory, name = data  # a spread data file belongs to the directory above its own
        elif name not in (METADATA, MANIFEST, INFLIGHT):
            continue
        entry = by_dir.setdefault(directory, CheckpointEntry(directory, committed=False))
        entry.committed |= name == METADATA
        entry.files += 1
        entry.bytes += obj["size"]
        entry.leftovers.append(obj["path"])
        mtime = obj.get("mtime")
        if mtime is not None:
            entry.newest_mtime = max(entry.newest_mtime or 0.0, mtime)
    for entry in by_dir.values():
        if entry.committed:  # only an in-flight marker can be left over
            entry.leftovers = [p for p in entry.leftovers if posixpath.basename(p) == INFLIGHT]
    return sorted(by_dir.values(), key=lambda e: e.path)


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
    uri: str
    files_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(storage: Storage, progress: Callable[[int], Any] | None = None) -> VerifyReport:
    """Read every data file in full and check its size and CRC32C.

    Problems are collected (not raised) so one run reports all damage; a
    checkpoint that cannot be opened at all raises.
    """
    report = VerifyReport(storage.uri)
    try:
        _, manifest = read_checkpoint_metadata(storage)
    except CheckpointCorrupt as e:
        report.problems.append(str(e))
        return report
    if manifest is None:
        report.problems.append(f"{storage.describe(MANIFEST)}: missing; a checkpoint written by stock DCP carries no checksums")
        return report
    for name, entry in sorted(manifest["files"].items()):
        problem = _verify_file(storage, name, entry["size"], entry["crc32c"], progress)
        report.files_checked += 1
        report.bytes_checked += entry["size"]
        if problem:
            report.problems.append(problem)
    return report


def _verify_file(
    storage: Storage, name: str, size: int, expected_crc: int, progress: Callable[[int], Any] | None
) -> str | None:
    try:
        actual_size = storage.size(name)
    except StorageNotFound:
        return f"{storage.describe(name)}: data file is missing"
    if actual_size != size:
        return f"{storage.describe(name)}: size {actual_size} bytes, expected {size} (truncated or damaged)"
    crc, offset = 0, 0
    while offset < size:
        chunk = storage.read_range(name, offset, min(VERIFY_CHUNK, size - offset))
        if not chunk:
            return f"{storage.describe(name)}: short read at offset {offset}"
        crc = crc32c.crc32c(chunk, crc)
        offset += len(chunk)
        if progress:
            progress(len(chunk))
    if crc != expected_crc:
        return f"{storage.describe(name)}: checksum mismatch (damaged data file)"
    return None


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    kept_recent: list[str] = field(default_factory=list)
    incomplete_uploads: int = 0


def gc(storage: Storage, *, older_than_s: float = 300.0, dry_run: bool = False) -> GcReport:
    """Remove what interrupted saves left under ``storage``'s root.

    That is: data files and manifests of checkpoint directories that have no
    ``.metadata`` (never committed), and the backend's in-progress leftovers
    (temporary files, open multipart uploads). Anything modified within
    ``older_than_s`` seconds is kept, since it may belong to a save that is
    still running. Committed checkpoints are never touched.
    """
    report = GcReport()
    now = time.time()
    doomed: list[str] = []
    for entry in list_checkpoints(storage):
        if not entry.leftovers:
            continue
        label = entry.path or "."
        if entry.newest_mtime is None and older_than_s > 0 or (
            entry.newest_mtime is not None and now - entry.newest_mtime < older_than_s
        ):
            report.kept_recent.append(label)
            continue
        doomed.extend(entry.leftovers)
        if not entry.committed:  # a committed one only loses a stale in-flight marker
            report.removed.append(label)
    if not dry_run:
        if doomed:
            storage.delete(doomed)
        report.incomplete_uploads = storage.cleanup_incomplete(older_than_s)
    else:
        report.incomplete_uploads = len(list(storage.list_incomplete()))
    return report
