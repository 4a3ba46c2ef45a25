"""Read once per team: a stored item that several ranks load is read by one.

A load in which several ranks need the same stored item (a plain tensor every
rank holds, which DCP saved once; a DTensor replicated over a mesh dimension;
a non-tensor item every rank loads) would fetch it from storage once per
rank: at thousands of data-parallel replicas, thousands of times, at the
moment the whole job waits. Instead:

* **Plan** (:func:`plan_shared_reads`, on the coordinator, inside DCP's
  global planning step). The ranks that need an item are cut into teams of
  at most :data:`TEAM_SIZE`, a host's ranks together (:func:`teams`; each
  rank's local plan carries its host, so this costs no collective), and
  each team reads the item once. Within a team, its items are split into
  contiguous runs of about equal bytes, one per member, the least-loaded
  member first; a file's neighbouring items stay together, so an owner's
  reads coalesce. On one node of up to :data:`TEAM_SIZE` ranks an item is
  read once per job; on many nodes, once per node, and the bytes cross no
  more links than they would from storage. The items are packed into rounds
  in which no rank holds more than :data:`ROUND_BYTES` for the others (read
  for them, or received; a larger item travels alone). Each rank's part of
  the schedule (:class:`SharedReads`) travels in its ``LoadPlan.storage_data``.
  Where no item is needed twice, nothing is shared and no collective runs.
* **Exchange** (:func:`exchange`, on every rank, inside ``read_data``). Per
  round, each owner reads its items from storage; every rank says whether it
  has failed (one small all-gather); each owner sends its own read buffer to
  its teammates, point to point, with no copy per receiver. This runs on a
  gloo group of the load's own (CPU tensors, whatever the job's default
  backend). Every rank then handles the bytes as if it had read them:
  CRC32C against the manifest, records checked, objects unpickled through
  the allowlist.

A rank that fails (a damaged item, a missing file) tells the others at the
next round. All ranks stop there and raise: the failed rank its own error,
the others :class:`PeerFailed` naming it. A rank that dies makes the
group's next collective fail on every other rank (gloo sees the closed
connection), which raises :class:`PeerFailed` too, never a hang.

The plan maps plan index to global rank, so sharing needs the load to run
over the whole default group (DCP's plans then come in global rank order);
a load over a smaller ``process_group`` reads as before.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan

from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import LoadError, PeerFailed
from dcpstore._impl.util.groups import BackgroundGroups
from dcpstore._impl.util.torch_compat import StorageInfo

MiB = 1 << 20
#: The most bytes one rank reads for others, or receives, in one round of
#: the exchange (what it holds at once beyond its own state).
ROUND_BYTES = 256 * MiB


@dataclass(frozen=True, order=True)
class Piece:
    """One stored item, as the load reads it whole: file, offset, length."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class Round:
    """One rank's part of one round, each list in piece order: the items it
    reads from storage (for itself and others), each of those it sends with
    the ranks it goes to, and each it receives with the rank it comes from.
    (Both ends of a pair list its pieces in the same order: the order in
    which they travel.)"""

    reads: tuple[Piece, ...] = ()
    sends: tuple[tuple[Piece, tuple[int, ...]], ...] = ()
    receives: tuple[tuple[Piece, int], ...] = ()


@dataclass(frozen=True)
class SharedReads:
    """One rank's part of a load's exchange (its ``LoadPlan.storage_data``).
    Every rank has the same number of rounds; a rank with nothing to do in
    one still takes part in its collectives."""

    world_size: int
    rounds: tuple[Round, ...]

    def pieces(self) -> set[Piece]:
        """The shared items this rank needs: they come through the exchange."""
        mine: set[Piece] = set()
        for r in self.rounds:
            mine.update(r.reads)
            mine.update(piece for piece, _ in r.receives)
        return mine


def piece_of(info: StorageInfo) -> Piece:
    return Piece(str(info.relative_path), int(info.offset), int(info.length))


def plan_shared_reads(
    plans: Sequence[LoadPlan],
    storage_data: Mapping[MetadataIndex, StorageInfo],
    hosts: Sequence[str] | None = None,
    round_bytes: int = ROUND_BYTES,
) -> list[LoadPlan]:
    """``plans`` (one per rank, in rank order) with each rank's
    :class:`SharedReads` in ``storage_data``; unchanged where no stored item
    is needed by two ranks (see the module docstring). ``hosts``: each
    rank's host (None: one host), which :func:`teams` keeps together."""
    needers: dict[Piece, set[int]] = defaultdict(set)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            needers[piece_of(storage_data[item.storage_index])].add(rank)
    on = hosts if hosts is not None else [""] * len(plans)
    groups: dict[tuple[int, ...], list[Piece]] = defaultdict(list)
    for piece, ranks in needers.items():
        if len(ranks) > 1:
            for team in teams(ranks, on):
                groups[team].append(piece)
    if not groups:
        return list(plans)
    transfers = _owners(groups, len(plans))
    rounds = _pack_rounds(transfers, len(plans), round_bytes)
    return [
        dataclasses.replace(plan, storage_data=SharedReads(len(plans), tuple(r[rank] for r in rounds)))
        for rank, plan in enumerate(plans)
    ]


#: The most ranks one read from storage serves: its owner sends to at most
#: this many less one. A node's GPUs: a state every rank of a large job holds
#: is read once per node (or per group of nodes with fewer ranks), and no
#: owner's link carries its bytes to thousands of ranks one by one.
TEAM_SIZE = 8


def teams(ranks: Iterable[int], hosts: Sequence[str], size: int = TEAM_SIZE) -> list[tuple[int, ...]]:
    """The ranks that need one item, cut into teams of at most ``size`` that
    each read it once: each host's ranks together (a host with more split
    into teams of ``size``), hosts with fewer pooled in host order. Teams of
    one are left out: such a rank reads the item itself."""
    by_host: dict[str, list[int]] = defaultdict(list)
    for rank in sorted(ranks):
        by_host[hosts[rank]].append(rank)
    out: list[list[int]] = []
    pool: list[int] = []
    for host in sorted(by_host, key=lambda h: by_host[h][0]):
        members = by_host[host]
        while len(members) >= size:
            out.append(members[:size])
            members = members[size:]
        if len(pool) + len(members) > size:
            out.append(pool)
            pool = []
        pool += members
    out.append(pool)
    return [tuple(team) for team in out if len(team) > 1]


def neighbours(pieces: Sequence[Piece], limit: int) -> list[list[Piece]]:
    """``pieces`` in file order, grouped where each starts at the end of the
    one before in the same file, up to ``limit`` bytes a group (one ranged
    read each)."""
    groups: list[list[Piece]] = []
    size = 0
    for piece in sorted(pieces):
        last = groups[-1][-1] if groups else None
        if last is not None and last.path == piece.path and last.offset + last.length == piece.offset:
            if size + piece.length <= limit:
                groups[-1].append(piece)
                size += piece.length
                continue
        groups.append([piece])
        size = piece.length
    return groups


#: One piece from its owner to the other ranks of its team.
Transfer = tuple[Piece, int, tuple[int, ...]]


def _owners(groups: Mapping[tuple[int, ...], list[Piece]], world_size: int) -> list[Transfer]:
    """Each team's items, in file order, split into one contiguous run of
    about equal bytes per member; the largest runs go to the members that
    own the fewest bytes so far. Returns the transfers in piece order."""
    load = [0] * world_size
    transfers: list[Transfer] = []
    for ranks, pieces in sorted(groups.items(), key=lambda g: -sum(p.length for p in g[1])):
        pieces = sorted(pieces)
        total = sum(p.length for p in pieces)
        members = sorted(ranks, key=lambda r: (load[r], r))
        share = total / len(members)
        done = 0
        for piece in pieces:
            member = members[min(int(done // share) if share else 0, len(members) - 1)]
            transfers.append((piece, member, tuple(r for r in ranks if r != member)))
            load[member] += piece.length
            done += piece.length
    return sorted(transfers)


def _pack_rounds(transfers: Sequence[Transfer], world_size: int, round_bytes: int) -> list[list[Round]]:
    """The transfers, in order, cut into rounds (each rank's :class:`Round`).
    Linear in the transfers' receivers: it runs on the coordinator for the
    whole job (at 16,384 ranks, a state every rank holds has as many)."""
    cut: list[list[Transfer]] = []
    held = [0] * world_size  # what each rank reads for others, or receives, this round
    for t in transfers:
        piece, src, dsts = t
        if not cut or max(held[src], *(held[d] for d in dsts)) + piece.length > round_bytes:
            cut.append([])
            held = [0] * world_size
        cut[-1].append(t)
        held[src] += piece.length
        for d in dsts:
            held[d] += piece.length
    rounds = []
    for members in cut:
        reads: list[list[Piece]] = [[] for _ in range(world_size)]
        sends: list[list[tuple[Piece, tuple[int, ...]]]] = [[] for _ in range(world_size)]
        receives: list[list[tuple[Piece, int]]] = [[] for _ in range(world_size)]
        for piece, src, dsts in members:
            reads[src].append(piece)
            sends[src].append((piece, dsts))
            for d in dsts:
                receives[d].append((piece, src))
        rounds.append([Round(tuple(reads[r]), tuple(sends[r]), tuple(receives[r])) for r in range(world_size)])
    return rounds


#: The loads' own gloo groups, one per default group (created on first use).
_GROUPS = BackgroundGroups(timeout=None, desc="dcpstore_load")


def exchange(
    share: SharedReads,
    uri: str,
    read: Callable[[Sequence[Piece]], Mapping[Piece, torch.Tensor]],
    use: Callable[[Piece, memoryview], None],
    failed: Callable[[], BaseException | None],
) -> None:
    """Run this rank's part of the exchange (every rank calls it, in step):
    per round, ``read`` the pieces this rank owns (-> their bytes, as
    contiguous uint8 tensors), tell every rank whether ``failed()`` (this
    rank's load has failed elsewhere), send and receive the bytes, and
    ``use`` each piece this rank needs. Raises this rank's own error, or
    :class:`PeerFailed` when another rank failed."""
    if not is_distributed() or dist.get_world_size() != share.world_size:
        raise LoadError(
            f"load from {uri}: the plan shares reads among {share.world_size} ranks, "
            f"but this process is not one of a group of that size"
        )
    group = _GROUPS.get(None)
    # A failure here is told to the others at the next round's all-gather,
    # never raised before it: they would wait for this rank in vain.
    used_error: BaseException | None = None
    for r in share.rounds:
        error = used_error or failed()
        blobs: Mapping[Piece, torch.Tensor] = {}
        if error is None and r.reads:
            try:
                blobs = read(r.reads)
            except BaseException as e:
                error = e
        _stop_if_any_failed(error, group, share.world_size, uri)
        received = _transfer(r, blobs, group, uri)
        try:
            for piece in r.reads:
                use(piece, _bytes_of(blobs[piece]))
            for piece, tensor in received:
                use(piece, _bytes_of(tensor))
        except BaseException as e:
            used_error = e
    if used_error is not None:
        raise used_error  # after the last round: no rank waits for this one any more


def _stop_if_any_failed(error: BaseException | None, group: Any, world_size: int, uri: str) -> None:
    flags = [torch.zeros(1, dtype=torch.uint8) for _ in range(world_size)]
    mine = torch.tensor([0 if error is None else 1], dtype=torch.uint8)
    _collective(lambda: dist.all_gather(flags, mine, group=group), uri)
    if error is not None:
        raise error
    bad = [rank for rank, flag in enumerate(flags) if int(flag.item())]
    if bad:
        raise PeerFailed(
            f"load from {uri} stopped: rank {_ranks(bad)} failed while reading items it reads for other ranks "
            "(its error says why)"
        )


def _transfer(r: Round, blobs: Mapping[Piece, torch.Tensor], group: Any, uri: str) -> list[tuple[Piece, torch.Tensor]]:
    """Each piece from its owner to the ranks that need it, point to point:
    the owner sends its own read buffer to each (no copy per receiver), and
    a pair's messages arrive in the order sent (both sides list them in
    piece order)."""
    works = []
    received = []

    def post() -> None:
        for p, dsts in r.sends:
            for dst in dsts:
                works.append(dist.isend(blobs[p], dst, group=group))
        for p, src in r.receives:
            buf = torch.empty(p.length, dtype=torch.uint8)
            works.append(dist.irecv(buf, src, group=group))
            received.append((p, buf))
        for work in works:
            if work is not None:  # None only for a rank outside the group: never here
                work.wait()

    _collective(post, uri)
    return received


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    array: Any = tensor.numpy()
    return memoryview(array).cast("B")


def _collective(call: Callable[[], object], uri: str) -> None:
    try:
        call()
    except RuntimeError as e:  # gloo: a peer closed the connection (torch.distributed.DistError is one too)
        raise PeerFailed(
            f"load from {uri} stopped: the exchange of shared reads with the other ranks failed (was a rank lost?): {e}"
        ) from e


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:4])
    return shown + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
