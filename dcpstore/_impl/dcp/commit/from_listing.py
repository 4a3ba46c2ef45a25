"""A directory's commit: ``.metadata`` and the manifest that belongs to it.

The manifest that belongs to a ``.metadata`` is the one that records the
CRC32C of its bytes. A directory may hold others: an overwrite's beside the
commit it replaces (until that commit's clean-up), a failed save's, the one
a stock DCP save left when it committed over ours; never the right one
twice (every commit's bytes differ: each records its own save id). Found so,
without unpickling anything, whatever name the save gave its manifest (the
plain ``.dcpstore.json`` or a save-unique ``.dcpstore.<tag>.json``).

A load finds it by the save id ``.metadata`` records instead (one read, no
listing: :func:`~dcpstore._impl.format.layout.manifest_names`) and checks this
same CRC32C (:mod:`.reading`); what works from a listing -- ``gc``, the
replicator, node-local tiers, a failed save's clean-up, a load's damage
report -- uses this module. Torch-free.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from dcpstore._impl.format.layout import METADATA, is_manifest
from dcpstore._impl.format.manifest import MANIFEST_LIMIT, METADATA_LIMIT, Manifest, parse_manifest, read_capped
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointError, StorageNotFound


@dataclass(frozen=True)
class Commit:
    """A committed directory's commit: ``.metadata``'s bytes and the manifest
    that belongs to them (its name as the save wrote it, its bytes, parsed)."""

    metadata_blob: bytes
    manifest_name: str
    manifest_blob: bytes
    manifest: Manifest

    @property
    def files(self) -> frozenset[str]:
        """Every file the commit consists of: ``.metadata``, its manifest and
        the files the manifest lists (names inside the directory)."""
        return frozenset({METADATA, self.manifest_name, *self.manifest["files"]})


def _join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if directory else name


def listed_names(storage: Storage, directory: str = "") -> list[str]:
    """The names listed in ``directory`` (relative to it; ``""``: the root,
    with every path under it)."""
    prefix = f"{directory}/" if directory else ""
    return [o["path"][len(prefix) :] for o in storage.list(prefix)]


def read_commit(
    storage: Storage, directory: str = "", names: Iterable[str] | None = None, *, skip_damaged: bool = False
) -> Commit | None:
    """The commit of ``directory``, or None if there is none: no
    ``.metadata``, or no manifest that belongs to it (stock DCP's commit;
    node-local directories of other ranks). ``names``: the names in the
    directory, if already listed (else it is listed). A manifest that
    cannot be read or parsed raises (:class:`CheckpointError`), unless
    ``skip_damaged``: then it is passed over, as one that does not belong."""
    try:
        blob = read_capped(storage, _join(directory, METADATA), METADATA_LIMIT)
    except StorageNotFound:
        return None
    return find_manifest(storage, blob, directory, names, skip_damaged=skip_damaged)


def find_manifest(
    storage: Storage,
    metadata_blob: bytes,
    directory: str = "",
    names: Iterable[str] | None = None,
    *,
    skip_damaged: bool = False,
) -> Commit | None:
    """The manifest among ``names`` (default: those listed in ``directory``)
    that belongs to the ``.metadata`` whose bytes are ``metadata_blob``, as
    its :class:`Commit`; None if none does (see :func:`read_commit`)."""
    crc = crc32c(metadata_blob)
    for name, blob, manifest in _manifests(storage, directory, names, skip_damaged):
        if manifest["metadata_crc32c"] == crc:
            return Commit(metadata_blob, name, blob, manifest)
    return None


def disowned(storage: Storage, metadata_blob: bytes) -> bool:
    """Whether the storage's root holds manifests and none that can be read
    records the CRC32C of ``metadata_blob``: then that ``.metadata`` is
    damaged, whatever its damage looks like. False where the root cannot be
    listed (a failure path only: one listing)."""
    crc = crc32c(metadata_blob)
    try:
        crcs = {m["metadata_crc32c"] for _, _, m in _manifests(storage, "", None, True)}
    except CheckpointError:
        return False
    return bool(crcs) and crc not in crcs


def _manifests(
    storage: Storage, directory: str, names: Iterable[str] | None, skip_damaged: bool
) -> Iterator[tuple[str, bytes, Manifest]]:
    """Every manifest among ``names`` (listed if None) in ``directory``, by
    name: its name, bytes and parsed content. One that is gone is skipped;
    a damaged one too where ``skip_damaged``, else it raises."""
    if names is None:
        names = listed_names(storage, directory)
    for name in sorted(n for n in names if is_manifest(n)):
        where = _join(directory, name)
        try:
            blob = read_capped(storage, where, MANIFEST_LIMIT)
            manifest = parse_manifest(blob, storage.describe(where))
        except StorageNotFound:
            continue
        except CheckpointError:
            if skip_damaged:
                continue
            raise
        yield name, blob, manifest
