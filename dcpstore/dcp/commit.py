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
                      (the marker, the alive file, and the data files an
                      older checkpoint at the URI left behind)
    coordinator   session.release()   instead, when the save failed on any
                      rank (the writers call it): stop its proof of life, so
                      that ``gc`` may collect what it left; a no-op on other
                      ranks, after publish, and when called twice

Today a claim retracts the older commit (``.metadata``, or stock DCP's
rank-local ``__{rank}.metadata``) before any rank overwrites the data files
it points at, so a crash mid-save leaves no checkpoint at that URI (never an
old ``.metadata`` over new, partial data). Every decision that an
overwrite-safe commit changes lives in this class: which names a save writes
(:meth:`SaveSession.data_file`), what a claim does to an older commit
(:meth:`~SaveSession.claim`), what the commit point is
(:meth:`~SaveSession.publish`) and what is removed after it.

From claim to publish (or release) the coordinator keeps the save's alive
file fresh (:mod:`dcpstore.format.inflight`): ``gc`` never collects a save
that is still running, whatever ``--older-than`` says.

:func:`read_checkpoint_metadata` is the other side: what load, inspect and
verify accept as a committed checkpoint -- capped reads, the manifest's
schema, the restricted unpickle of ``.metadata`` (nothing in a checkpoint is
ever executed), every stored item checked against the manifest.

Layer: DCP protocol. Imports :mod:`dcpstore.format`, :mod:`dcpstore.storage`
and :mod:`dcpstore.errors`.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import crc32c
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointError, CheckpointNotFound, SaveError, StorageNotFound
from ..format import inflight
from ..format.inflight import Owner, alive_name, encode_alive, is_alive_file
from ..format.layout import INFLIGHT, MANIFEST, METADATA, data_file_name, is_commit_file, is_data_file, item_key
from ..format.manifest import (
    MANIFEST_LIMIT,
    METADATA_LIMIT,
    SMALL_FILE_LIMIT,
    FileEntry,
    Manifest,
    build_manifest,
    check_items_listed,
    check_metadata_crc,
    parse_manifest,
    read_capped,
)
from ..format.safe_pickle import TOOLS, Trust, load_metadata
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
        #: Keeps the alive file fresh from claim to publish or release (coordinator).
        self._refresher: _Refresher | None = None

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
        old_commit = sorted(p for p in present if is_commit_file(p) or p == MANIFEST)  # rank-local ones too
        if old_commit:
            self.storage.delete(old_commit)
        self.storage.put(INFLIGHT, self.save_id.encode())
        self._refresher = _Refresher(self.storage, self.save_id)  # proof of life for gc, until publish or release
        # Alive files of earlier saves are leftovers too: the clean-up removes them.
        self._found = frozenset(p for p in present if is_data_file(p) or is_alive_file(p))

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
            owner = read_capped(self.storage, INFLIGHT, SMALL_FILE_LIMIT).decode(errors="replace")
        except StorageNotFound:
            owner = "<none>"
        if owner == "<none>" and not self.storage.exists(METADATA):  # no later save committed and removed it
            raise SaveError(
                f"the in-flight marker {self.storage.describe(INFLIGHT)} of this save ({self.save_id}) was removed "
                "while it was writing (by 'dcpstore gc', or by hand); nothing was committed by this save"
            )
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
        try:
            self.check_owner()
            self.storage.put(MANIFEST, build_manifest(files, items, crc32c.crc32c(blob), tensors))
            self.storage.put(METADATA, blob)  # the commit point
        except BaseException:
            self.release()
            raise
        self._stop_refresher()  # the clean-up removes the alive file with the marker
        self._clean_up(files.keys())

    def release(self) -> None:
        """The save failed (on any rank) or never finished: stop its proof of
        life and remove its alive file (best effort), so that ``gc`` may
        collect what it left. Coordinator; a no-op on other ranks, after
        :meth:`publish`, and when called again. ``with session:`` calls it
        on leaving the block, for writers that hold the session in one frame."""
        if self._stop_refresher():
            try:
                self.storage.delete([alive_name(self.save_id)])
            except CheckpointError as e:
                log.debug("could not remove the alive file of save %s under %s: %s", self.save_id, self.storage.uri, e)

    def __enter__(self) -> SaveSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _stop_refresher(self) -> bool:
        """Stop the refresher, if running; whether it was."""
        refresher, self._refresher = self._refresher, None
        if refresher is None:
            return False
        refresher.stop()
        return True

    def _clean_up(self, live: Iterable[str]) -> None:
        """After the commit: delete the in-flight marker, the save's alive
        file and the data files (and alive files) an older save at this URI
        left behind, in one request. Best effort: the commit already happened."""
        try:
            found = self._found
            if found is None:
                found = frozenset(p for o in self.storage.list() if is_data_file(p := o["path"]) or is_alive_file(p))
            self.storage.delete([INFLIGHT, alive_name(self.save_id), *sorted(found - set(live))])
        except CheckpointError as e:
            log.warning("could not remove the in-flight marker or stale data files under %s: %s", self.storage.uri, e)


class _Refresher:
    """Rewrites a save's alive file every :data:`~dcpstore.format.inflight.REFRESH_S`
    seconds on a daemon thread, until :meth:`stop`, until the save's storage
    object is gone, or until the URI is no longer the save's (its in-flight
    marker replaced or removed: this save will not commit)."""

    def __init__(self, storage: Storage, save_id: str) -> None:
        self._storage = weakref.ref(storage)
        self._uri = storage.uri
        self._save_id = save_id
        self._blob = encode_alive(save_id, Owner.current())
        self._stopped = threading.Event()
        storage.put(alive_name(save_id), self._blob)
        self._thread = threading.Thread(target=self._run, name="dcpstore-alive", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing; returns once no refresh is under way (so none
        lands after the caller removes the file)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(inflight.REFRESH_S):
            storage = self._storage()
            if storage is None:
                return
            try:
                if read_capped(storage, INFLIGHT, SMALL_FILE_LIMIT).decode(errors="replace") != self._save_id:
                    return  # the URI is another save's now (or gc took it): this save will not commit
                if not self._stopped.is_set():
                    storage.put(alive_name(self._save_id), self._blob)
            except StorageNotFound:
                return
            except CheckpointError as e:
                log.debug("could not refresh the alive file of save %s under %s: %s", self._save_id, self._uri, e)
            finally:
                del storage


# ---------------------------------------------------------------------------
# The read side: what counts as a committed checkpoint
# ---------------------------------------------------------------------------


def read_checkpoint_metadata(storage: Storage, trust: Trust = TOOLS) -> tuple[Metadata, Manifest | None]:
    """Read and verify ``.metadata`` (and the manifest, if there is one):
    capped reads, the manifest's schema, the CRC, the restricted unpickle
    (``trust``: what it may build beyond the allowlist), and every stored
    item checked against the manifest. Load, verify and inspect all come here."""
    try:
        blob = read_capped(storage, METADATA, METADATA_LIMIT)
    except StorageNotFound as e:
        raise CheckpointNotFound(_why_missing(storage)) from e
    manifest = None
    try:
        manifest = parse_manifest(read_capped(storage, MANIFEST, MANIFEST_LIMIT), storage.describe(MANIFEST))
    except StorageNotFound:
        log.debug("%s has no integrity manifest (written by stock DCP?); loading unverified", storage.uri)
    if manifest is not None:
        check_metadata_crc(blob, manifest, storage.describe(METADATA))
    metadata, stored = load_metadata(blob, storage.describe(METADATA), trust)
    if manifest is not None:
        check_items_listed(manifest, stored, storage.describe, storage.describe(MANIFEST))
    return metadata, manifest


def _why_missing(storage: Storage) -> str:
    try:
        listed = [o["path"] for o in storage.list()]
        leftovers = [p for p in listed if is_data_file(p) or p == MANIFEST]
    except StorageNotFound as e:  # e.g. the bucket itself does not exist: say so
        return f"no checkpoint at {storage.uri}: {e}"
    except CheckpointError as e:
        return f"no checkpoint at {storage.uri} (and listing it failed: {e})"
    rank_local = sorted(p for p in listed if is_commit_file(p) and p != METADATA)
    if rank_local:
        return (
            f"no global {METADATA} at {storage.uri}: it holds rank-local metadata ({', '.join(rank_local[:3])}"
            f"{', ...' if len(rank_local) > 3 else ''}), a checkpoint of dcp.save(..., use_collectives=False) "
            "that dcpstore does not read (stock dcp.load does)"
        )
    if leftovers:
        return (
            f"no committed checkpoint at {storage.uri}: data files exist but no {METADATA} "
            f"(an interrupted save; 'dcpstore gc {storage.uri}' removes it)"
        )
    return f"no checkpoint at {storage.uri} (no {METADATA} found)"
