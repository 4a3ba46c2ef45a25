"""The integrity manifest (``.dcpstore.json``, or ``.dcpstore.{tag}.json``
for a save over a used URI: :mod:`.layout`): its schema, and the one
validation of a commit that load, verify and inspect share.

A manifest records, for every data file, its size and CRC32C; for every
item (tensor or bytes blob) its CRC32C, keyed by ``"<file>@<offset>"``; the
CRC32C of the ``.metadata`` blob; and (``tensors``) where the raw tensor
bytes lie inside each item whose record holds them row-major. Stock DCP
ignores the file.

Everything read from storage is hostile until checked: :func:`parse_manifest`
checks every field's type and range, :func:`check_items_listed` checks the
manifest against ``.metadata`` (every stored item listed, inside its file,
its tensor bytes inside the item, no file listed that ``.metadata`` does
not name but a caller's commit files, each file's CRC the combination of
its items'), and
:func:`read_capped` refuses commit
files larger than any real checkpoint's, before allocating. Errors are
:class:`~dcpstore._impl.util.errors.CheckpointCorrupt` naming the file and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, TypedDict

from dcpstore._impl.format.layout import PAD_LIMIT, commit_file_of, commit_file_problem, is_data_file, item_key
from dcpstore._impl.storage.base import Storage
from dcpstore._impl.util.checksum import crc32c, crc32c_concat
from dcpstore._impl.util.errors import CheckpointCorrupt, ObjectTooLarge

MANIFEST_FORMAT = "dcpstore-manifest/1"
_UINT32 = 1 << 32

#: Reads of commit files stop here: no real checkpoint comes near (1 GiB of
#: ``.metadata`` is ~4 million chunks; a manifest entry is ~80 bytes), and a
#: crafted file (a sparse one costs nothing on disk) must not make a tool
#: allocate gigabytes before it can say the file is wrong.
METADATA_LIMIT = 1 << 30
MANIFEST_LIMIT = 512 << 20
#: Small pointer files (the in-flight marker, the manager's ``latest``).
SMALL_FILE_LIMIT = 4096


class FileEntry(TypedDict):
    size: int
    crc32c: int


class StoredManifest(TypedDict):
    """The manifest as stored (JSON)."""

    format: str
    checksum: str
    metadata_crc32c: int
    files: dict[str, FileEntry]
    items: dict[str, int]
    #: item key -> [offset of the tensor bytes in the item, nbytes]
    tensors: dict[str, list[int]]


class Manifest(StoredManifest):
    """A manifest as read: also where it was read from, for messages (a
    checkpoint's manifest may have a save-unique name)."""

    #: ``Storage.describe`` of the file it was parsed from (never stored).
    where: str


def build_manifest(
    files: dict[str, FileEntry],
    items: dict[str, int],
    metadata_crc: int,
    tensors: dict[str, list[int]] | None = None,
) -> bytes:
    manifest: StoredManifest = {
        "format": MANIFEST_FORMAT,
        "checksum": "crc32c",
        "metadata_crc32c": metadata_crc,
        "files": dict(sorted(files.items())),
        "items": items,
        "tensors": tensors or {},
    }
    return json.dumps(manifest, separators=(",", ":")).encode()


def read_capped(storage: Storage, name: str, limit: int) -> bytes:
    """The whole of ``name``, refusing (before reading) one over ``limit`` bytes
    or one that is not a plain file. StorageNotFound if it does not exist."""
    try:
        return storage.read(name, limit=limit)  # the local backend also refuses FIFOs and devices
    except ObjectTooLarge as e:
        raise CheckpointCorrupt(
            f"{storage.describe(name)}: {e.size} bytes, more than any real checkpoint's (limit {limit}); not read"
        ) from e


# ---------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------


def _show(value: Any) -> str:
    if isinstance(value, (bool, int, float, str)) or value is None:
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__}"


def _is_uint(value: Any, bound: int | None = None) -> bool:
    return type(value) is int and value >= 0 and (bound is None or value < bound)


def check_relative_name(name: Any) -> str | None:
    """Why ``name`` is not a plain relative file name under a checkpoint
    (None if it is): no absolute path, no ``..``, no empty part, no NUL."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty str"
    if len(name) > 1024 or "\x00" in name or "\\" in name:
        return "must be a plain file name"
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return "must stay inside the checkpoint (no '..', no absolute path)"
    return None


class _Checker:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, want: str, got: Any) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{self.where}: damaged integrity manifest: {field} must be {want}, got {_show(got)}")

    def mapping(self, data: dict[str, Any], key: str) -> dict[Any, Any]:
        value = data.get(key)
        if not isinstance(value, dict):
            raise self.fail(key, "an object", value)
        return value


def parse_manifest(blob: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; :class:`CheckpointCorrupt` naming
    ``where`` and the field for anything a load could trip over."""
    try:
        data = json.loads(blob)
    except RecursionError as e:
        raise CheckpointCorrupt(f"{where}: damaged integrity manifest (nested too deeply)") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorrupt(f"{where}: damaged integrity manifest ({e})") from e
    return validate_manifest(data, where)


def validate_manifest(data: Any, where: str) -> Manifest:
    """The schema of :class:`Manifest`, checked field by field."""
    check = _Checker(where)
    if not isinstance(data, dict):
        raise check.fail("the manifest", "a JSON object", data)
    if data.get("format") != MANIFEST_FORMAT:
        raise check.fail("format", repr(MANIFEST_FORMAT), data.get("format"))
    if data.get("checksum", "crc32c") != "crc32c":
        raise check.fail("checksum", "'crc32c'", data.get("checksum"))
    if not _is_uint(data.get("metadata_crc32c"), _UINT32):
        raise check.fail("metadata_crc32c", "a CRC32C (an int in [0, 2**32))", data.get("metadata_crc32c"))
    files = check.mapping(data, "files")
    for name, entry in files.items():
        why = check_relative_name(name)
        if why:
            raise check.fail(f"files key {_show(name)}", why.removeprefix("must be "), name)
        if not isinstance(entry, dict):
            raise check.fail(f"files[{name!r}]", "an object", entry)
        if not _is_uint(entry.get("size")):
            raise check.fail(f"files[{name!r}].size", "a non-negative int", entry.get("size"))
        if not _is_uint(entry.get("crc32c"), _UINT32):
            raise check.fail(f"files[{name!r}].crc32c", "a CRC32C", entry.get("crc32c"))
    items = check.mapping(data, "items")
    for key, crc in items.items():
        path, at, offset = key.rpartition("@")
        if not at or not offset.isdigit() or path not in files:
            raise check.fail(f"items key {key!r}", "'<listed file>@<offset>'", key)
        if int(offset) > files[path]["size"]:
            raise check.fail(f"items key {key!r}", f"an offset within the file ({files[path]['size']} bytes)", key)
        if not _is_uint(crc, _UINT32):
            raise check.fail(f"items[{key!r}]", "a CRC32C", crc)
    data.setdefault("tensors", {})  # absent from manifests written before it existed
    tensors = check.mapping(data, "tensors")
    for key, loc in tensors.items():
        if key not in items:
            raise check.fail(f"tensors key {key!r}", "a key of items", key)
        if not (isinstance(loc, list) and len(loc) == 2 and all(_is_uint(v) for v in loc)):
            raise check.fail(f"tensors[{key!r}]", "[offset, nbytes] (non-negative ints)", loc)
    data["where"] = where  # set here, whatever the file held under that key
    manifest: Manifest = data  # type: ignore[assignment]  # checked field by field above
    return manifest


# ---------------------------------------------------------------------------
# A commit: .metadata checked against the manifest
# ---------------------------------------------------------------------------

#: (label, relative path, offset, length) of every item ``.metadata`` stores.
StoredItem = tuple[str, str, int, int]


def check_items_listed(
    manifest: Manifest, items: Iterable[StoredItem], describe: Callable[[str], str], manifest_where: str
) -> None:
    """The manifest describes exactly what ``.metadata`` stores: every item
    listed, inside its file, its tensor bytes (if located) inside the item;
    every file it lists named by ``.metadata``; and each file's CRC32C the
    combination of its items' where they tile the file, each item after at
    most a writer's pad of zeros in a data file (shorter than :data:`~.layout.PAD_LIMIT`),
    so that no CRC in it can be damaged unseen: a load checks items, verify
    files too. What a load checks before it trusts a byte; shared by load
    and verify, so that verify says OK exactly when a load would get past
    these checks."""
    files, crcs, tensors = manifest["files"], manifest["items"], manifest["tensors"]
    per_file: dict[str, list[tuple[int, int]]] = {}
    for label, path, offset, length in items:
        entry = files.get(path)
        if entry is None:
            raise CheckpointCorrupt(f"{describe(path)}: not listed in the integrity manifest (item {label})")
        if offset + length > entry["size"]:
            raise CheckpointCorrupt(
                f"{describe(path)}: item {label} ({length} bytes at offset {offset}) runs past the end of "
                f"the file ({entry['size']} bytes in the manifest)"
            )
        key = item_key(path, offset)
        if key not in crcs:
            raise CheckpointCorrupt(f"{describe(path)}: item at offset {offset} not in the manifest (item {label})")
        loc = tensors.get(key)
        if loc is not None and not loc[0] + loc[1] <= length:
            raise CheckpointCorrupt(
                f"{manifest_where}: tensor location {loc} lies outside its item "
                f"({path} at offset {offset}, {length} bytes)"
            )
        per_file.setdefault(path, []).append((offset, length))
    unnamed = sorted(set(files) - set(per_file) - set(commit_files(manifest, per_file)))
    if unnamed:
        raise CheckpointCorrupt(
            f"{manifest_where}: damaged integrity manifest: lists {len(unnamed)} data file(s) that .metadata "
            f"does not name ({', '.join(unnamed[:3])})"
        )
    for path, spans in per_file.items():
        items_crcs = [(offset, length, crcs[item_key(path, offset)]) for offset, length in sorted(spans)]
        # Only DCP data files have pads; another file's gaps (a safetensors header) are its own bytes.
        parts = _tiling(items_crcs, files[path]["size"], PAD_LIMIT if is_data_file(path) else 1)
        if parts is None:
            continue  # not one item after another (another writer's layout): the file's CRC stands alone
        if crc32c_concat(parts) != files[path]["crc32c"]:
            raise CheckpointCorrupt(
                f"{manifest_where}: damaged integrity manifest: checksum mismatch in items of {path}: "
                f"files[{path!r}].crc32c is not the combination of its items' CRC32Cs"
            )


def _tiling(items: list[tuple[int, int, int]], size: int, pad_limit: int) -> list[tuple[int, int]] | None:
    """The ``(crc32c, length)`` pieces of a file of ``size`` bytes that its
    items (sorted ``(offset, length, crc32c)``) tile, each after a pad of
    zeros shorter than ``pad_limit`` (:data:`PAD_LIMIT`: what dcpstore's
    writer leaves in a data file); None if they do not."""
    parts = []
    end = 0
    for offset, length, crc in items:
        pad = offset - end
        if not 0 <= pad < pad_limit:
            return None
        if pad:
            parts.append((crc32c(bytes(pad)), pad))
        parts.append((crc, length))
        end = offset + length
    return parts if end == size else None


def commit_files(manifest: Manifest | None, named: Iterable[str]) -> list[str]:
    """The files the manifest lists beside the data files ``.metadata``
    names (``named``): a caller's commit files (:func:`~.layout.commit_file_path`),
    which no load of the state reads and ``read_commit_file`` checks."""
    if manifest is None:
        return []
    named = set(named)
    return sorted(
        p
        for p in manifest["files"]
        if p not in named and not is_data_file(p) and commit_file_problem(commit_file_of(p)) is None
    )


def check_metadata_crc(blob: bytes, manifest: Manifest, where: str) -> None:
    if crc32c(blob) != manifest["metadata_crc32c"]:
        raise CheckpointCorrupt(f"{where}: checksum mismatch (damaged commit object)")
