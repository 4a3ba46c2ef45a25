"""Checkpoints at rest, without reading what they hold: list them, and
remove what interrupted saves left (``dcpstore ls`` and ``dcpstore gc``).

Works on file names, sizes and times (and a running save's small alive
file), on every backend through :class:`~dcpstore._impl.storage.base.Storage`.
It never imports torch, so that those two commands start in a fraction of
the time of ``import torch``; reading a checkpoint's content (``inspect``,
``verify``) is :mod:`dcpstore._impl.tools.maintenance`, which re-exports these names.
Which files are a save's leftovers, which a commit makes stale, which
manifest belongs to a commit, and removing them are the commit protocol's
(:mod:`dcpstore._impl.dcp.commit`, whose torch-free modules these are).
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass, field

from dcpstore._impl.dcp.commit import read_commit
from dcpstore._impl.dcp.liveness import alive_tag, is_leftover, is_marker, remove_leftovers, several_saves, unnamed
from dcpstore._impl.dcp.liveness.alive_file import LEASE_S, decode_owner, is_alive_file, is_running, write_is_stale
from dcpstore._impl.format.layout import METADATA, checkpoint_dir, is_commit_file, name_tag, split_data_path
from dcpstore._impl.format.manifest import SMALL_FILE_LIMIT, read_capped
from dcpstore._impl.storage import Storage
from dcpstore._impl.storage.base import ObjectInfo
from dcpstore._impl.storage.uri import join_uri, parse_uri
from dcpstore._impl.util.errors import CheckpointError, StorageNotFound
from dcpstore._impl.util.units import check_seconds


@dataclass
class CheckpointEntry:
    """One checkpoint (committed or not) found under a root."""

    path: str  # relative to the listed root ("" for the root itself)
    committed: bool
    #: Every file of the checkpoint (data files, ``.metadata``, the manifest,
    #: markers), and their total size.
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
    #: Committed, and holding data files or manifests of more than one save
    #: (an overwrite killed between its commit and its clean-up, or a save
    #: that failed beside the commit).
    mixed: bool = False
    #: The names of every file in the directory.
    names: list[str] = field(default_factory=list)

    def running(self, storage: Storage, older_than_s: float = 0.0) -> bool:
        """Whether a save is (or may still be) writing here: an alive file
        that does not name a process of this machine that has ended and was
        refreshed within max(``older_than_s``, the lease), or one listed that
        is gone now (its save just ended: what it committed, if anything, is
        newer than the listing; see :mod:`dcpstore._impl.dcp.liveness.alive_file`). Reads
        each alive file (small, capped)."""
        for path, age in self.alive:
            try:
                owner = decode_owner(read_capped(storage, path, SMALL_FILE_LIMIT))
            except StorageNotFound:
                return True
            except CheckpointError:
                owner = None  # unreadable: judged by its age alone
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
        if not any(is_commit_file(n) or is_leftover(n) for n in names):
            continue
        entry = CheckpointEntry(directory, committed=any(is_commit_file(n) for n in names))
        entry.rank_local = entry.committed and METADATA not in names
        for name, obj in sorted(names.items()):
            if not (is_commit_file(name) or is_leftover(name)):
                entry.unknown.append(obj["path"])
                continue
            entry.files += 1
            entry.bytes += obj["size"]
            mtime = obj.get("mtime")
            if mtime is not None:
                entry.newest_mtime = max(entry.newest_mtime or 0.0, mtime)
            if is_alive_file(name):
                entry.alive.append((obj["path"], None if mtime is None else now - mtime))
            # A committed checkpoint only ever loses our markers (and, see
            # gc, files its commit does not name); an uncommitted one
            # everything a save left.
            if not entry.committed or is_marker(name) or is_alive_file(name):
                entry.leftovers.append(obj["path"])
        entry.names = sorted(names)
        entry.mixed = entry.committed and several_saves(names)
        entries.append(entry)
    return sorted(entries, key=lambda e: e.path)


def _commit_files(storage: Storage, names: list[str]) -> set[str] | None:
    """The files a committed directory's commit consists of
    (:attr:`~dcpstore._impl.dcp.commit.from_listing.Commit.files`). None when no manifest
    belongs to its ``.metadata`` (stock DCP's commit, or damage) or the
    directory holds stock DCP's rank-local commits beside ``.metadata``:
    then nothing is known to be stale. Reads ``.metadata``'s bytes and the
    manifests (checked JSON), never unpickles anything."""
    if any(is_commit_file(n) and n != METADATA for n in names):
        return None
    try:
        commit = read_commit(storage, names=names, skip_damaged=True)
    except CheckpointError:
        return None
    return None if commit is None else set(commit.files)


@dataclass
class TierRow:
    """A checkpoint of a tiered manager's two roots (``dcpstore ls --local-dir``)."""

    entry: CheckpointEntry
    #: The root ``entry`` was found under (to ask whether a save is running there).
    storage: Storage
    #: ``local``, ``durable``, or ``both`` when committed in both tiers.
    where: str


def list_tiers(durable: Storage, local: Storage) -> list[TierRow]:
    """The checkpoints of a tiered manager's durable root and local directory,
    by path: a step committed in both tiers is one row (``both``, its durable
    entry); uncommitted copies keep a row each. Never reads checkpoint content."""
    rows = [TierRow(e, durable, "durable") for e in list_checkpoints(durable)]
    rows += [TierRow(e, local, "local") for e in list_checkpoints(local)]
    committed_in: dict[str, set[str]] = {}
    for row in rows:
        if row.entry.committed:
            committed_in.setdefault(row.entry.path, set()).add(row.where)
    merged = []
    for row in rows:
        if row.entry.committed and len(committed_in[row.entry.path]) == 2:
            if row.where == "local":
                continue
            row.where = "both"
        merged.append(row)
    return sorted(merged, key=lambda r: (r.entry.path, r.where))


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
    ``__{rank}.metadata``); in a committed checkpoint, stale in-flight
    markers and the data files and manifests its commit does not name (of
    the checkpoint an overwrite replaced, or of a save that failed beside
    it; known from the manifest that records ``.metadata``'s CRC32C); and
    the backend's in-progress leftovers (temporary files, open multipart
    uploads). Kept: anything modified within ``older_than_s``
    seconds; a directory where a save is running, and its in-progress
    writes; any in-progress write younger than the lease -- whatever
    ``older_than_s`` says (:mod:`dcpstore._impl.dcp.liveness.alive_file` is the rule); a
    directory holding files no DCP save writes. A committed checkpoint
    never loses a file it needs. Never unpickles anything.

    Raises:
        InvalidArgument: ``older_than_s`` is not a number of seconds >= 0
            (infinity keeps everything).
    """
    older_than_s = check_seconds("older_than_s", older_than_s, zero=True, infinite=True)
    report = GcReport()
    now = time.time()
    # In-progress writes first, the checkpoints after: a write listed here
    # belongs to a save whose alive file the listing below shows.
    writes = storage.incomplete_writes()
    doomed: list[str] = []
    markers: dict[str, list[str]] = {}
    for entry in list_checkpoints(storage):
        if not (entry.leftovers or entry.mixed):
            continue
        label = entry.path or "."
        if entry.unknown and not entry.committed:
            report.kept_unknown.append((label, entry.unknown))
            continue
        live = None
        if entry.committed and (entry.mixed or entry.alive):
            live = _commit_files(_under(storage, entry.path) if entry.path else storage, entry.names)
        if live is not None:  # the save that committed is not running, whatever its alive file says
            done = {name_tag(n) for n in live} - {None, ""}
            entry.alive = [a for a in entry.alive if alive_tag(a[0]) not in done]
        if entry.running(storage, older_than_s):
            report.kept_running.append(label)
            continue
        if (
            entry.newest_mtime is None
            and older_than_s > 0
            or (entry.newest_mtime is not None and now - entry.newest_mtime < older_than_s)
        ):
            report.kept_recent.append(label)
            continue
        doomed.extend(p for p in entry.leftovers if not is_marker(posixpath.basename(p)))
        if any(map(is_marker, entry.names)):
            markers[entry.path] = entry.names
        if not entry.committed:
            report.removed.append(label)
        elif entry.mixed and live is not None:  # and files its commit does not name
            stale = [posixpath.join(entry.path, n) for n in unnamed(entry.names, live)]
            doomed.extend(stale)
            report.removed.extend(stale)
    running = ["" if label == "." else label for label in report.kept_running]
    idle = [w for w in writes if write_is_stale(w.age_s, older_than_s) and not _in_running(w.path, running)]
    if dry_run:
        report.incomplete_uploads = len(idle)
        return report
    # Markers last: deletes remove the directories they empty.
    report.incomplete_uploads = storage.remove_incomplete(idle, max(older_than_s, LEASE_S))
    remove_leftovers(storage, doomed, markers)
    return report


def _in_running(path: str, running: list[str]) -> bool:
    """Whether the in-progress write ``path`` lies in (or above: the root's
    own) a directory where a save is running. A spread save's pieces lie in
    ``p{hex}/`` below its checkpoint: they are that checkpoint's."""
    directory = checkpoint_dir(posixpath.dirname(path))
    return any(not r or not directory or directory == r or directory.startswith(r + "/") for r in running)


def _under(storage: Storage, directory: str) -> Storage:
    """The same backend and options, rooted at ``directory`` of ``storage``."""
    return type(storage)(parse_uri(join_uri(storage.url.uri, *directory.split("/"))), storage.options)
