"""Copy a committed step from the local tier to the durable tier, commit last.

The durable copy of a step is made with the same commit protocol as every
dcpstore checkpoint: data files first, the integrity manifest next,
``.metadata`` last (the commit point), so the durable tier only ever lists
whole committed steps, whatever moment a crash strikes. Call order for one
step, and which rank calls what (no collective runs: the ranks meet through
the durable tier itself, so replication never touches the training's
process group from a background thread)::

    every rank    check_no_clash(durable, step, files, commit)
                      the durable tier may hold an older commit of the step
                      (an overwrite): its files are never written over
    every rank    upload_files(local, durable, step, files, expected)
                      the data files this rank's own save wrote (its
                      CheckpointInfo.files: names are never guessed),
                      streamed through the durable backend's writer (S3:
                      parallel multipart), each file's CRC32C computed on the
                      way and checked against the local manifest before the
                      object is committed (a mismatch aborts the upload)
    other ranks   write_report(durable, step, rank, entries)
                      ``.dcpstore.replica.<rank>.<random>``: what it uploaded
                      (size and CRC32C per file)
    every rank    replica_lease(durable, step), before its first upload: an
                      alive file, refreshed, so that ``dcpstore gc`` never
                      collects a replication in progress; the coordinator's
                      ends after the commit, the others' linger until they
                      see it (replica_taken_over)
    coordinator   commit_replica(local, durable, step, own, deadline)
                      waits until every file the local manifest lists is
                      either its own upload or covered by a report whose
                      size and CRC32C match the manifest, then writes the
                      manifest, then ``.metadata``; then removes the reports
                      and what an earlier commit of the step or an
                      interrupted replica left (data files and manifests
                      no longer named, alive files)

Replicating a step the durable tier already holds (the step was saved again
with ``overwrite=True``) is the overwrite of :mod:`dcpstore._impl.dcp.commit`: the
new commit's files have names the old one does not use, so until the new
``.metadata`` lands the durable step loads exactly the old copy, after it
exactly the new one; a crash in between leaves files that ``dcpstore gc``
removes.

The coordinator's own local copy must hold the manifest and ``.metadata``
(it does: the coordinator commits the local save). Other ranks check their
uploads against the manifest when their local directory holds it; where it
does not, the coordinator checks the CRCs they report. The manifest is the
one that belongs to ``.metadata`` (:func:`read_local_commit`, by the commit
protocol's rule: :mod:`dcpstore._impl.dcp.commit.from_listing`), whatever name the save
gave it, found without unpickling ``.metadata``; ``dcpstore gc`` keeps a
commit's files by the same rule. The commit protocol publishes the replica
(:func:`~dcpstore._impl.dcp.commit.publish.publish_copy`): the manifest under
that same name and the same ``.metadata`` bytes, so the durable reader,
which looks the manifest up by the save id ``.metadata`` records, finds
exactly it. By the same rule, :func:`whole_local_steps` lists the steps of
which a local directory holds a whole commit (what tiered loads and
catch-up read from).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

from dcpstore._impl.dcp.commit import Commit, publish_copy, read_commit
from dcpstore._impl.dcp.liveness import Lease
from dcpstore._impl.format.layout import METADATA, REPLICA_REPORT_PREFIX, is_replica_report
from dcpstore._impl.format.manifest import (
    MANIFEST_LIMIT,
    METADATA_LIMIT,
    FileEntry,
    Manifest,
    check_relative_name,
    read_capped,
)
from dcpstore._impl.manager.steps import parse_step_dir, step_dir
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointCorrupt, CheckpointError, SaveError, StorageNotFound

log = logging.getLogger(__name__)

#: How often the coordinator looks for the other ranks' reports.
POLL_S = 0.05
POLL_MAX_S = 1.0


def report_name(rank: int) -> str:
    """A report's name: the rank and a random part, so that no two attempts
    share one (``gc`` removes a dead attempt's by name)."""
    return f"{REPLICA_REPORT_PREFIX}{rank}.{os.urandom(4).hex()}"


def read_local_commit(local: Storage, step: int, names: Iterable[str] | None = None) -> Commit | None:
    """The commit of the copy of ``step`` under ``local`` (either tier), or
    None if there is none (no ``.metadata``, or no manifest of its own:
    node-local directories of other ranks): :func:`~dcpstore._impl.dcp.commit.from_listing.read_commit`
    of the step's directory. ``names``: the file names in it, if already listed."""
    return read_commit(local, step_dir(step), names)


def needs_replication(
    local: Storage, durable: Storage, step: int, replicas: Mapping[int, float | None], keep: int | None
) -> bool:
    """Whether the local commit of ``step`` still has to go to ``durable``,
    whose committed steps (and their ``.metadata`` times) are ``replicas``:
    missing there (and not older than its ``keep`` newest, which retention
    would delete at once), or there as an older commit (:func:`replica_is_older`)."""
    if step in replicas:
        try:
            return replica_is_older(local, durable, step, replicas[step])
        except CheckpointError as e:  # cannot tell: keep it, replicate it (its old copy is safe)
            log.warning("could not compare the local and durable copies of step %d: %s", step, e)
            return True
    return keep is None or sum(1 for d in replicas if d > step) < keep


def replica_is_older(local: Storage, durable: Storage, step: int, durable_time: float | None) -> bool:
    """Whether the durable copy of ``step`` is another commit than the local
    one and older: the step was saved again (``overwrite=True``) and that
    save's replication did not finish (a crash, a failure). A replica is
    written after the local commit it copies, so a durable ``.metadata``
    newer than the local one is that replica (or a later save's, from
    another local directory: never replaced by this older local copy);
    only an older-looking one is read and compared, since the two clocks
    (node, object store) may differ and object stores keep whole seconds."""
    prefix = step_dir(step)
    local_time = next((o.get("mtime") for o in local.list(f"{prefix}/") if o["path"] == f"{prefix}/{METADATA}"), None)
    if local_time is None or (durable_time is not None and durable_time >= local_time):
        return False
    commit = read_local_commit(local, step)
    if commit is None:
        return False
    try:
        replica = read_capped(durable, f"{prefix}/{METADATA}", METADATA_LIMIT)
    except StorageNotFound:  # retracted meanwhile
        return True
    return replica != commit.metadata_blob


def whole_local_steps(local: Storage) -> list[int]:
    """The steps of which ``local`` holds a whole committed copy: ``.metadata``,
    its manifest, and every data file the manifest names at its size."""
    found: dict[int, dict[str, int]] = {}
    for obj in local.list():
        directory, _, name = obj["path"].partition("/")
        step = parse_step_dir(directory)
        if step is not None and name and "/" not in name:
            found.setdefault(step, {})[name] = obj["size"]
    whole = []
    for step, sizes in sorted(found.items()):
        if METADATA not in sizes:
            continue
        try:
            commit = read_local_commit(local, step, sizes)
        except CheckpointError as e:
            log.warning("the local copy of step %d is not used: %s", step, e)
            continue
        if commit is not None and all(sizes.get(n) == e["size"] for n, e in commit.manifest["files"].items()):
            whole.append(step)
    return whole


def copy_file(local: Storage, durable: Storage, path: str, expected: FileEntry | None, chunk: int) -> FileEntry:
    """Stream ``path`` from ``local`` to ``durable``; its CRC32C is computed
    on the way and, if ``expected``, checked (with the size) before the
    object is committed: a mismatch raises and leaves nothing under ``path``."""
    size = local.size(path)
    with durable.open_write(path, size_hint=size) as writer:
        crc, offset = 0, 0
        while offset < size:
            data = local.read_range(path, offset, min(chunk, size - offset))
            if not data:
                break
            crc = crc32c(data, crc)
            writer.write(data)
            offset += len(data)
        got: FileEntry = {"size": offset, "crc32c": crc}
        if offset != size or (expected is not None and got != expected):
            want = expected or {"size": size, "crc32c": crc}
            raise CheckpointCorrupt(
                f"{local.describe(path)}: the local copy does not match its integrity manifest "
                f"({offset} bytes with CRC32C {crc:#010x}, manifest: {want['size']} bytes with CRC32C "
                f"{want['crc32c']:#010x}); not replicated to {durable.describe(path)}"
            )
    return got


def upload_files(
    local: Storage,
    durable: Storage,
    step: int,
    files: Iterable[str],
    expected: Manifest | None,
    workers: int,
) -> dict[str, FileEntry]:
    """Upload ``files`` (names inside the step) of ``step``, ``workers`` at a
    time; returns what was uploaded, by name. With ``expected`` every file
    must be listed in it and match it."""
    names = sorted(set(files))
    table = expected["files"] if expected is not None else None
    prefix = step_dir(step)
    for name in names:
        why = check_relative_name(name)
        if why:
            raise SaveError(f"cannot replicate {local.describe(prefix)}: file name {name!r} {why}")
        if table is not None and name not in table:
            raise CheckpointCorrupt(
                f"{local.describe(f'{prefix}/{name}')}: not listed in the local integrity manifest; not replicated"
            )
    chunk = durable.options.part_size_for(None)

    def one(name: str) -> FileEntry:
        return copy_file(local, durable, f"{prefix}/{name}", table[name] if table else None, chunk)

    if not names:
        return {}
    with ThreadPoolExecutor(max(1, min(workers, len(names))), thread_name_prefix="dcpstore-replicate") as pool:
        entries = list(pool.map(one, names))
    return dict(zip(names, entries))


def check_no_clash(durable: Storage, step: int, names: Iterable[str], commit: Commit | None) -> None:
    """Every rank, before uploading ``names`` of the local ``commit`` of
    ``step``: refuse (:class:`SaveError`, nothing uploaded) if the durable
    tier holds *another* commit of the step that names one of them, or the
    manifest's name (without a manifest: any file there): uploading would
    change a file its committed ``.metadata`` points at. An overwrite's
    local save takes save-unique names (the manager sees to it), so this
    needs two saves' random tags to meet. One listing; the commit is read
    only where the durable step is committed."""
    prefix = step_dir(step)
    listed = {o["path"][len(prefix) + 1 :] for o in durable.list(f"{prefix}/")}
    if METADATA not in listed:
        return
    old = read_local_commit(durable, step, listed)
    if old is not None and commit is not None and old.metadata_blob == commit.metadata_blob:
        return  # the same commit, replicated before (or partly: its files may be rewritten)
    kept = {*old.manifest["files"], old.manifest_name} if old is not None else listed
    ours = {*names, commit.manifest_name} if commit is not None else set(names)
    clash = sorted(ours & kept)
    if clash:
        shown = ", ".join(clash[:3]) + (", ..." if len(clash) > 3 else "")
        raise SaveError(
            f"step {step} was not replicated to {durable.describe(prefix)}: the durable tier holds another commit "
            f"of the step that uses the same file name(s) ({shown}); its copy is left as it is. Save the step "
            "again (overwrite=True: the new save picks new names)"
        )


def write_report(durable: Storage, step: int, rank: int, entries: Mapping[str, FileEntry]) -> str:
    """Tell the coordinator what this rank uploaded for ``step``; returns the
    report's path (the coordinator removes it once the replica is committed)."""
    blob = json.dumps({"files": dict(sorted(entries.items()))}, separators=(",", ":")).encode()
    path = f"{step_dir(step)}/{report_name(rank)}"
    durable.put(path, blob)
    return path


def _read_reports(durable: Storage, step: int) -> tuple[dict[str, FileEntry], dict[str, int]]:
    """The files the reports under the durable ``step`` name (checked like
    any storage content: malformed reports are ignored) and the sizes of the
    objects listed there."""
    prefix = step_dir(step)
    sizes: dict[str, int] = {}
    reports: list[str] = []
    for obj in durable.list(f"{prefix}/"):
        name = obj["path"][len(prefix) + 1 :]
        sizes[name] = obj["size"]
        if is_replica_report(name):
            reports.append(name)
    reported: dict[str, FileEntry] = {}
    for name in reports:
        try:
            data = json.loads(read_capped(durable, f"{prefix}/{name}", MANIFEST_LIMIT))
            for file, entry in data["files"].items():
                if isinstance(file, str) and type(entry.get("size")) is int and type(entry.get("crc32c")) is int:
                    reported[file] = {"size": entry["size"], "crc32c": entry["crc32c"]}
        except (CheckpointError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            continue  # half-visible or foreign: look again at the next poll
    return reported, sizes


def commit_replica(
    local: Storage,
    durable: Storage,
    step: int,
    own: Mapping[str, FileEntry],
    deadline: float,
) -> None:
    """Coordinator: once every file of the local manifest of ``step`` is in
    the durable tier, checked (``own``: uploaded and checked by this rank;
    the rest through the other ranks' reports), publish the local commit
    there: the manifest, then ``.metadata``, the commit point, then the
    clean-up. Raises :class:`SaveError` at
    ``deadline`` (``time.monotonic()``) naming the files still missing."""
    prefix = step_dir(step)
    commit = read_local_commit(local, step)
    if commit is None:
        raise CheckpointCorrupt(
            f"{local.describe(prefix)}: no {METADATA} with its integrity manifest; the local copy cannot be replicated"
        )
    wanted = commit.manifest["files"]
    for name, entry in own.items():
        if wanted.get(name) != entry:
            raise CheckpointCorrupt(f"{local.describe(f'{prefix}/{name}')}: does not match the local manifest")
    missing = sorted(set(wanted) - set(own))
    pause = POLL_S
    while missing:
        reported, sizes = _read_reports(durable, step)
        missing = [n for n in missing if not (reported.get(n) == wanted[n] and sizes.get(n) == wanted[n]["size"])]
        if not missing:
            break
        if time.monotonic() >= deadline:
            shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
            raise SaveError(
                f"step {step} was not replicated to {durable.describe(prefix)}: {len(missing)} data file(s) "
                f"({shown}) never arrived with the size and CRC32C of the local manifest (a rank that failed "
                "or was stopped); the durable tier does not list the step"
            )
        time.sleep(pause)
        pause = min(POLL_MAX_S, pause * 2)
    # The clean-up then removes the reports, the alive files and what an
    # earlier commit of the step or an interrupted replica left.
    publish_copy(durable, commit, prefix)


def replica_lease(durable: Storage, step: int) -> Lease:
    """Every rank, before its first upload of ``step``: its lease in the
    durable step directory (:mod:`dcpstore._impl.dcp.liveness.lease`), so that ``dcpstore
    gc`` keeps the replication in progress and may collect what a failed
    or killed one left. The coordinator ends it after the commit; another
    rank's lingers until it sees the commit (:func:`replica_taken_over`)."""
    return Lease(durable, step_dir(step))


def replica_taken_over(durable: Storage, step: int, report: str, commit: Commit | None) -> bool:
    """Whether another rank's uploads of ``step`` no longer need its lease:
    its ``report`` is gone (the coordinator's commit removes the reports;
    retention, or a later overwrite's commit, the whole step), or the
    durable tier holds ``commit`` (None: any commit) of the step."""
    if not durable.exists(report):
        return True
    try:
        blob = read_capped(durable, f"{step_dir(step)}/{METADATA}", METADATA_LIMIT)
    except StorageNotFound:
        return False
    return commit is None or blob == commit.metadata_blob
