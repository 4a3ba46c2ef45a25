"""The plan of a load's shared reads: who reads each item several ranks need,
and who hands it to whom (the exchange itself: tests/processes/test_shared_reads.py)."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from dcpstore._impl.dcp.shared_reads import TEAM_SIZE, Piece, SharedReads, neighbours, plan_shared_reads, teams
from dcpstore._impl.util.torch_compat import StorageInfo


def _job(needs: list[set[int]], sizes: list[int], world: int) -> tuple[list[LoadPlan], dict]:
    """Item i (size sizes[i], in file f{i % 3}) is loaded by the ranks needs[i]."""
    storage_data = {}
    items: list[list[ReadItem]] = [[] for _ in range(world)]
    offsets: Counter[str] = Counter()
    for i, (ranks, size) in enumerate(zip(needs, sizes)):
        index = MetadataIndex(f"k{i}", torch.Size([0]))
        path = f"f{i % 3}"
        storage_data[index] = StorageInfo(path, offsets[path], size)
        offsets[path] += size
        for rank in ranks:
            items[rank].append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=index,
                    dest_offsets=torch.Size([0]),
                    storage_index=index,
                    storage_offsets=torch.Size([0]),
                    lengths=torch.Size([size]),
                )
            )
    return [LoadPlan(list(i)) for i in items], storage_data


def test_nothing_needed_twice_leaves_the_plans_as_they_are() -> None:
    plans, data = _job([{0}, {1}, {2}, {2}], [10, 20, 30, 40], 3)
    assert [p.storage_data for p in plan_shared_reads(plans, data)] == [None, None, None]


def test_items_every_rank_needs_are_read_once_and_spread_evenly() -> None:
    plans, data = _job([{0, 1, 2, 3}] * 8, [100] * 8, 4)
    shares = [p.storage_data for p in plan_shared_reads(plans, data)]
    reads = Counter(rank for rank, s in enumerate(shares) for r in s.rounds for _ in r.reads)
    assert reads == {0: 2, 1: 2, 2: 2, 3: 2}


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(2, 20),
    data=st.data(),
    round_bytes=st.sampled_from([50, 200, 10_000]),
)
def test_every_needed_item_reaches_every_rank_that_needs_it_exactly_once(
    world: int, data: st.DataObject, round_bytes: int
) -> None:
    hosts = data.draw(st.none() | st.lists(st.sampled_from("abc"), min_size=world, max_size=world))
    n = data.draw(st.integers(1, 12))
    needs = [data.draw(st.sets(st.integers(0, world - 1), min_size=1)) for _ in range(n)]
    sizes = [data.draw(st.integers(1, 120)) for _ in range(n)]
    plans, storage = _job(needs, sizes, world)
    out = plan_shared_reads(plans, storage, hosts, round_bytes=round_bytes)
    assert [p.items for p in out] == [p.items for p in plans]  # what each rank loads is unchanged
    shares = [p.storage_data for p in out]
    pieces = [Piece(str(i.relative_path), i.offset, i.length) for i in storage.values()]
    on = hosts or [""] * world
    shared = {p: ranks for p, ranks in zip(pieces, needs) if teams(ranks, on)}
    if not shared:
        assert shares == [None] * world
        return
    assert all(isinstance(s, SharedReads) for s in shares)
    rounds = {len(s.rounds) for s in shares}
    assert len(rounds) == 1  # every rank takes part in every round
    for rank, s in enumerate(shares):
        in_a_team = {p for p, ranks in shared.items() for team in teams(ranks, on) if rank in team}
        assert s.pieces() == in_a_team  # the rest it reads itself
        received = [p for r in s.rounds for p, _ in r.receives]
        read = [p for r in s.rounds for p in r.reads]
        assert sorted(received + read) == sorted(in_a_team)  # each exactly once: read or received
    for k in range(rounds.pop()):
        got: Counter[int] = Counter()
        for rank, s in enumerate(shares):
            r = s.rounds[k]
            for p, dsts in r.sends:
                assert p in r.reads and rank not in dsts  # an owner sends what it read, to others
                for dst in dsts:
                    assert (p, rank) in shares[dst].rounds[k].receives  # the receiver expects it from the owner
                    got[dst] += p.length
            # Both ends of each pair list its pieces in the same (piece) order.
            assert [p for p, _ in r.sends] == sorted(p for p, _ in r.sends)
            assert [p for p, _ in r.receives] == sorted(p for p, _ in r.receives)
            for p in r.reads:
                assert rank in shared[p]  # the owner needs the item itself
                (team,) = [t for t in teams(shared[p], on) if rank in t]
                assert {d for q, dsts in r.sends if q == p for d in dsts} == set(team) - {rank}  # it serves its team
        # What a rank holds at once for the others: what it read for them, and what it received.
        largest = max(p.length for p in shared)
        held = [sum(p.length for p in s.rounds[k].reads) for s in shares]
        assert max(held) <= max(round_bytes, largest)
        assert max(got.values(), default=0) <= max(round_bytes, largest)
    owners = Counter(p for s in shares for r in s.rounds for p in r.reads)
    assert owners == {p: len(teams(ranks, on)) for p, ranks in shared.items()}  # once per team


def test_neighbouring_pieces_of_one_file_are_read_together_up_to_the_limit() -> None:
    a, b, c = Piece("f", 0, 10), Piece("f", 10, 10), Piece("f", 20, 10)
    far, other = Piece("f", 100, 5), Piece("g", 30, 10)
    assert neighbours([c, far, a, other, b], 100) == [[a, b, c], [far], [other]]
    assert neighbours([a, b, c], 20) == [[a, b], [c]]


def test_teams_keep_a_hosts_ranks_together_and_read_once_per_team() -> None:
    hosts = ["a"] * 10 + ["b"] * 3 + ["c"] * 3 + ["d"]
    assert TEAM_SIZE == 8
    assert teams(range(17), hosts) == [
        tuple(range(8)),  # a: a whole team
        tuple(range(8, 16)),  # a's other two, pooled with b's and c's three
    ]  # d's one rank is left to read for itself
    assert teams([0, 12], hosts) == [(0, 12)]  # two hosts' ranks still share one read
    assert teams([3], hosts) == []  # one rank reads for itself


def test_a_job_with_replicated_state_on_many_nodes_reads_it_once_per_node() -> None:
    world = 64
    hosts = [f"node{r // 8}" for r in range(world)]
    plans, data = _job([set(range(world))] * 4, [100] * 4, world)
    shares = [p.storage_data for p in plan_shared_reads(plans, data, hosts)]
    reads = Counter(p for s in shares for r in s.rounds for p in r.reads)
    assert set(reads.values()) == {8}  # 8 nodes, each item once on each
    for rank, s in enumerate(shares):  # and every hand-over stays on its node
        assert all(hosts[src] == hosts[rank] for r in s.rounds for _, src in r.receives)
