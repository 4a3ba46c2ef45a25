"""A save's commit, in one object: :class:`SaveSession`.

Every writer -- the native :class:`~dcpstore._impl.dcp.writer.DcpStorageWriter` and
the NVRx engine -- runs a save through a session, so the protocol below is
written once. Call order, and which rank calls what::

    coordinator   session = SaveSession(storage); session.claim(overwrite)
                      before any rank writes: refuse a committed URI if
                      overwrite=False, choose the names (save-unique ones
                      where the URI holds anything), write the in-flight
                      marker holding the save id
    other ranks   session = SaveSession(storage, save_id, tagged)
                      with the coordinator's id and choice of names (DCP's
                      plan or a broadcast: :attr:`~SaveSession.token`)
    every rank    session.data_file(rank_prefix, n)   the names to write
                  session.check_owner()               before publishing each
                      data file: a save whose marker was replaced by a later
                      save's fails instead of clobbering that save's files
    coordinator   session.publish(metadata, results[, commit_files])  only
                      after *every* rank's data files are durable (DCP and
                      NVRx gather the write results first): ownership check,
                      the commit files (a caller's own small files that
                      belong to this checkpoint, e.g. Lightning's meta.pt,
                      recorded in the manifest like data files), the
                      manifest, ``.metadata`` last -- the commit point --
                      then clean up (the marker, the alive file, and the
                      data files, manifest and commit files of the
                      checkpoint it replaced): :mod:`.publish`
    coordinator   session.release()   instead, when the save failed on any
                      rank (the writers call it): stop its proof of life, so
                      that ``gc`` may collect what it left; a no-op on other
                      ranks, after publish, and when called twice

Saving over a committed checkpoint never loses it. The claim leaves the
committed ``.metadata`` and everything it points at alone; the new save
writes its data files and its manifest under save-unique names
(:mod:`dcpstore._impl.format.layout`) beside them. ``.metadata`` is the one file
both saves write, and writing it is atomic (a rename on POSIX, a single PUT
on object stores): until it lands the URI loads exactly the old checkpoint
(its ``.metadata`` still names its own files and its own manifest), after
it exactly the new one. Only then are the old files removed; a crash before
that leaves garbage that ``gc`` removes, never a broken checkpoint. Commit
files follow the same rule: over a used URI they go under save-unique names
(``.dcpstore.side.{tag}.<name>``) and are copied to ``<name>`` only after
the commit, for readers that know only the plain name;
:func:`~.reading.read_commit_file` reads the copy the manifest records.

From claim to publish (or release) the coordinator holds the save's lease
(:mod:`dcpstore._impl.dcp.liveness.lease`): its alive file, written before the marker and kept fresh
(:mod:`dcpstore._impl.dcp.liveness.alive_file`), so that ``gc`` never collects a save
that is still running, whatever ``--older-than`` says.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from dcpstore._impl.dcp.commit.from_listing import read_commit
from dcpstore._impl.dcp.commit.publish import clean_up, commit_point
from dcpstore._impl.dcp.liveness.alive_file import alive_name, is_alive_file
from dcpstore._impl.dcp.liveness.inflight_marker import put_marker, read_marker
from dcpstore._impl.dcp.liveness.lease import Lease, mark
from dcpstore._impl.dcp.liveness.save_leftovers import is_save_file
from dcpstore._impl.format.layout import (
    INFLIGHT,
    METADATA,
    commit_file_of,
    commit_file_path,
    commit_file_problem,
    data_file_name,
    is_commit_file,
    is_safetensors_file,
    item_key,
    manifest_name,
    name_tag,
    save_tag,
)
from dcpstore._impl.format.manifest import FileEntry, build_manifest
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointError, CheckpointExists, InvalidArgument, SaveError
from dcpstore._impl.util.torch_compat import StorageInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemRecord:
    """``WriteResult.storage_data`` for one item: where it lives and its CRC.

    Carries its file's size and CRC too, so that the coordinator's
    :meth:`SaveSession.publish` builds the manifest from the gathered
    results alone. ``raw``: see :class:`~dcpstore._impl.format.record.WrittenItem`.
    ``transforms``: the descriptors of DCP stream transforms the item was
    stored with (``.metadata`` records them).
    """

    relative_path: str
    offset: int
    length: int
    crc32c: int
    file_size: int
    file_crc32c: int
    raw: tuple[int, int] | None = None
    transforms: tuple[str, ...] = ()


class SaveSession:
    """One save at one URI, from claim to clean-up (see the module docstring).

    ``save_id`` and ``tagged``: the coordinator's (:attr:`token`); leave them
    out on the coordinator (a fresh id is made, and the claim chooses the
    names), pass the coordinator's on every other rank. A coordinator may be
    given the id its claim records (a caller that has to know it before the
    save starts: a tiered manager puts it in each node's directory); the
    claim then keeps it, or refuses should its tag be taken there.
    """

    def __init__(self, storage: Storage, save_id: str | None = None, tagged: bool = False) -> None:
        self.storage = storage
        self._id_given = save_id is not None
        self.save_id = save_id if save_id is not None else os.urandom(8).hex()
        #: "" for stock DCP's names, else the save tag of save-unique names.
        self.tag = save_tag(self.save_id) if tagged else ""
        #: The files the claim found that the commit makes stale (coordinator); None: not claimed.
        self._found: frozenset[str] | None = None
        #: Keeps the alive file fresh from claim to publish or release (coordinator).
        self._lease: Lease | None = None

    @property
    def token(self) -> tuple[str, bool]:
        """What every other rank needs to join this save: ``(save_id, tagged)``."""
        return self.save_id, bool(self.tag)

    # -- coordinator, before any rank writes -------------------------------
    def claim(self, overwrite: bool = True) -> None:
        """Mark the URI as this save's, leaving any committed checkpoint there
        untouched. ``overwrite=False``: refuse a URI that holds one
        (:class:`CheckpointExists`; nothing is written).

        Takes its turn at the URI (:func:`_turn`) with other claims and
        commits of this process."""
        with _turn(self.storage.uri):
            self._claim(overwrite)

    def _claim(self, overwrite: bool) -> None:
        """:meth:`claim`, in this process's turn at the URI.

        Chooses the names: stock DCP's on a fresh URI, save-unique ones where
        the URI holds anything of a save (a commit, data files, a manifest, a
        marker), with a tag no file there carries. Lists the URI once: the
        files found then are the ones the commit makes stale and
        :meth:`publish` removes (a file that appears later belongs to a save
        that replaced our marker, and then this save never commits)."""
        self.storage.makedirs()
        present = {o["path"] for o in self.storage.list()}
        committed = sorted(p for p in present if is_commit_file(p))
        if committed and not overwrite:
            raise CheckpointExists(
                f"Checkpoint already exists at {self.storage.uri} ({', '.join(committed[:3])}) and overwrite=False; "
                "nothing was written"
            )
        stale = {p for p in present if is_save_file(p) or is_alive_file(p)}
        if committed and any(is_safetensors_file(p) and not is_save_file(p) for p in present):
            stale |= self._replaced_shards(present)
        if stale or committed or INFLIGHT in present:
            taken = {name_tag(p) for p in stale}
            while save_tag(self.save_id) in taken:  # 1 in 2**32: never reuse a name that is there
                if self._id_given:
                    raise SaveError(
                        f"cannot save to {self.storage.uri}: the save id {self.save_id} chosen for this save has "
                        "the tag of files already there; nothing was written"
                    )
                self.save_id = os.urandom(8).hex()
            self.tag = save_tag(self.save_id)
        # Proof of life for gc, until publish or release. Not fsynced: a crash
        # of the machine ends the save, so the alive file has nothing left to
        # prove, and the marker guards against other live saves, which see it
        # without an fsync; the first data file's directory fsync makes both
        # durable anyway, long before the commit.
        self._lease = mark(self.storage, self.save_id, lease_id=self.save_id, durable=False)
        self._found = frozenset(stale)

    def _replaced_shards(self, present: set[str]) -> set[str]:
        """The plainly named safetensors shards the committed checkpoint
        consists of: a plain name may be anyone's weights, so only the
        commit's own manifest makes them this save's to replace."""
        commit = read_commit(self.storage, names=present, skip_damaged=True)
        if commit is None:
            return set()
        return {p for p in commit.files if is_safetensors_file(p) and p in present}

    # -- every rank -----------------------------------------------------------
    def data_file(self, rank_prefix: str, index: int) -> str:
        """The name of data file ``index`` of the rank whose DCP prefix is
        ``rank_prefix`` (``__{rank}_``): ``__{rank}_{index}.distcp``, as
        stock DCP names them, or ``__{rank}_{tag}_{index}.distcp``."""
        return data_file_name(rank_prefix, index, self.tag)

    @property
    def manifest(self) -> str:
        """The name of this save's integrity manifest."""
        return manifest_name(self.tag)

    def check_owner(self) -> None:
        """Refuse to publish a file or commit once another save to this URI
        has started (it replaced our in-flight marker): the later save wins,
        this one fails clearly and never writes over the winner's files.

        A marker that is *missing* where no ``.metadata`` is either was
        removed by ``dcpstore gc`` (the marker of a dead save it had listed
        before this save's claim replaced it) or by hand; no other save has
        taken the URI (a claim replaces the marker, it never removes it,
        and a save that committed leaves ``.metadata``). The coordinator puts
        it back and the save goes on; other ranks go on."""
        owner = self._marker()
        if owner is None:
            if not self.storage.exists(METADATA):  # no save committed here since
                if self._lease is None:
                    return  # another rank's: the coordinator puts it back
                log.warning(
                    "the in-flight marker %s of save %s was removed while it was writing (by 'dcpstore gc' "
                    "or by hand) and no other save has taken the URI: put back",
                    self.storage.describe(INFLIGHT),
                    self.save_id,
                )
                put_marker(self.storage, self.save_id)
                owner = self._marker()  # should another save have claimed meanwhile
                if owner in (None, self.save_id):
                    return
            else:
                raise SaveError(
                    f"another save to {self.storage.uri} started while this one was writing and committed (or "
                    f"this save's in-flight marker was removed by hand); nothing was committed by this save "
                    f"({self.save_id})"
                )
        if owner != self.save_id:
            raise SaveError(
                f"another save to {self.storage.uri} started while this one was writing "
                f"(its save id {owner}, ours {self.save_id}); nothing was committed by this save"
            )

    def _marker(self) -> str | None:
        """The save id the URI's in-flight marker holds (None: no marker)."""
        return read_marker(self.storage)

    def discard(self, written: Iterable[str]) -> None:
        """After this save failed on some rank: remove the data files this
        rank wrote in place under their final names (the NVRx engine does),
        so that they do not hold the space the next save needs. Left alone
        when another save has taken the URI over (they are its files now) or
        when this save committed after all (a failure after the commit
        point). Best effort: a failure here is logged."""
        names = sorted(written)
        if not names:
            return
        try:
            self.check_owner()
            if not self.committed():
                self.storage.delete(names)
        except CheckpointError as e:
            log.warning("a failed save left its data files under %s in place: %s", self.storage.uri, e)

    def committed(self) -> bool:
        """Whether the URI's ``.metadata`` is this save's: its manifest is
        there and names that ``.metadata``'s CRC32C (before the commit the
        old ``.metadata`` is there, and after a later save's commit that
        save's: :mod:`.from_listing`)."""
        return read_commit(self.storage, names=[self.manifest]) is not None

    def storage_meta(self) -> StorageMeta:
        """What ``.metadata`` records about this save."""
        return StorageMeta(checkpoint_id=self.storage.uri, save_id=self.save_id)

    # -- coordinator, after every rank's data is durable ---------------------
    def publish(
        self,
        metadata: Metadata,
        results: Sequence[Sequence[WriteResult]],
        commit_files: Mapping[str, bytes] | None = None,
    ) -> None:
        """Commit: the commit files, the manifest, then ``.metadata`` last
        (the commit point), then clean up; in this process's turn at the URI
        (:func:`_turn`).

        ``metadata`` is DCP's global metadata (its ``storage_data`` and
        ``storage_meta`` are filled in here); ``results`` are every rank's
        write results, whose ``storage_data`` are :class:`ItemRecord`.
        ``commit_files``: name -> bytes of small files that belong to this
        checkpoint (see the module docstring); each is recorded in the
        manifest with its size and CRC32C.
        """
        sides = {
            commit_file_path(name, self.tag): bytes(blob) for name, blob in check_commit_files(commit_files).items()
        }
        with _turn(self.storage.uri):
            self._publish(metadata, results, sides)

    def _publish(
        self, metadata: Metadata, results: Sequence[Sequence[WriteResult]], sides: Mapping[str, bytes]
    ) -> None:
        storage_data: dict[MetadataIndex, StorageInfo] = {}
        files: dict[str, FileEntry] = {}
        items: dict[str, int] = {}
        tensors: dict[str, list[int]] = {}
        for rank_results in results:
            for wr in rank_results:
                rec: ItemRecord = wr.storage_data
                storage_data[wr.index] = StorageInfo(
                    rec.relative_path, rec.offset, rec.length, list(rec.transforms) if rec.transforms else None
                )
                files[rec.relative_path] = {"size": rec.file_size, "crc32c": rec.file_crc32c}
                key = item_key(rec.relative_path, rec.offset)
                items[key] = rec.crc32c
                if rec.raw is not None:
                    tensors[key] = list(rec.raw)
        for path, blob in sides.items():
            files[path] = {"size": len(blob), "crc32c": crc32c(blob)}
        metadata.storage_data = storage_data
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.check_owner()
            for path, side in sides.items():
                self.storage.put(path, side)
            commit_point(self.storage, self.manifest, build_manifest(files, items, crc32c(blob), tensors), blob)
        except BaseException:
            self.release()
            raise
        self._end_lease(remove=False)  # the clean-up removes the alive file with the marker
        self._promote(sides)
        self._clean_up(files.keys())

    def _promote(self, sides: Mapping[str, bytes]) -> None:
        """After the commit: copy save-unique commit files to their plain
        names, for readers that know only those. Best effort: the commit
        holds the recorded copy, which :func:`~.reading.read_commit_file` reads."""
        for path, blob in sides.items():
            name = commit_file_of(path)
            if name == path:
                continue
            try:
                self.storage.put(name, blob)
            except CheckpointError as e:
                log.warning("could not copy %s to %s: %s", self.storage.describe(path), name, e)

    def release(self) -> None:
        """The save failed (on any rank) or never finished: stop its proof of
        life and remove its alive file, so that ``gc`` may collect what it
        left (should the storage not answer, the removal is left with it
        for the saver to try again: ``Storage.leave_unfinished``).
        Coordinator; a no-op on other ranks, after :meth:`publish`, and when
        called again. ``with session:`` calls it on leaving the block, for
        writers that hold the session in one frame."""
        self._end_lease(remove=True)

    def __enter__(self) -> SaveSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _end_lease(self, *, remove: bool) -> CheckpointError | None:
        """End the save's lease, if held (``remove``: remove its alive file;
        the error, if that failed)."""
        lease, self._lease = self._lease, None
        return lease.stop(remove=remove) if lease is not None else None

    def _clean_up(self, live: Iterable[str]) -> None:
        """After the commit: delete the in-flight marker, the save's alive
        file and what the claim found that the commit does not name (the
        replaced checkpoint's data files and manifest, an earlier failed
        save's leftovers), in one request (:func:`~.publish.clean_up`)."""
        found = self._found
        if found is None:  # not claimed here: only what no commit can name
            try:
                found = frozenset(p for o in self.storage.list() if is_alive_file(p := o["path"]))
            except CheckpointError as e:
                log.warning(
                    "could not remove the in-flight marker or stale data files under %s: %s", self.storage.uri, e
                )
                return
        named = {METADATA, self.manifest, *live}
        clean_up(self.storage, {INFLIGHT, alive_name(self.save_id), *found}, named)
        # Plainly named shards are no save files (gc never takes them), so the
        # clean-up above leaves them: the claim found them in the replaced commit.
        replaced = sorted(p for p in found if is_safetensors_file(p) and not is_save_file(p) and p not in named)
        if replaced:
            try:
                self.storage.delete(replaced)
            except CheckpointError as e:
                log.warning("could not remove the replaced shards under %s: %s", self.storage.uri, e)


#: One lock per stripe of URIs (see _turn).
_TURNS = [threading.Lock() for _ in range(64)]


def _turn(uri: str) -> threading.Lock:
    """What claims and commits of one URI in this process take turns on.
    Two saves of one process to one URI (``dcp.async_save`` called again
    before the last one finished) would otherwise race where the in-flight
    marker cannot tell them apart: two claims that list a fresh URI before
    either's marker lands both choose stock DCP's names, and a claim that
    lands between a save's last ownership check and its commit loses its
    marker to that save's clean-up. Held for a listing and a put (claim) or
    the commit's few requests; across processes the marker alone decides
    (RELIABILITY.md, Known limits)."""
    return _TURNS[hash(uri) % len(_TURNS)]


def check_commit_files(commit_files: Mapping[str, bytes] | None) -> Mapping[str, bytes]:
    """``commit_files`` (None: none), each name and value checked:
    :class:`InvalidArgument` naming the first that cannot be one."""
    if commit_files is None:
        return {}
    for name, blob in commit_files.items():
        problem = commit_file_problem(name)
        if problem is not None:
            raise InvalidArgument(problem)
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"commit file {name!r} must be bytes, got {type(blob).__name__}")
    return commit_files
