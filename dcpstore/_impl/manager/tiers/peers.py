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
each save (in the background, before the durable replication), on the
manager's group when a new manager finds a node without a step its peers hold
(:func:`restore_plan`): the node's own copy is written back from a peer's,
then the load reads it locally as any node's own copy, and the copies of
that step that are missing (a replacement node's, a killed job's) are made.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Iterable
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from dcpstore._impl.dcp.commit import Commit, delete_checkpoint, publish_copy, read_commit
from dcpstore._impl.dcp.liveness import Lease
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager.steps import DCPSTORE, step_dir
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import CheckpointError, InvalidArgument

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


def read_files(local: Storage, directory: str, names: Iterable[str]) -> list[tuple[str, bytes]] | None:
    """``names`` in ``directory``, read whole (None, logged, if one cannot be)."""
    try:
        return [(n, local.read(posixpath.join(directory, n))) for n in names]
    except CheckpointError as e:
        log.error("could not read %s to copy it to a peer node: %s", local.describe(directory), e)
        return None


def send_files(files: list[tuple[str, bytes]] | None, dst: int, group: dist.ProcessGroup | None) -> None:
    """To group rank ``dst`` (which runs :func:`receive_files`): the names
    and sizes, then each file's bytes (None: nothing, the peer skips)."""
    header = None if files is None else [(n, len(b)) for n, b in files]
    dist.send_object_list([header], group=group, group_dst=dst)
    for _, blob in files or ():
        if blob:
            dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), group=group, group_dst=dst)


def receive_files(src: int, group: dist.ProcessGroup | None) -> list[tuple[str, bytes]] | None:
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=src)
    header: list[tuple[str, int]] | None = box[0]
    if header is None:
        return None
    files = []
    for name, size in header:
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.recv(buf, group=group, group_src=src)
        files.append((name, buf.numpy().tobytes()))
    return files


def write_copy(local: Storage, directory: str, commit: Commit, files: list[tuple[str, bytes]], what: str) -> bool:
    """Write ``files`` into ``directory`` after checking each against
    ``commit``'s manifest, then commit ``commit`` there; False (logged) if
    any check or write fails (the directory then shows no new commit)."""
    try:
        entries = commit.manifest["files"]
        for name, blob in files:
            entry = entries.get(name)
            if entry is None or entry["size"] != len(blob) or entry["crc32c"] != crc32c.crc32c(blob):
                raise CheckpointError(f"{name} from the peer does not match the manifest of the step")
        lease = Lease(local, directory)  # dcpstore gc keeps the copy while it is written
        try:
            for name, blob in files:
                local.put(posixpath.join(directory, name), blob)
            publish_copy(local, commit, directory)
        finally:
            lease.stop()
        return True
    except CheckpointError as e:
        log.error("could not commit %s under %s: %s", what, local.describe(directory), e)
        return False


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
    and commit the copies its own sources send (:func:`pairs`)."""
    own: list[tuple[str, bytes]] | None = None
    for source, peer in pairs(len(leaders), replicas, jump):
        if source == index:
            if own is None:
                try:
                    own = read_files(local, step_dir(step), held(local, step_dir(step), commit))
                except CheckpointError as e:
                    log.error("could not list step %d under %s for its peers: %s", step, local.uri, e)
            send_files(own, leaders[peer], group)
        elif peer == index:
            files = receive_files(leaders[source], group)
            if files is not None:
                write_copy(local, peer_step_dir(source, step), commit, files, f"node {source}'s copy of step {step}")


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


def restore_plan(views: list[View], targets: list[tuple[int, int]]) -> tuple[int, list[Move]] | None:
    """From every node's view (by index): the newest step every node holds
    itself or through a peer's copy, and the copies that make it whole
    again: first each node that lacks its share gets it back from a peer
    that holds a copy, then each (source, peer) of ``targets``
    (:func:`pairs`) whose peer lacks the copy gets it from the source (the
    copies a replacement node held for others, or those a killed job did
    not make). None when there is nothing to copy or no step is whole. A
    node holds a step itself when it holds data files of its commit, and
    all those of every peer's copy of its share (a commit without them: a
    replacement node that caught a commit up, or a node that lost files)."""
    count = len(views)
    copies: dict[tuple[int, int], list[tuple[int, set[str]]]] = {}  # (source, step) -> donors and their files
    for donor, (_, held_for) in enumerate(views):
        for source, steps in held_for.items():
            for step, files in steps.items():
                copies.setdefault((source, step), []).append((donor, set(files)))

    def holds(node: int, step: int) -> bool:
        mine = set(views[node][0].get(step, ()))
        return bool(mine) and all(files <= mine for _, files in copies.get((node, step), ()))

    known: set[int] = set().union(*(v[0] for v in views), (s for _, s in copies))
    whole = [s for s in known if all(holds(n, s) or (n, s) in copies for n in range(count))]
    if not whole:
        return None
    step = max(whole)
    moves = [(copies[(n, step)][0][0], n, n) for n in range(count) if not holds(n, step)]
    moves += [(s, p, s) for s, p in targets if p not in {d for d, _ in copies.get((s, step), ())}]
    return (step, moves) if moves else None


def _where(node: int, owner: int, step: int) -> str:
    """Where ``node`` keeps ``owner``'s share of ``step``."""
    return step_dir(step) if node == owner else peer_step_dir(owner, step)


def restore(
    local: Storage,
    step: int,
    moves: list[Move],
    index: int,
    leaders: list[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Every node's leader: run ``moves`` of :func:`restore_plan`, in order:
    a sender sends the share it holds, with its commit; the receiver checks
    and writes it where it keeps that share, and commits it there."""
    for sender, receiver, owner in moves:
        if sender == index:
            directory = _where(sender, owner, step)
            commit: Commit | None = None
            files = None
            try:
                commit = read_commit(local, directory)
                if commit is not None:
                    files = read_files(local, directory, held(local, directory, commit))
            except CheckpointError as e:
                log.error("could not read node %d's share of step %d under %s: %s", owner, step, local.uri, e)
            dist.send_object_list([commit], group=group, group_dst=leaders[receiver])
            send_files(files if commit is not None else None, leaders[receiver], group)
        elif receiver == index:
            box: list[Any] = [None]
            dist.recv_object_list(box, group=group, group_src=leaders[sender])
            got: Commit | None = box[0]
            files = receive_files(leaders[sender], group)
            what = f"node {owner}'s share of step {step} from node {sender}"
            if (
                got is not None
                and files is not None
                and write_copy(local, _where(receiver, owner, step), got, files, what)
            ):
                log.info("%s committed under %s", what, local.uri)


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
