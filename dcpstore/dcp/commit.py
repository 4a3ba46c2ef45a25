"""The commit protocol, in one object: :class:`SaveSession`; and its read side.

Every writer -- the native :class:`~dcpstore.dcp.writer.DcpStorageWriter` and
the NVRx engine -- runs a save through a session, so the protocol below is
written once. Call order, and which rank calls what::

    coordinator   session = SaveSession(storage); session.claim()
                      before any rank writes: retract an older commit at the
                      URI, write the in-flight marker holding the save id
    other ranks   session = SaveSession(storage, save_id)
                      with the coordinator's id (DCP's plan or a broadcast)
    every rank    session.data_file(rank_prefix, n)   the names to write
                  session.check_owner()               before publishing each
                      data file: a save whose marker was replaced by a later
                      save's fails instead of clobbering that save's files
    coordinator   session.publish(metadata, results)  only after *every*
                      rank's data files are durable (DCP and NVRx gather the
                      write results first): ownership check, the manifest,
                      ``.metadata`` last -- the commit point -- then clean up
                      (the marker, and the data files an older checkpoint at
                      the URI left behind)

Today a claim retracts the older commit before any rank overwrites the data
files it points at, so a crash mid-save leaves no checkpoint at that URI
(never an old ``.metadata`` over new, partial data). Every decision that an
overwrite-safe commit changes lives in this class: which names a save writes
(:meth:`SaveSession.data_file`), what a claim does to an older commit
(:meth:`~SaveSession.claim`), what the commit point is
(:meth:`~SaveSession.publish`) and what is removed after it.

:func:`read_checkpoint_metadata` is the other side: what load, inspect and
verify accept as a committed checkpoint.

Layer: DCP protocol. Imports :mod:`dcpstore.format`, :mod:`dcpstore.storage`
and :mod:`dcpstore.errors`.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import crc32c
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound, SaveError, StorageNotFound
from ..format.layout import (
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
from ..storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemRecord:
    """``WriteResult.storage_data`` for one item: where it lives and its CRC.

    Carries its file's size and CRC too, so that the coordinator's
    :meth:`SaveSession.publish` builds the manifest from the gathered
    results alone. ``raw``: see :class:`~dcpstore.format.record.WrittenItem`.
    """

    relative_path: str
    offset: int
    length: int
    crc32c: int
    file_size: int
    file_crc32c: int
    raw: tuple[int, int] | None = None


class SaveSession:
    """One save at one URI, from claim to clean-up (see the module docstring).

    ``save_id``: the coordinator's id; leave it out on the coordinator (a
    fresh one is made), pass the coordinator's on every other rank.
    """

    def __init__(self, storage: Storage, save_id: str | None = None) -> None:
        self.storage = storage
        self.save_id = save_id if save_id is not None else os.urandom(8).hex()
        #: The data files the claim found (coordinator); None: not claimed.
        self._found: frozenset[str] | None = None

    # -- coordinator, before any rank writes -------------------------------
    def claim(self) -> None:
        """Retract an older commit at the URI, so that a crash mid-save never
        leaves an old ``.metadata`` pointing at new, partial data, and mark
        the URI as this save's. Lists the URI once: the data files found
        then are the ones :meth:`publish` may remove (a file that appears
        later belongs to a save that replaced our marker, and then this save
        never commits)."""
        self.storage.makedirs()
        present = {o["path"] for o in self.storage.list()}
        old_commit = [p for p in (METADATA, MANIFEST) if p in present]
        if old_commit:
            self.storage.delete(old_commit)
        self.storage.put(INFLIGHT, self.save_id.encode())
        self._found = frozenset(p for p in present if is_data_file(p))

    # -- every rank -----------------------------------------------------------
    def data_file(self, rank_prefix: str, index: int) -> str:
        """The name of data file ``index`` of the rank whose DCP prefix is
        ``rank_prefix`` (``__{rank}_``): ``__{rank}_{index}.distcp``, as
        stock DCP names them."""
        return data_file_name(rank_prefix, index)

    def check_owner(self) -> None:
        """Refuse to publish a file or commit once another save to this URI
        has started (it replaced our in-flight marker): the later save wins,
        this one fails clearly and never writes over the winner's files."""
        try:
            owner = self.storage.read(INFLIGHT).decode(errors="replace")
        except StorageNotFound:
            owner = "<none>"
        if owner != self.save_id:
            raise SaveError(
                f"another save to {self.storage.uri} started while this one was writing "
                f"(its save id {owner}, ours {self.save_id}); nothing was committed by this save"
            )

    def discard(self, written: Iterable[str]) -> None:
        """After this save failed on some rank: remove the data files this
        rank wrote in place under their final names (the NVRx engine does),
        so that they do not hold the space the next save needs. Left alone
        when another save has taken the URI over (they are its files now) or
        when this save's ``.metadata`` exists after all (a failure after the
        commit point). Best effort: a failure here is logged."""
        names = sorted(written)
        if not names:
            return
        try:
            self.check_owner()
            if not self.storage.exists(METADATA):
                self.storage.delete(names)
        except CheckpointError as e:
            log.warning("a failed save left its data files under %s in place: %s", self.storage.uri, e)

    def storage_meta(self) -> StorageMeta:
        """What ``.metadata`` records about this save."""
        return StorageMeta(checkpoint_id=self.storage.uri, save_id=self.save_id)

    # -- coordinator, after every rank's data is durable ---------------------
    def publish(self, metadata: Metadata, results: Sequence[Sequence[WriteResult]]) -> None:
        """Commit: the manifest, then ``.metadata`` last (the commit point),
        then clean up.

        ``metadata`` is DCP's global metadata (its ``storage_data`` and
        ``storage_meta`` are filled in here); ``results`` are every rank's
        write results, whose ``storage_data`` are :class:`ItemRecord`.
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
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        self.check_owner()
        self.storage.put(MANIFEST, build_manifest(files, items, crc32c.crc32c(blob), tensors))
        self.storage.put(METADATA, blob)  # the commit point
        self._clean_up(files.keys())

    def _clean_up(self, live: Iterable[str]) -> None:
        """After the commit: delete the in-flight marker and the data files an
        older checkpoint at this URI left behind, in one request. Best
        effort: the commit already happened."""
        try:
            found = self._found
            if found is None:
                found = frozenset(o["path"] for o in self.storage.list() if is_data_file(o["path"]))
            self.storage.delete([INFLIGHT, *sorted(found - set(live))])
        except CheckpointError as e:
            log.warning("could not remove the in-flight marker or stale data files under %s: %s", self.storage.uri, e)


# ---------------------------------------------------------------------------
# The read side: what counts as a committed checkpoint
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
