"""Tiered checkpoints with node-local directories: one ``local_dir`` per node.

Real gloo jobs whose "nodes" are separate directories (two nodes of two
ranks, or two of one): each node's directory must hold the files its own
ranks wrote plus the same commit (``.metadata`` and manifest) as the
coordinator's, and nothing half-written; the durable tier whole steps that
stock DCP loads; a load reads the local tier only when every rank's node
holds what that rank reads, else the durable copy, else an older step;
catch-up, overwrites and retention work per node; and the ownership check
still fails a save whose step another save took over on a node.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.multiprocessing.spawn import ProcessExitedException

import dcpstore
from dcpstore._impl.format.layout import INFLIGHT, METADATA, name_tag
from dcpstore._impl.manager import step_dir
from dcpstore._impl.manager.tiers.nodes import PROBE_PREFIX, nodes_from_views
from dcpstore._impl.manager.tiers.replicate import read_local_commit
from dcpstore._impl.tools.maintenance import gc
from tests.support import extras, killcount
from tests.support.backends import Target, make_target, save_options
from tests.support.crashkit import age_temp_files
from tests.support.dist_utils import run_ranks
from tests.support.faults import hook_all_storage, spread
from tests.support.tiered_kit import full, gc_keeps_running

ROWS = 64

#: In the name of the local backend's temporary files (a write not yet renamed).
TEMP_MARK = ".dcpstore-tmp-"


def sharded(world: int, step: int, *, scalar: bool) -> dict[str, Any]:
    """Shard(0) tensors only (every rank reads just what it wrote), or with a
    replicated scalar too (DCP stores it in one rank's file)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {
        "w": distribute_tensor(full(step), mesh, [Shard(0)]),
        "b": distribute_tensor(full(step)[:, :5].contiguous() * 2, mesh, [Shard(0)]),
    }
    if scalar:
        state["step"] = step
    return state


def node_dirs(tmp_path: Path, world: int, per_node: int) -> list[str]:
    return [str(tmp_path / f"node{rank // per_node}") for rank in range(world)]


def check(state: dict[str, Any], step: int, *, scalar: bool) -> None:
    assert torch.equal(state["w"].full_tensor(), full(step))
    assert torch.equal(state["b"].full_tensor(), full(step)[:, :5] * 2)
    if scalar:
        assert state["step"] == step


def zeros(world: int, scalar: bool) -> dict[str, Any]:
    state = sharded(world, 0, scalar=scalar)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.to_local().zero_()
    if scalar:
        state["step"] = -1
    return state


def durable_metadata(durable: Target, step: int) -> bytes:
    root = dcpstore.open_storage(durable.uri, **durable.kwargs)
    try:
        return root.read(f"{step_dir(step)}/{METADATA}")
    finally:
        root.close()


def durable_steps(durable: Target) -> list[int]:
    return dcpstore.CheckpointManager(durable.uri, options=durable.save_options(async_=True)).all_steps()


def assert_node_holds(node: Path, durable: Target, step: int, ranks: set[int], *, killed: bool = False) -> None:
    """``node`` holds ``step``'s commit (the durable ``.metadata``'s bytes),
    the data files of ``ranks`` and nothing else: no marker, no other
    rank's file, no probe (``killed``: but maybe the temporary file of a
    write a SIGKILL cut short, which ``dcpstore gc`` removes)."""
    here = node / step_dir(step)
    assert (here / METADATA).read_bytes() == durable_metadata(durable, step)
    storage = dcpstore.open_storage(str(node))
    try:
        commit = read_local_commit(storage, step)
    finally:
        storage.close()
    assert commit is not None
    data = {n for n in commit.manifest["files"] if int(n.split("_")[2]) in ranks}
    assert data, "a node holds its own ranks' files"
    names = {p.name for p in here.iterdir() if not (killed and TEMP_MARK in p.name)}
    assert names == {METADATA, commit.manifest_name, *data}, names
    assert INFLIGHT not in names and not list(node.glob(f"{PROBE_PREFIX}*"))
    assert all(name_tag(n) for n in data), "node-local saves use save-unique names"


# -- save, replicate, retention, load ------------------------------------------


def _save_and_load(
    rank: int, world: int, durable: str, dirs: list[str], scalar: bool, kwargs: dict[str, Any] | None = None
) -> None:
    options = save_options({"async_": True, "workers": 2, **(kwargs or {})})
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], keep=2, local_keep=2, options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(sharded(world, step, scalar=scalar), step)
        mgr.wait()
        dist.barrier()
        assert mgr.all_steps() == [2, 3]
        assert mgr.latest_step() == 3
        state = zeros(world, scalar)
        assert mgr.load(state) == 3
        check(state, 3, scalar=scalar)
        state = zeros(world, scalar)
        assert mgr.load(state, 2) == 2
        check(state, 2, scalar=scalar)


@pytest.mark.parametrize(
    ("backend", "world", "per_node", "engine"),
    [
        ("local", 2, 1, "native"),
        ("local", 4, 2, "native"),
        ("local", 2, 1, "nvrx"),
        ("s3", 2, 1, "native"),
        ("msc", 2, 1, "native"),
    ],
    ids=["local-2x1", "local-2x2", "local-2x1-nvrx", "s3-2x1", "msc-2x1"],
)
def test_each_node_commits_its_share_and_the_durable_tier_is_whole(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, world: int, per_node: int, engine: str
) -> None:
    if engine == "nvrx":
        extras.skip_unless(extras.NVRX)
    durable = make_target(backend, request)
    dirs = node_dirs(tmp_path, world, per_node)
    run_ranks(_save_and_load, world, durable.uri, dirs, True, {"engine": engine, **durable.kwargs})
    for n in range(world // per_node):
        node = tmp_path / f"node{n}"
        assert sorted(p.name for p in node.glob("step_*")) == [step_dir(2), step_dir(3)]  # local_keep=2, per node
        for step in (2, 3):
            assert_node_holds(node, durable, step, set(range(n * per_node, (n + 1) * per_node)))
    assert durable_steps(durable) == [2, 3]
    for step in (2, 3):  # one process reads the durable copy back (stock DCP too, where it can)
        dest = {"w": torch.zeros(ROWS, 24), "b": torch.zeros(ROWS, 5), "step": 0}
        if backend == "local":
            dcp.load(dest, checkpoint_id=f"{durable.uri}/{step_dir(step)}", no_dist=True)
        else:
            dcpstore.load(dest, f"{durable.uri}/{step_dir(step)}", **durable.kwargs)
        assert torch.equal(dest["w"], full(step)) and dest["step"] == step


def _load(rank: int, world: int, durable: str, dirs: list[str], scalar: bool, expect: int) -> None:
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank]) as mgr:
        state = zeros(world, scalar)
        assert mgr.load(state) == expect
        check(state, expect, scalar=scalar)


def _damage(root: Path, step: int) -> dict[Path, bytes]:
    """Zero every data file of ``step`` under ``root`` at its size; returns the old bytes."""
    saved = {}
    for data in (root / step_dir(step)).glob("*.distcp"):
        saved[data] = data.read_bytes()
        data.write_bytes(b"\0" * len(saved[data]))
    return saved


def test_a_load_reads_each_nodes_own_copy_when_every_rank_holds_what_it_reads(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_and_load, 2, str(durable), dirs, False)
    _damage(durable, 3)  # the durable copy is damaged: only the local copies can give step 3
    run_ranks(_load, 2, str(durable), dirs, False, 3)


def test_a_load_that_reads_another_nodes_file_reads_the_durable_copy(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_and_load, 2, str(durable), dirs, True)
    for n in (0, 1):  # the replicated scalar lives in one rank's file: the local copies are not read
        _damage(tmp_path / f"node{n}", 3)
    run_ranks(_load, 2, str(durable), dirs, True, 3)


def test_a_fresh_node_resumes_from_the_durable_tier(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_and_load, 2, str(durable), dirs, False)
    dirs[1] = str(tmp_path / "replacement")  # node 1 was replaced: an empty local_dir
    _damage(tmp_path / "node0", 3)  # node 0's copy must not be read either
    run_ranks(_load, 2, str(durable), dirs, False, 3)


def _save_every_other(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], replicate_every=2, async_=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(sharded(world, step, scalar=False), step)
        mgr.wait()


def test_a_step_a_lost_node_held_gives_way_to_an_older_one(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_every_other, 2, str(durable), dirs)
    assert sorted(p.name for p in durable.glob("step_*")) == [step_dir(2)]
    # Unselected steps still commit on every node.
    assert all((tmp_path / f"node{n}" / step_dir(s) / METADATA).exists() for n in (0, 1) for s in (1, 2, 3))
    for data in (tmp_path / "node1" / step_dir(3)).glob("*.distcp"):
        data.unlink()  # node 1 lost its share of step 3, which only the local tier had
    run_ranks(_load, 2, str(durable), dirs, False, 2)


# -- catch-up and overwrite ------------------------------------------------------


def _save_unreplicated(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    import dcpstore._impl.manager.tiers.tiered as tiered

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise dcpstore.StorageError("injected: the object store is unreachable")

    tiered.upload_files = broken  # type: ignore[assignment]
    mgr = dcpstore.CheckpointManager(durable, local_dir=dirs[rank], async_=False, replicate_timeout_s=3.0)
    for step in (1, 2):
        mgr.save(sharded(world, step, scalar=True), step)
    with pytest.raises(dcpstore.SaveError):
        mgr.wait()
    mgr.close()


def _catch_up(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank]) as mgr:
        mgr.wait()


def test_a_new_manager_replicates_what_every_node_committed(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 4, 2)
    run_ranks(_save_unreplicated, 4, str(durable), dirs)
    assert not list(durable.glob(f"step_*/{METADATA}"))
    assert all((tmp_path / f"node{n}" / step_dir(s) / METADATA).exists() for n in (0, 1) for s in (1, 2))
    run_ranks(_catch_up, 4, str(durable), dirs)
    for step in (1, 2):
        for n in (0, 1):
            assert_node_holds(tmp_path / f"node{n}", Target("local", str(durable)), step, {2 * n, 2 * n + 1})
        dest = {"w": torch.zeros(ROWS, 24), "b": torch.zeros(ROWS, 5), "step": 0}
        dcpstore.load(dest, str(durable / step_dir(step)))
        assert torch.equal(dest["w"], full(step)) and dest["step"] == step


def _overwrite(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank]) as mgr:
        mgr.save(sharded(world, 1, scalar=True), 1)
        mgr.wait()
        with pytest.raises(dcpstore.CheckpointExists):
            mgr.save(sharded(world, 7, scalar=True), 1)
        mgr.save(sharded(world, 7, scalar=True), 1, overwrite=True)
        mgr.wait()
        state = zeros(world, True)
        assert mgr.load(state) == 1
        check(state, 7, scalar=True)


def test_an_overwrite_replaces_the_step_on_every_node_and_in_the_durable_tier(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_overwrite, 2, str(durable), dirs)
    for n in (0, 1):
        assert_node_holds(tmp_path / f"node{n}", Target("local", str(durable)), 1, {n})  # the old files are gone
    dest = {"w": torch.zeros(ROWS, 24), "b": torch.zeros(ROWS, 5), "step": 0}
    dcpstore.load(dest, str(durable / step_dir(1)))
    assert torch.equal(dest["w"], full(7)) and dest["step"] == 7


# -- the ownership check on a node that is not the coordinator's ------------------


def _taken_over(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    import dcpstore._impl.manager.tiers.nodes as nodes

    real = nodes.put_marker

    def then_taken(local: Any, step: int, save_id: str) -> None:
        real(local, step, save_id)
        if rank == 1:  # another save claims step 1 on node 1 right after our marker went in
            real(local, step, "f" * 16)

    nodes.put_marker = then_taken  # type: ignore[assignment]
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], async_=False) as mgr:
        with pytest.raises(dcpstore.SaveError, match="another save"):
            mgr.save(sharded(world, 1, scalar=True), 1)
        assert mgr.all_steps() == []


def test_a_node_whose_step_another_save_took_over_fails_the_save(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_taken_over, 2, str(durable), dirs)
    assert not list(tmp_path.glob(f"*/step_*/{METADATA}"))


# -- how the probe views split the ranks ----------------------------------------


@given(st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_probe_views_that_split_the_ranks_give_their_nodes(assignment: list[int]) -> None:
    world = len(assignment)
    views = [[q for q in range(world) if assignment[q] == assignment[r]] for r in range(world)]
    for rank in range(world):
        nodes = nodes_from_views(views, rank, "dir")
        assert nodes.node == tuple(views[rank]) and nodes.leader == min(views[rank])
        assert nodes.count == len(set(assignment))


@pytest.mark.parametrize(
    "views",
    [[[0], [0, 1]], [[1], [1]], [[0, 1], [1]], [[0, 1, 2], [0, 1], [2]]],
    ids=["one-sided", "no-own-probe", "half-shared", "overlap"],
)
def test_probe_views_that_do_not_split_the_ranks_are_refused(views: list[list[int]]) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=r"local_dir dir is neither one directory.*rank \d sees"):
        nodes_from_views(views, 0, "dir")


# -- SIGKILL of the whole job while a step replicates -----------------------------


class KillJob:
    """A hook that SIGKILLs every rank of the job (their pids are files in
    ``pids``) at this rank's ``n``-th durable-tier event of step 2 (``n``
    -1: never; the events are counted in ``events``)."""

    def __init__(self, n: int, pids: Path) -> None:
        self.n, self.seen, self.pids = n, 0, pids
        self._lock = threading.Lock()

    def __call__(self, event: str) -> None:
        # Reads of .metadata are not counted: a rank that waits for the
        # coordinator's commit polls it, as often as the timing makes it, so
        # counting them would move every later point from run to run.
        if step_dir(2) not in event or event == f"read:{step_dir(2)}/{METADATA}":
            return
        with self._lock:
            if self.seen == self.n:
                # Only the pid files (named by rank): a rank that finished
                # writes its events file into the same directory meanwhile.
                pids = [int(p.read_text()) for p in self.pids.iterdir() if p.name.isdigit()]
                others = [pid for pid in pids if pid != os.getpid()]
                for pid in others:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            self.seen += 1


def _killed_while_replicating(
    rank: int, world: int, durable: str, dirs: list[str], pids: str, killer: int, at: int
) -> None:
    Path(pids, str(rank)).write_text(str(os.getpid()))
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], async_=False) as mgr:
        mgr.save(sharded(world, 1, scalar=True), 1)
        mgr.wait()
    dist.barrier()
    hook = KillJob(at if rank == killer else -1, Path(pids))
    hook_all_storage({durable: hook})
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], async_=False) as mgr:
        mgr.save(sharded(world, 2, scalar=True), 2)
        mgr.wait()
    Path(pids, f"events{rank}").write_text(str(hook.seen))


def _whole_durable_steps(durable: Path) -> list[int]:
    """The durable steps with a ``.metadata``, each checked whole: it loads
    exactly what was saved."""
    steps = sorted(int(p.parent.name[5:]) for p in durable.glob(f"step_*/{METADATA}"))
    for step in steps:
        dest = {"w": torch.zeros(ROWS, 24), "b": torch.zeros(ROWS, 5), "step": 0}
        dcpstore.load(dest, str(durable / step_dir(step)))
        assert torch.equal(dest["w"], full(step)) and dest["step"] == step
    return steps


def _kill_points(tmp_path: Path, sample: int | None) -> list[tuple[int, int]]:
    """(rank, event index) kill points over both ranks' durable events, as a
    probe run counts them; ``sample``: that many of each rank's, spread."""
    pids = tmp_path / "probe-pids"
    pids.mkdir()
    run_ranks(
        _killed_while_replicating,
        2,
        str(tmp_path / "probe" / "durable"),
        node_dirs(tmp_path / "probe", 2, 1),
        str(pids),
        -1,
        -1,
    )
    points = []
    for rank in (0, 1):
        total = int((pids / f"events{rank}").read_text())
        chosen = range(total) if sample is None else sorted(set(spread(total, sample)))
        points += [(rank, i) for i in chosen]
    return points


def _crash_and_recover(tmp_path: Path, sample: int | None) -> None:
    points = _kill_points(tmp_path, sample)
    for i, (killer, at) in enumerate(points):
        case = tmp_path / f"kill{i}"
        durable, pids = case / "durable", case / "pids"
        pids.mkdir(parents=True)
        dirs = node_dirs(case, 2, 1)
        where = (killer, at)
        # The job must die by the hook's SIGKILL: a rank that fails (an
        # assertion, a SaveError) exits with an error instead, and is no kill.
        with pytest.raises(ProcessExitedException) as died:
            run_ranks(_killed_while_replicating, 2, str(durable), dirs, str(pids), killer, at)
        assert died.value.signal_name == "SIGKILL", (where, str(died.value))
        assert _whole_durable_steps(durable) in ([1], [1, 2]), where  # whole steps only
        assert (case / "node0" / step_dir(2) / METADATA).exists(), where  # committed before replicating
        run_ranks(_catch_up, 2, str(durable), dirs)  # a new job over the same node dirs catches up
        assert _whole_durable_steps(durable) == [1, 2], where
        for n in (0, 1):
            assert_node_holds(case / f"node{n}", Target("local", str(durable)), 2, {n}, killed=True)
            age_temp_files(str(case / f"node{n}"))  # found later: gc keeps a write younger than its lease
            storage = dcpstore.open_storage(str(case / f"node{n}"))
            try:
                gc(storage, older_than_s=0)  # the temporary file of a write the kill cut short goes
            finally:
                storage.close()
            assert_node_holds(case / f"node{n}", Target("local", str(durable)), 2, {n})
    killcount.record(len(points), len(points), len(points))  # each one was asserted to kill


def test_sigkill_of_the_job_during_replication_loses_no_committed_step(tmp_path: Path) -> None:
    _crash_and_recover(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_at_every_durable_event_of_either_node(tmp_path: Path) -> None:
    _crash_and_recover(tmp_path, None)


# -- dcpstore gc on a node that is not the coordinator's ---------------------------


def _gc_during_save(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    from tests.support.faults import BlockAt

    gate = BlockAt(lambda e: e.startswith("commit:__"))  # this rank's data file is written, not yet published
    if rank == 1:
        hook_all_storage({f"{dirs[1]}/{step_dir(1)}": gate})
    # The native engine writes through dcpstore's storage (NVRx writes its files itself).
    with dcpstore.CheckpointManager(
        durable, local_dir=dirs[rank], async_=True, options=dcpstore.SaveOptions(engine="native")
    ) as mgr:
        mgr.save(sharded(world, 1, scalar=True), 1)
        if rank == 1:
            gc_keeps_running(dirs[1], gate, 1)
        mgr.wait()


def test_gc_on_another_node_keeps_the_save_running_there(tmp_path: Path) -> None:
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_gc_during_save, 2, str(durable), dirs)
    for n in (0, 1):
        assert_node_holds(tmp_path / f"node{n}", Target("local", str(durable)), 1, {n})


def test_a_resharded_load_reads_locally_where_each_node_holds_its_rows(tmp_path: Path) -> None:
    """Saved on 2 nodes of 1 rank, loaded on the same 2 nodes with 2 ranks
    each (Shard(0) over 4): every new rank's rows lie in its own node's old
    file, so the local copies serve the load (the durable one is damaged),
    and what loads is the whole tensor, as stock DCP reads the durable copy."""
    durable = tmp_path / "durable"
    run_ranks(_save_and_load, 2, str(durable), node_dirs(tmp_path, 2, 1), False)
    stock = {"w": torch.zeros(ROWS, 24), "b": torch.zeros(ROWS, 5)}
    dcp.load(stock, checkpoint_id=str(durable / step_dir(3)), no_dist=True)  # the oracle, before the damage
    assert torch.equal(stock["w"], full(3)) and torch.equal(stock["b"], full(3)[:, :5] * 2)
    _damage(durable, 3)
    run_ranks(_load, 4, str(durable), node_dirs(tmp_path, 4, 2), False, 3)
