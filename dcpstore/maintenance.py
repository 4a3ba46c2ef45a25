"""Operations on checkpoints at rest: list, inspect, verify, garbage-collect.

These back the ``dcpstore`` CLI and are plain functions so that scripts (and
tests) can call them directly. They work on every backend through
:class:`~dcpstore.storage.base.Storage`.

Layer: front door (beside :mod:`dcpstore.api`). Imports the DCP protocol's
read side, the format, :mod:`dcpstore.storage` and the foundation.
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .dcp.commit import read_checkpoint_metadata
from .errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, StorageNotFound, UnsafeCheckpoint
from .format.inflight import decode_owner, is_alive_file, is_running
from .format.layout import INFLIGHT, MANIFEST, METADATA, is_commit_file, is_data_file, item_key, split_data_path
from .format.manifest import SMALL_FILE_LIMIT, Manifest, read_capped
from .format.safe_pickle import check_record_end, load_object
from .storage import MiB, Storage
from .storage.base import ObjectInfo
from .storage.uri import join_uri, parse_uri

#: How much ``verify`` reads per request.
VERIFY_CHUNK = 16 * MiB

#: What an interrupted stock commit leaves (written, then renamed).
_STOCK_TEMP_RE = re.compile(r"^(__\d+)?\.metadata\.tmp$")


def _is_leftover(name: str) -> bool:
    """Files an interrupted save (ours or stock DCP's) leaves."""
    return name in (MANIFEST, INFLIGHT) or is_data_file(name) or is_alive_file(name) or bool(_STOCK_TEMP_RE.match(name))


@dataclass
class CheckpointEntry:
    """One checkpoint (committed or not) found under a root."""

    path: str  # relative to the listed root ("" for the root itself)
    committed: bool
    files: int = 0
    bytes: int = 0
    newest_mtime: float | None = None
    leftovers: list[str] = field(default_factory=list)
    #: Committed by per-rank ``__{rank}.metadata`` (``use_collectives=False``).
    rank_local: bool = False
    #: Files in the directory that no DCP save writes: ``gc`` leaves it alone.
    unknown: list[str] = field(default_factory=list)
    #: Alive files of saves (``.dcpstore.alive.*``): (path, age in seconds or None).
    alive: list[tuple[str, float | None]] = field(default_factory=list)

    def running(self, storage: Storage, older_than_s: float = 0.0) -> bool:
        """Whether a save is (or may still be) writing here: its alive file
        names a live process of this machine, or was refreshed within
        max(``older_than_s``, the lease). Reads each alive file (small, capped)."""
        for path, age in self.alive:
            try:
                owner = decode_owner(read_capped(storage, path, SMALL_FILE_LIMIT))
            except CheckpointError:
                continue  # gone (the save just finished) or unreadable
            if is_running(owner, age, older_than_s):
                return True
        return False


def list_checkpoints(storage: Storage) -> list[CheckpointEntry]:
    """Every checkpoint directory under ``storage``'s root, committed or not.

    A directory counts as a checkpoint if it holds a commit (``.metadata``,
    or stock DCP's rank-local ``__{rank}.metadata``) or what an interrupted
    save leaves (DCP data files, a manifest, an in-flight marker). Never
    reads checkpoint content.
    """
    by_dir: dict[str, list[ObjectInfo]] = {}
    for obj in storage.list():
        data = split_data_path(obj["path"])
        # A spread data file (p3/__3_0.distcp) belongs to the directory above its own.
        by_dir.setdefault(data[0] if data is not None else posixpath.dirname(obj["path"]), []).append(obj)
    now = time.time()
    entries = []
    for directory, objs in by_dir.items():
        names = {o["path"][len(directory) + 1 :] if directory else o["path"]: o for o in objs}
        if not any(is_commit_file(n) or _is_leftover(n) for n in names):
            continue
        entry = CheckpointEntry(directory, committed=any(is_commit_file(n) for n in names))
        entry.rank_local = entry.committed and METADATA not in names
        for name, obj in sorted(names.items()):
            if not (is_commit_file(name) or _is_leftover(name)):
                entry.unknown.append(obj["path"])
                continue
            entry.files += 1
            entry.bytes += obj["size"]
            mtime = obj.get("mtime")
            if mtime is not None:
                entry.newest_mtime = max(entry.newest_mtime or 0.0, mtime)
            if is_alive_file(name):
                entry.alive.append((obj["path"], None if mtime is None else now - mtime))
            # A committed checkpoint only ever loses our markers; an
            # uncommitted one everything a save left.
            if not entry.committed or name == INFLIGHT or is_alive_file(name):
                entry.leftovers.append(obj["path"])
        entries.append(entry)
    return sorted(entries, key=lambda e: e.path)


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
    #: Content a load refuses without an opt-in (a class off the allowlist).
    refused: list[str] = field(default_factory=list)

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
        report.problems.append(f"{storage.describe(MANIFEST)}: missing; a checkpoint written by stock DCP carries no checksums")
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
        problems = _verify_file(storage, manifest, name, sorted(spans.get(name, [])), progress)
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


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    kept_recent: list[str] = field(default_factory=list)
    #: Directories where a save is running (its alive file says so).
    kept_running: list[str] = field(default_factory=list)
    #: Uncommitted directories holding files no DCP save writes: (dir, files).
    kept_unknown: list[tuple[str, list[str]]] = field(default_factory=list)
    incomplete_uploads: int = 0


def gc(storage: Storage, *, older_than_s: float = 300.0, dry_run: bool = False) -> GcReport:
    """Remove what interrupted saves left under ``storage``'s root.

    That is: everything a save (dcpstore's or stock DCP's) leaves in a
    directory that has no commit (``.metadata``, or stock DCP's rank-local
    ``__{rank}.metadata``), a committed checkpoint's stale in-flight
    markers, and the backend's in-progress leftovers (temporary files, open
    multipart uploads). Kept: anything modified within ``older_than_s``
    seconds; a directory where a save is running (its alive file names a
    live process of this machine, or was refreshed within max(``older_than_s``,
    the lease) -- whatever ``older_than_s`` says); a directory holding files
    no DCP save writes. Committed checkpoints are never touched. Never reads
    checkpoint content.
    """
    report = GcReport()
    now = time.time()
    doomed: list[str] = []
    for entry in list_checkpoints(storage):
        if not entry.leftovers:
            continue
        label = entry.path or "."
        if entry.unknown and not entry.committed:
            report.kept_unknown.append((label, entry.unknown))
            continue
        if entry.running(storage, older_than_s):
            report.kept_running.append(label)
            continue
        if entry.newest_mtime is None and older_than_s > 0 or (
            entry.newest_mtime is not None and now - entry.newest_mtime < older_than_s
        ):
            report.kept_recent.append(label)
            continue
        doomed.extend(entry.leftovers)
        if not entry.committed:  # a committed one only loses stale markers
            report.removed.append(label)
    running = ["" if label == "." else label for label in report.kept_running]
    if not dry_run:
        if doomed:
            storage.delete(doomed)
        if not running:
            report.incomplete_uploads = storage.cleanup_incomplete(older_than_s)
        else:  # never a running save's temp files or open uploads: only other directories'
            report.incomplete_uploads = sum(
                _under(storage, d).cleanup_incomplete(older_than_s) for d in _idle_dirs(storage, running)
            )
    else:
        report.incomplete_uploads = len(list(storage.list_incomplete()))
    return report


def _idle_dirs(storage: Storage, running: list[str]) -> list[str]:
    """Directories holding incomplete writes with no running save in or under them."""

    def holds(directory: str, other: str) -> bool:
        return not directory or other == directory or other.startswith(directory + "/")

    dirs = {posixpath.dirname(p) for p in storage.list_incomplete()}
    return sorted(d for d in dirs if not any(holds(d, r) for r in running))


def _under(storage: Storage, directory: str) -> Storage:
    """The same backend and options, rooted at ``directory`` of ``storage``."""
    return type(storage)(parse_uri(join_uri(storage.url.uri, *directory.split("/"))), storage.options)
