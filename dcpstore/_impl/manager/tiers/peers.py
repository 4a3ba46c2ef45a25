"""Peer copies: each node's share of a step also lives in the local
directories of ``local_replicas - 1`` other nodes, so that a job that lost a
node resumes from its peers' disks instead of the durable tier.

Where the copies go: node ``i`` (its place among the nodes ordered by
leader, :attr:`~.nodes.Nodes.index`) sends its share to nodes ``i + k *
jump`` (mod the node count) for ``k = 1 .. local_replicas - 1``:
``replica_jump`` spreads the copies over failure domains the user names (a
jump of 8 nodes puts them in another rack of 8), NVRx's ``replication_jump``.

Layout, in the peer's own ``local_dir``, apart from its own steps (which
stay the only ``step_*`` directories at the top, so nothing that lists
steps sees a peer copy)::

    local_dir/peers/node_0003/step_00000100/   node 3's share of step 100:
                                               its data files, then the
                                               step's manifest, ``.metadata``
                                               last (the commit protocol's
                                               :func:`~dcpstore._impl.dcp.commit.publish.publish_copy`)

A copy exists on a peer only once committed there, and each file's size and
CRC32C are checked against the manifest before it is written. The bytes move
leader to leader, point to point over gloo: on the replicator's group after
each save (in the background, beside the durable upload), on the
manager's group when a new manager finds a node without a step its peers hold
(:func:`restore_plan`): the node's own copy is written back from a peer's
(or, where no peer holds it, its ranks' files are fetched from the durable
tier, :func:`fetch`), then the load reads it locally as any node's own
copy; the copies of that step that are missing (a replacement node's, a
killed job's) are made after, on the replicator's group.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcpstore._impl.dcp.commit import Commit, delete_checkpoint, publish_copy, read_commit
from dcpstore._impl.dcp.liveness import Lease
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager.steps import DCPSTORE, step_dir
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointCorrupt, CheckpointError, InvalidArgument, SaveError
from dcpstore._impl.util.threads import Beside

log = logging.getLogger(__name__)

#: The directory under ``local_dir`` that holds the copies kept for peers.
PEERS = "peers"


def source_dir(source: int) -> str:
    """Where a node keeps the copies of node ``source``'s shares."""
    return f"{PEERS}/node_{source:04d}"


def peer_step_dir(source: int, step: int) -> str:
    return f"{source_dir(source)}/{step_dir(step)}"


def check_replica_options(replicas: object, jump: object) -> None:
    for name, value in (("local_replicas", replicas), ("replica_jump", jump)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be an int >= 1, got {value!r}")


def peers_of(index: int, count: int, replicas: int, jump: int) -> list[int]:
    """The nodes that keep copies of node ``index``'s share."""
    return [(index + k * jump) % count for k in range(1, replicas)]


def check_peers(count: int, replicas: int, jump: int, uri: str) -> None:
    """Raise :class:`InvalidArgument` unless every node's copies land on
    ``replicas - 1`` other, distinct nodes (the same on every rank)."""
    if replicas == 1:
        return
    if replicas > count:
        raise InvalidArgument(
            f"local_replicas={replicas} needs as many nodes with their own local_dir, but {uri} is "
            f"{'one directory every rank sees' if count == 1 else f'one directory on each of {count} nodes'}"
        )
    targets = peers_of(0, count, replicas, jump)
    if 0 in targets or len(set(targets)) != len(targets):
        raise InvalidArgument(
            f"replica_jump={jump} with local_replicas={replicas} over {count} nodes puts two copies of a "
            "node's share on one node; pick a jump whose multiples up to local_replicas - 1 are not "
            f"multiples of {count}"
        )


def pairs(count: int, replicas: int, jump: int) -> list[tuple[int, int]]:
    """Every (source node, peer node) of a step's replication, in one order
    every rank takes alike (point-to-point sends pair up in it)."""
    return [(s, p) for s in range(count) for p in peers_of(s, count, replicas, jump)]


def held(local: Storage, directory: str, commit: Commit) -> list[str]:
    """The data files of ``commit`` that ``directory`` holds at their size."""
    prefix = f"{directory}/"
    sizes = {o["path"][len(prefix) :]: o["size"] for o in local.list(prefix)}
    return sorted(n for n, e in commit.manifest["files"].items() if sizes.get(n) == e["size"])


#: The most bytes of a file one point-to-point send carries: a file goes in
#: pieces, so that neither side holds more of a node's share in memory.
CHUNK = 64 << 20


def send_share(
    local: Storage, directory: str, names: list[str] | None, dst: int, group: dist.ProcessGroup | None
) -> None:
    """To group rank ``dst`` (which runs :func:`receive_share`): the names
    and sizes of ``names`` in ``directory``, each file's bytes in pieces,
    then whether every read succeeded (None: nothing, the peer skips). A
    read that fails still sends its pieces (zeros), so the pairs stay in step."""
    header: list[tuple[str, int]] | None = None
    if names is not None:
        try:
            header = [(n, local.size(posixpath.join(directory, n))) for n in names]
        except CheckpointError as e:
            log.error("could not list %s to copy it to a peer node: %s", local.describe(directory), e)
    dist.send_object_list([header], group=group, group_dst=dst)
    if header is None:
        return
    ok = True
    for name, size in header:
        path = posixpath.join(directory, name)
        for offset in range(0, size, CHUNK):
            length = min(CHUNK, size - offset)
            piece = torch.zeros(length, dtype=torch.uint8)
            if ok:
                try:
                    blob = local.read_range(path, offset, length)
                    if len(blob) != length:
                        raise CheckpointError(f"short read: {len(blob)} of {length} bytes at offset {offset}")
                    piece = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
                except CheckpointError as e:
                    log.error("could not read %s to copy it to a peer node: %s", local.describe(path), e)
                    ok = False
            dist.send(piece, group=group, group_dst=dst)
    dist.send_object_list([ok], group=group, group_dst=dst)


def receive_share(
    local: Storage, directory: str, commit: Commit | None, src: int, group: dist.ProcessGroup | None, what: str
) -> bool:
    """Receive what :func:`send_share` sends from group rank ``src``: each
    file is written into ``directory`` as its pieces come, its size and
    CRC32C checked against ``commit``'s manifest before it is committed,
    then ``commit`` is committed there (under a lease, so that ``dcpstore gc``
    keeps the copy while it is written). False (logged) if anything failed:
    the directory then shows no new commit."""
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=src)
    header: list[tuple[str, int]] | None = box[0]
    if header is None:
        return False
    # Every piece is received whatever fails here: the pairs stay in step.
    error: str | None = None if commit is not None else "the peer sent no commit"
    lease: Lease | None = None
    if error is None:
        try:
            lease = Lease(local, directory)
        except CheckpointError as e:
            error = str(e)
    try:
        for name, size in header:
            entry = commit.manifest["files"].get(name) if commit is not None else None
            if error is None and (entry is None or entry["size"] != size):
                error = f"{name} from the peer is not in the manifest of the step at that size"
            writer = None
            if error is None:
                try:
                    writer = local.open_write(posixpath.join(directory, name), size_hint=size)
                except CheckpointError as e:
                    error = str(e)
            crc = 0
            for offset in range(0, size, CHUNK):
                piece = torch.empty(min(CHUNK, size - offset), dtype=torch.uint8)
                try:
                    dist.recv(piece, group=group, group_src=src)
                except BaseException:  # the sender is gone: nothing of this file stays
                    if writer is not None:
                        writer.abort()
                    raise
                if writer is not None:
                    data = piece.numpy().data
                    crc = crc32c(data, crc)
                    try:
                        writer.write(data)
                    except CheckpointError as e:
                        error = str(e)
                        writer.abort()
                        writer = None
            if writer is not None and entry is not None:
                if entry["crc32c"] != crc:
                    error = f"{name} from the peer does not match its CRC32C in the manifest"
                    writer.abort()
                else:
                    try:
                        writer.commit()
                    except CheckpointError as e:
                        error = str(e)
        dist.recv_object_list(box, group=group, group_src=src)
        if error is None and box[0] is not True:
            error = "the peer could not read its share"
        if error is None and commit is not None:
            try:
                publish_copy(local, commit, directory)
            except CheckpointError as e:
                error = str(e)
    finally:
        if lease is not None:
            lease.stop()
    if error is not None:
        log.error("could not commit %s under %s: %s", what, local.describe(directory), error)
        return False
    return True


def replicate(
    local: Storage,
    step: int,
    commit: Commit,
    index: int,
    leaders: list[int],
    replicas: int,
    jump: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Every node's leader (``index``: its node; ``leaders``: each node's
    leader's group rank): send this node's share of ``step`` to its peers,
    and commit the copies its own sources send, the two at once (a thread
    receives). Round ``k`` of each side pairs up: node ``i`` sends to ``i +
    k * jump`` while it receives from ``i - k * jump``, so every node's
    copies go at the same time, and no send waits on a receive that waits
    on it."""
    count = len(leaders)

    def receive_all() -> None:
        for source in ((index - k * jump) % count for k in range(1, replicas)):
            what = f"node {source}'s copy of step {step}"
            with _transfer(step, source, index):
                receive_share(local, peer_step_dir(source, step), commit, leaders[source], group, what)

    receiving = Beside(receive_all, name="dcpstore-peer-receive")
    try:
        names: list[str] | None = None
        try:
            names = held(local, step_dir(step), commit)
        except CheckpointError as e:
            log.error("could not list step %d under %s for its peers: %s", step, local.uri, e)
        for peer in peers_of(index, count, replicas, jump):
            with _transfer(step, index, peer):
                send_share(local, step_dir(step), names, leaders[peer], group)
    finally:
        received = receiving.wait()  # a send's error, if any, goes on from here
    if received is not None:
        raise received


@contextmanager
def _transfer(step: int, source: int, peer: int) -> Iterator[None]:
    """Raise a transfer that the process group failed (gloo: the other
    node's leader died, or went past the group's timeout) as a
    :class:`SaveError` saying which copy; the pairs after it cannot pair up."""
    try:
        yield
    except RuntimeError as e:  # torch.distributed's errors (DistBackendError is one)
        raise SaveError(
            f"the copy of node {source}'s share of step {step} from node {source} to node {peer} "
            f"(local_replicas) failed: {e}"
        ) from e


def peer_holdings(local: Storage) -> dict[int, list[int]]:
    """Per source node, the steps whose copies ``local`` holds committed."""
    found: dict[int, set[int]] = {}
    for obj in local.list(f"{PEERS}/"):
        parts = obj["path"].split("/")
        if len(parts) == 4 and parts[3] == METADATA and parts[1].startswith("node_") and parts[1][5:].isdigit():
            step = DCPSTORE.parse_step_dir(parts[2])
            if step is not None:
                found.setdefault(int(parts[1][5:]), set()).add(step)
    return {s: sorted(steps) for s, steps in found.items()}


#: A leader's view for a restore: per step it holds a commit of, the data
#: files of that commit it holds; the same per source node for its peer copies.
View = tuple[dict[int, list[str]], dict[int, dict[int, list[str]]]]


def _held_by_step(local: Storage, directory: str, steps: Iterable[int]) -> dict[int, list[str]]:
    found = {}
    for step in steps:
        where = f"{directory}/{step_dir(step)}" if directory else step_dir(step)
        commit = read_commit(local, where)
        if commit is not None:
            found[step] = held(local, where, commit)
    return found


def view(local: Storage, own_steps: Iterable[int]) -> View:
    """This directory's :data:`View` (``own_steps``: its committed steps)."""
    copies = {s: _held_by_step(local, source_dir(s), steps) for s, steps in peer_holdings(local).items()}
    return _held_by_step(local, "", own_steps), copies


#: One copy of a node's share of a step: (sending node, receiving node, the node whose share it is).
Move = tuple[int, int, int]


@dataclass(frozen=True)
class Plan:
    """What makes ``step`` whole again on every node (:func:`restore_plan`)."""

    step: int
    #: Each node that lacks its share and a peer holds a copy of: the copy comes back.
    restores: tuple[Move, ...]
    #: Each node that lacks its share and no peer holds: (a node that holds
    #: a commit of the step, the node, whose share that node's commit is
    #: kept as); the first sends the commit, the node fetches the files of
    #: its own ranks from the durable tier.
    fetches: tuple[Move, ...]
    #: The copies for peers that are missing (a replacement node's, a killed job's).
    copies: tuple[Move, ...]
    #: The same, per older step that every node holds itself and the durable
    #: tier lacks (committed before a crash: the catch-up replicates them),
    #: newest first.
    behind: tuple[tuple[int, tuple[Move, ...]], ...] = ()


def restore_plan(views: list[View], targets: list[tuple[int, int]], durable: Iterable[int] = ()) -> Plan | None:
    """From every node's view (by index) and the durable tier's steps: the
    newest step that some node holds (itself or as a copy) and every node
    holds itself, through a peer's copy or, its files missing everywhere
    else, through the durable tier; and the moves that make it whole again
    (:class:`Plan`; a share comes from a peer where one holds it). The
    ``targets`` (:func:`pairs`) whose peer lacks the copy are its copies,
    and those of the older steps newer than the durable tier's newest that
    every node holds itself (:attr:`Plan.behind`). None when there is nothing to do, no step is whole, or the durable tier
    holds a newer step (the load reads that one). A node holds a step
    itself when it holds data files of its commit, and all those of every
    peer's copy of its share (a commit without them: a replacement node
    that caught a commit up, or a node that lost files)."""
    count = len(views)
    stored = set(durable)
    copies: dict[tuple[int, int], list[tuple[int, set[str]]]] = {}  # (source, step) -> donors and their files
    for donor, (_, held_for) in enumerate(views):
        for source, steps in held_for.items():
            for step, files in steps.items():
                copies.setdefault((source, step), []).append((donor, set(files)))

    def holds(node: int, step: int) -> bool:
        mine = set(views[node][0].get(step, ()))
        return bool(mine) and all(files <= mine for _, files in copies.get((node, step), ()))

    known: set[int] = set().union(*(v[0] for v in views), (s for _, s in copies))
    whole = [s for s in known if all(holds(n, s) or (n, s) in copies or s in stored for n in range(count))]
    if not whole or max(stored, default=-1) > max(whole):
        return None
    step = max(whole)
    lacking = [n for n in range(count) if not holds(n, step)]
    restores = tuple((copies[(n, step)][0][0], n, n) for n in lacking if (n, step) in copies)
    # A node that holds the commit of the step (its own, else a copy of a share) sends it.
    commits = [(n, n) for n in range(count) if holds(n, step)]
    commits += [(d, s) for (s, t), held_by in sorted(copies.items()) if t == step for d, _ in held_by]
    sender, kept_as = (commits + [(n, n) for n in range(count) if step in views[n][0]])[0]
    fetches = tuple((sender, n, kept_as) for n in lacking if (n, step) not in copies)

    def missing(step: int) -> tuple[Move, ...]:
        return tuple((s, p, s) for s, p in targets if p not in {d for d, _ in copies.get((s, step), ())})

    newest = max(stored, default=-1)
    older = sorted((s for s in known if newest < s < step and all(holds(n, s) for n in range(count))), reverse=True)
    behind = tuple((s, moves) for s in older if (moves := missing(s)))
    if not (restores or fetches or missing(step) or behind):
        return None
    return Plan(step, restores, fetches, missing(step), behind)


def _where(node: int, owner: int, step: int) -> str:
    """Where ``node`` keeps ``owner``'s share of ``step``."""
    return step_dir(step) if node == owner else peer_step_dir(owner, step)


def _send_commit(local: Storage, directory: str, what: str) -> tuple[Commit | None, list[str] | None]:
    try:
        commit = read_commit(local, directory)
        return commit, held(local, directory, commit) if commit is not None else None
    except CheckpointError as e:
        log.error("could not read %s under %s: %s", what, local.uri, e)
        return None, None


def restore(
    local: Storage,
    step: int,
    moves: Iterable[Move],
    index: int,
    leaders: list[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Every node's leader: run ``moves`` (of a :class:`Plan`), in order: a
    sender sends the share it holds, with its commit; the receiver checks
    and writes it where it keeps that share, and commits it there."""
    for sender, receiver, owner in moves:
        if sender == index:
            directory = _where(sender, owner, step)
            commit, names = _send_commit(local, directory, f"node {owner}'s share of step {step}")
            with _transfer(step, owner, receiver):
                box = [commit if names is not None else None]
                dist.send_object_list(box, group=group, group_dst=leaders[receiver])
                send_share(local, directory, names, leaders[receiver], group)
        elif receiver == index:
            what = f"node {owner}'s share of step {step} from node {sender}"
            with _transfer(step, owner, receiver):
                box = [None]
                dist.recv_object_list(box, group=group, group_src=leaders[sender])
                done = receive_share(local, _where(receiver, owner, step), box[0], leaders[sender], group, what)
            if done:
                log.info("%s committed under %s", what, local.uri)


_RANK_FILE = re.compile(r"(?:^|/)__(\d+)_[^/]*$")


def share_of(names: Iterable[str], ranks: Iterable[int]) -> list[str]:
    """The data files of ``names`` that ``ranks`` wrote (DCP names a rank's
    files ``__{rank}_...``, in its spread directory where there is one)."""
    mine = set(ranks)
    return sorted(n for n in names if (m := _RANK_FILE.search(n)) is not None and int(m.group(1)) in mine)


def fetch(
    local: Storage,
    durable: Storage,
    step: int,
    fetches: Iterable[Move],
    index: int,
    nodes: tuple[tuple[int, ...], ...],
    group: dist.ProcessGroup | None,
) -> None:
    """Every node's leader: run the ``fetches`` of a :class:`Plan`: the donor
    sends its commit of ``step``; the node fetches the files of that commit
    its ranks wrote from the durable tier (:func:`fetch_share`)."""
    leaders = [node[0] for node in nodes]
    for donor, receiver, owner in fetches:
        box: list[Any] = [None]
        if donor == index:  # (its copy of another node's share: the node may be its own donor)
            commit, names = _send_commit(local, _where(donor, owner, step), f"step {step}")
            box = [commit if names is not None else None]
            if receiver != index:
                with _transfer(step, owner, receiver):
                    dist.send_object_list(box, group=group, group_dst=leaders[receiver])
        elif receiver == index:
            with _transfer(step, owner, receiver):
                dist.recv_object_list(box, group=group, group_src=leaders[donor])
        if receiver != index:
            continue
        if box[0] is None:
            log.error("node %d has no commit of step %d: node %d's share is not fetched", donor, step, index)
        elif fetch_share(local, durable, step, box[0], share_of(box[0].manifest["files"], nodes[receiver])):
            log.info("node %d's share of step %d fetched from %s", index, step, durable.uri)


def fetch_share(local: Storage, durable: Storage, step: int, commit: Commit, names: list[str]) -> bool:
    """Copy ``names`` of ``commit`` from the durable copy of ``step`` into
    the local one, each file's size and CRC32C checked against the manifest
    before it is committed, then commit ``commit`` there (under a lease, so
    that ``dcpstore gc`` keeps the copy while it is written). False (logged)
    if anything failed: the directory then shows no new commit."""
    directory = step_dir(step)
    if not names:
        log.error("the commit of step %d names no data file of this node's ranks; nothing fetched", step)
        return False
    try:
        lease = Lease(local, directory)
    except CheckpointError as e:
        log.error("could not fetch step %d into %s: %s", step, local.describe(directory), e)
        return False
    try:
        with ThreadPoolExecutor(min(FETCH_WORKERS, len(names)), thread_name_prefix="dcpstore-fetch") as pool:
            for future in [pool.submit(_fetch_file, local, durable, f"{directory}/{n}", commit, n) for n in names]:
                future.result()
        publish_copy(local, commit, directory)
    except CheckpointError as e:
        log.error("could not fetch this node's share of step %d into %s: %s", step, local.describe(directory), e)
        return False
    finally:
        lease.stop()
    return True


#: Files fetched from the durable tier at once.
FETCH_WORKERS = 4


def _fetch_file(local: Storage, durable: Storage, path: str, commit: Commit, name: str) -> None:
    entry = commit.manifest["files"][name]
    with local.open_write(path, size_hint=entry["size"]) as writer:
        crc = 0
        for offset in range(0, entry["size"], CHUNK):
            data = durable.read_range(path, offset, min(CHUNK, entry["size"] - offset))
            crc = crc32c(data, crc)
            writer.write(data)
        if writer.tell() != entry["size"] or crc != entry["crc32c"]:
            raise CheckpointCorrupt(
                f"{durable.describe(path)} ({writer.tell()} bytes, CRC32C {crc:#010x}) does not match the manifest "
                f"of the step ({entry['size']} bytes, CRC32C {entry['crc32c']:#010x}); not fetched"
            )


def retire(local: Storage, newest: int, keep: int, needed: Callable[[int], bool]) -> None:
    """Keep the ``keep`` newest peer copies up to ``newest`` of each source
    node; an older one goes unless ``needed`` says its step still needs
    replicating to the durable tier (a copy may be the last one that exists)."""
    try:
        holdings = peer_holdings(local)
    except CheckpointError as e:
        log.warning("retention of the peer copies under %s skipped: %s", local.uri, e)
        return
    for source, steps in holdings.items():
        for step in [s for s in steps if s <= newest][:-keep]:
            if needed(step):
                continue
            try:
                delete_checkpoint(local, peer_step_dir(source, step))
            except CheckpointError as e:
                log.warning("could not delete node %d's copy of step %d under %s: %s", source, step, local.uri, e)
