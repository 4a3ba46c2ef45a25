"""Peer copies of node-local tiers (``local_replicas=N``): each node's share
of a step is also committed in N-1 other nodes' ``local_dir``, and a job
restarted with a node's directory gone resumes from those copies.

Real gloo jobs whose "nodes" are separate directories (as in
test_tiered_nodes.py), a durable tier on S3 (moto behind the counting
proxy): a lost node resumes with zero bytes of data files fetched from the
durable tier; where no peer holds the lost share, the load falls back to
the durable tier; retention keeps ``local_keep`` peer copies per source
node but never the last copy of a step not yet in the durable tier.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException

import dcpstore
from dcpstore._impl.cli import main as cli_main
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager import step_dir
from dcpstore._impl.manager.tiers.peers import (
    PEERS,
    Plan,
    View,
    check_peers,
    peer_step_dir,
    peers_of,
    restore_plan,
    share_of,
)
from dcpstore._impl.manager.tiers.replicate import read_local_commit
from dcpstore._impl.tools.listing import gc
from tests.processes.test_tiered_nodes import KillJob, check, node_dirs, sharded, zeros
from tests.support import killcount
from tests.support.dist_utils import PRELOAD, _entry, free_port, run_ranks
from tests.support.faultproxy import FaultProxy
from tests.support.faults import hook_all_storage, spread
from tests.support.s3_server import S3Endpoint


def _save(rank: int, world: int, durable: str, dirs: list[str], kwargs: dict[str, Any]) -> None:
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], async_=True, **kwargs) as mgr:
        for step in (1, 2, 3):
            mgr.save(sharded(world, step, scalar=False), step)
        mgr.wait()
        dist.barrier()


def _load(rank: int, world: int, durable: str, dirs: list[str], kwargs: dict[str, Any], expect: int) -> None:
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], **kwargs) as mgr:
        state = zeros(world, False)
        assert mgr.load(state) == expect
        check(state, expect, scalar=False)


def _data_bytes_fetched(endpoint: S3Endpoint, proxy: FaultProxy, prefix: str) -> int:
    return sum(
        n
        for path, n in proxy.stats.got.items()
        if path.startswith(f"/{endpoint.bucket}/{prefix}/") and path.endswith(".distcp")
    )


def _share(node: Path, directory: str) -> set[str]:
    return {p.name for p in (node / directory).glob("*.distcp")}


def _durable(endpoint: S3Endpoint, name: str) -> tuple[str, str]:
    endpoint.delete_prefix(f"{name}/")
    return f"s3://{endpoint.bucket}/{name}", name


@pytest.mark.parametrize(
    ("world", "per_node", "lost"),
    [(4, 2, [1]), (4, 1, [1, 3]), pytest.param(8, 2, [2], marks=pytest.mark.slow)],
    ids=["2x2-lose1", "4x1-lose2", "4x2-lose1"],
)
def test_a_lost_node_resumes_from_its_peers_copies_reading_no_durable_data(
    s3_endpoint: S3Endpoint,
    proxy: FaultProxy,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    world: int,
    per_node: int,
    lost: list[int],
) -> None:
    uri, prefix = _durable(s3_endpoint, f"peers-{world}x{per_node}")
    dirs = node_dirs(tmp_path, world, per_node)
    kwargs = {"local_replicas": 2, "local_keep": 2}
    run_ranks(_save, world, uri, dirs, kwargs)
    nodes = world // per_node
    for n in range(nodes):
        node = tmp_path / f"node{n}"
        for step in (2, 3):
            (peer,) = peers_of(n, nodes, 2, 1)
            copy = tmp_path / f"node{peer}" / peer_step_dir(n, step)
            # The peer's copy: committed, the same commit, exactly the node's own share.
            assert (copy / METADATA).read_bytes() == (node / step_dir(step) / METADATA).read_bytes()
            assert _share(tmp_path / f"node{peer}", peer_step_dir(n, step)) == _share(node, step_dir(step))
            # and nothing else: no alive file of the lease it was written under
            assert {p.name for p in copy.iterdir()} == {p.name for p in (node / step_dir(step)).iterdir()}
        assert not (node / peer_step_dir((n - 1) % nodes, 1)).exists(), "local_keep=2 counts the peer copies"
    capsys.readouterr()
    assert cli_main(["ls", uri, "--local-dir", str(tmp_path / "node1")]) == 0  # where node 0's copies live
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows[peer_step_dir(0, 3)][:2] == ["committed", "local"], rows
    for n in lost:
        shutil.rmtree(tmp_path / f"node{n}")  # a replacement node: an empty local_dir
    proxy.stats.got.clear()
    run_ranks(_load, world, uri, dirs, kwargs, 3)
    assert _data_bytes_fetched(s3_endpoint, proxy, prefix) == 0, proxy.stats.got
    for n in lost:  # the replacement holds its share again, and the copies it held for its peers, committed
        storage = dcpstore.open_storage(str(tmp_path / f"node{n}"))
        try:
            assert read_local_commit(storage, 3) is not None
        finally:
            storage.close()
        for source in (s for s in range(nodes) if n in peers_of(s, nodes, 2, 1)):
            copy = tmp_path / f"node{n}" / peer_step_dir(source, 3)
            assert (copy / METADATA).read_bytes() == (tmp_path / f"node{source}" / step_dir(3) / METADATA).read_bytes()
            assert _share(tmp_path / f"node{n}", peer_step_dir(source, 3)) == _share(
                tmp_path / f"node{source}", step_dir(3)
            )


@pytest.mark.slow  # two lost nodes on 4x1 with two copies each is quick (4x1-lose2 above)
def test_three_replicas_survive_two_lost_nodes(s3_endpoint: S3Endpoint, proxy: FaultProxy, tmp_path: Path) -> None:
    """4x1, ``local_replicas=3``: each node sends to two peers while it
    receives from two (round by round, at once); nodes 1 and 2 lost, the
    job resumes from node 3's and node 0's copies with no durable data read."""
    uri, prefix = _durable(s3_endpoint, "peers-three")
    dirs = node_dirs(tmp_path, 4, 1)
    kwargs = {"local_replicas": 3}
    run_ranks(_save, 4, uri, dirs, kwargs)
    for n in range(4):
        for peer in peers_of(n, 4, 3, 1):
            copy = tmp_path / f"node{peer}" / peer_step_dir(n, 3)
            assert (copy / METADATA).read_bytes() == (tmp_path / f"node{n}" / step_dir(3) / METADATA).read_bytes()
            assert _share(tmp_path / f"node{peer}", peer_step_dir(n, 3)) == _share(tmp_path / f"node{n}", step_dir(3))
    for n in (1, 2):
        shutil.rmtree(tmp_path / f"node{n}")
    proxy.stats.got.clear()
    run_ranks(_load, 4, uri, dirs, kwargs, 3)
    assert _data_bytes_fetched(s3_endpoint, proxy, prefix) == 0, proxy.stats.got


def _data_fetched(endpoint: S3Endpoint, proxy: FaultProxy, prefix: str) -> dict[str, int]:
    """The bytes of each data file of step 3 read from the durable tier, by name."""
    where = f"/{endpoint.bucket}/{prefix}/{step_dir(3)}/"
    return {p[len(where) :]: n for p, n in proxy.stats.got.items() if p.startswith(where) and p.endswith(".distcp")}


def _sizes(node: Path, step: int) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (node / step_dir(step)).glob("*.distcp")}


@pytest.mark.parametrize(
    ("world", "per_node", "lost", "copies_lost"),
    [(4, 2, [1], [0]), pytest.param(4, 1, [1, 2], [], marks=pytest.mark.slow)],
    ids=["2x2-lose1-and-its-copy", "4x1-lose-a-pair"],
)
def test_where_no_peer_holds_a_lost_share_only_that_share_is_read_from_the_durable_tier(
    s3_endpoint: S3Endpoint,
    proxy: FaultProxy,
    tmp_path: Path,
    world: int,
    per_node: int,
    lost: list[int],
    copies_lost: list[int],
) -> None:
    """Node 1's share of step 3 is on no surviving node: node 1's leader
    fetches just its ranks' data files from the durable tier into its
    directory (checked, committed), and every rank then loads step 3
    locally. 4x1: node 2's share comes back from node 3's copy."""
    uri, prefix = _durable(s3_endpoint, f"peers-fetch-{world}x{per_node}")
    dirs = node_dirs(tmp_path, world, per_node)
    kwargs = {"local_replicas": 2}
    run_ranks(_save, world, uri, dirs, kwargs)
    share = _sizes(tmp_path / "node1", 3)
    for n in lost:  # node n's share lived on n and on n + 1 only
        shutil.rmtree(tmp_path / f"node{n}")
    for n in copies_lost:
        shutil.rmtree(tmp_path / f"node{n}" / "peers")
    proxy.stats.got.clear()
    run_ranks(_load, world, uri, dirs, kwargs, 3)
    assert _data_fetched(s3_endpoint, proxy, prefix) == share
    assert _sizes(tmp_path / "node1", 3) == share
    node1 = dcpstore.open_storage(str(tmp_path / "node1"))
    try:
        commit = read_local_commit(node1, 3)
    finally:
        node1.close()
    assert commit is not None and (tmp_path / "node1" / step_dir(3) / METADATA).read_bytes() == commit.metadata_blob
    assert not list((tmp_path / "node1" / step_dir(3)).glob("*alive*")), "the fetch's lease ended"


def test_where_nobody_holds_a_lost_share_the_whole_step_is_read_from_the_durable_tier(
    s3_endpoint: S3Endpoint, proxy: FaultProxy, tmp_path: Path
) -> None:
    uri, prefix = _durable(s3_endpoint, "peers-fallback-all")
    dirs = node_dirs(tmp_path, 4, 2)
    kwargs = {"local_replicas": 2}
    run_ranks(_save, 4, uri, dirs, kwargs)
    everything = {**_sizes(tmp_path / "node0", 3), **_sizes(tmp_path / "node1", 3)}
    for n in (0, 1):
        shutil.rmtree(tmp_path / f"node{n}")
    proxy.stats.got.clear()
    run_ranks(_load, 4, uri, dirs, kwargs, 3)
    assert set(_data_fetched(s3_endpoint, proxy, prefix)) == set(everything)


def test_where_neither_peers_nor_the_durable_tier_hold_a_lost_share_the_previous_step_loads(
    s3_endpoint: S3Endpoint, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 1's share of step 3 is nowhere (node 1 lost, its copy on node 0
    gone, step 3 not in the durable tier): step 2 comes back from node 0's
    copy and loads, reading no data from the durable tier."""
    uri, prefix = _durable(s3_endpoint, "peers-previous")
    dirs = node_dirs(tmp_path, 4, 2)
    kwargs = {"local_replicas": 2}
    run_ranks(_save, 4, uri, dirs, kwargs)
    shutil.rmtree(tmp_path / "node1")
    shutil.rmtree(tmp_path / "node0" / peer_step_dir(1, 3))
    s3_endpoint.delete_prefix(f"{prefix}/{step_dir(3)}/")
    proxy.stats.got.clear()
    run_ranks(_load, 4, uri, dirs, kwargs, 2)
    assert _data_bytes_fetched(s3_endpoint, proxy, prefix) == 0, proxy.stats.got


def test_a_damaged_peer_copy_is_refused_and_the_load_reads_the_durable_tier(
    s3_endpoint: S3Endpoint, proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 0's copy of node 1's share of step 3 has a flipped byte (its size
    unchanged): node 1, replaced, gets nothing committed from it (the CRC32C
    check against the manifest), and the load reads step 3 from the durable tier."""
    uri, prefix = _durable(s3_endpoint, "peers-damaged")
    dirs = node_dirs(tmp_path, 4, 2)
    kwargs = {"local_replicas": 2}
    run_ranks(_save, 4, uri, dirs, kwargs)
    data = sorted((tmp_path / "node0" / peer_step_dir(1, 3)).glob("*.distcp"))[0]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    shutil.rmtree(tmp_path / "node1")
    proxy.stats.got.clear()
    run_ranks(_load, 4, uri, dirs, kwargs, 3)
    assert _data_bytes_fetched(s3_endpoint, proxy, prefix) > 0
    assert not (tmp_path / "node1" / step_dir(3) / METADATA).exists()


def _save_unreplicated(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    import dcpstore._impl.manager.tiers.tiered as tiered

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise dcpstore.StorageError("injected: the object store is unreachable")

    tiered.upload_files = broken  # type: ignore[assignment]
    mgr = dcpstore.CheckpointManager(
        durable, local_dir=dirs[rank], async_=False, local_keep=1, local_replicas=2, replicate_timeout_s=3.0
    )
    for step in (1, 2, 3):
        mgr.save(sharded(world, step, scalar=False), step)
    with pytest.raises(dcpstore.SaveError):
        mgr.wait()
    mgr.close()


def test_retention_keeps_peer_copies_of_steps_the_durable_tier_lacks(tmp_path: Path) -> None:
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_unreplicated, 2, str(tmp_path / "durable"), dirs)
    for n in (0, 1):  # local_keep=1, but no step reached the durable tier: every copy stays
        peer = tmp_path / f"node{1 - n}"
        assert sorted(p.name for p in (tmp_path / f"node{n}").glob("step_*")) == [step_dir(s) for s in (1, 2, 3)]
        assert all((peer / peer_step_dir(n, s) / METADATA).exists() for s in (1, 2, 3))
    shutil.rmtree(tmp_path / "node1")  # and the lost node's newest step comes back from its peer
    run_ranks(_load, 2, str(tmp_path / "durable"), dirs, {"local_replicas": 2}, 3)


def _save_uncopied(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    """Steps 1-3 committed on every node, with no peer copy and no durable
    replica: the job died before either (both made to fail here)."""
    import dcpstore._impl.manager.tiers.nodes as nodes
    import dcpstore._impl.manager.tiers.tiered as tiered

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise dcpstore.StorageError("injected: the object store is unreachable")

    tiered.upload_files = broken  # type: ignore[assignment]
    nodes.peers.replicate = lambda *args, **kwargs: None  # type: ignore[assignment]
    mgr = dcpstore.CheckpointManager(
        durable, local_dir=dirs[rank], async_=False, local_replicas=2, replicate_timeout_s=3.0
    )
    for step in (1, 2, 3):
        mgr.save(sharded(world, step, scalar=False), step)
    with pytest.raises(dcpstore.SaveError):
        mgr.wait()
    mgr.close()


def test_steps_committed_before_a_crash_get_their_peer_copies_at_the_restart(tmp_path: Path) -> None:
    """The restart copies every step the durable tier lacks, not just the
    newest: node 1, lost after it with its copy of step 3 on node 0 gone
    too, resumes from step 2 with no durable tier."""
    durable = tmp_path / "durable"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_uncopied, 2, str(durable), dirs)
    assert not (tmp_path / "node0" / PEERS).exists() and not (tmp_path / "node1" / PEERS).exists()
    run_ranks(_load, 2, str(durable), dirs, {"local_replicas": 2}, 3)
    for n in (0, 1):
        for step in (1, 2, 3):
            copy = tmp_path / f"node{1 - n}" / peer_step_dir(n, step)
            assert (copy / METADATA).read_bytes() == (tmp_path / f"node{n}" / step_dir(step) / METADATA).read_bytes()
            assert _share(tmp_path / f"node{1 - n}", peer_step_dir(n, step)) == _share(
                tmp_path / f"node{n}", step_dir(step)
            )
    shutil.rmtree(tmp_path / "node1")
    shutil.rmtree(tmp_path / "node0" / peer_step_dir(1, 3))
    shutil.rmtree(durable)
    durable.mkdir()
    run_ranks(_load, 2, str(durable), dirs, {"local_replicas": 2}, 2)


class CopyAfterUpload:
    """A hook on node 1's ``local_dir``: its first write into a peer copy
    waits (at most 20 s) for the durable commit of step 1, and writes to
    ``out`` whether it came."""

    def __init__(self, durable: Path, out: Path) -> None:
        self.durable, self.out, self.done = durable, out, False

    def __call__(self, event: str) -> None:
        if self.done or not event.startswith(f"open:{PEERS}/"):
            return
        self.done = True
        committed = self.durable / step_dir(1) / METADATA
        deadline = time.monotonic() + 20
        while not committed.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.out.write_text(json.dumps(committed.exists()))


def _save_one(rank: int, world: int, durable: str, dirs: list[str], out: str) -> None:
    if rank == 1:
        hook_all_storage({dirs[1]: CopyAfterUpload(Path(durable), Path(out))})
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], local_replicas=2) as mgr:
        mgr.save(sharded(world, 1, scalar=False), 1)
        mgr.wait()


def test_a_save_s_peer_copies_run_beside_its_durable_upload(tmp_path: Path) -> None:
    """Node 1's copy of node 0's share waits for the step's durable commit:
    copies made before the upload would wait out the hook's 20 s for nothing."""
    durable, out = tmp_path / "durable", tmp_path / "out.json"
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save_one, 2, str(durable), dirs, str(out))
    assert json.loads(out.read_text()) is True
    for n in (0, 1):
        copy = tmp_path / f"node{1 - n}" / peer_step_dir(n, 1)
        assert (copy / METADATA).read_bytes() == (tmp_path / f"node{n}" / step_dir(1) / METADATA).read_bytes()


# -- a replacement node's copies for its peers, in the background ------------------


class PauseCopy:
    """A hook on a node's ``local_dir``: at the commit of its first peer
    copy (the manifest's write, every data file written), put ``paused``
    in ``flags`` and wait (at most 60 s) for ``go`` there."""

    def __init__(self, flags: Path) -> None:
        self.flags, self.done = flags, False

    def __call__(self, event: str) -> None:
        if self.done or not event.startswith(f"open:{PEERS}/") or event.endswith(".distcp") or ".alive." in event:
            return
        self.done = True
        (self.flags / "paused").write_text(event)
        deadline = time.monotonic() + 60
        while not (self.flags / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def _replaced(rank: int, world: int, durable: str, dirs: list[str], flags: str, gc_it: bool) -> None:
    """Node 1 was replaced: its manager's constructor brings its own share
    back and returns while its copy of node 0's share is still paused
    (:class:`PauseCopy`); ``gc_it``: node 0's rank runs ``gc`` (no age
    limit) on node 1's directory meanwhile."""
    flag = Path(flags)
    if rank == 1:
        hook_all_storage({dirs[1]: PauseCopy(flag)})
    copy = Path(dirs[1]) / peer_step_dir(0, 3)
    with dcpstore.CheckpointManager(durable, local_dir=dirs[rank], local_replicas=2) as mgr:
        assert (Path(dirs[1]) / step_dir(3) / METADATA).exists()  # its own share: in the foreground
        assert not (copy / METADATA).exists()  # the copy for its peer: not yet
        if rank == 0:
            deadline = time.monotonic() + 60
            while not (flag / "paused").exists():
                assert time.monotonic() < deadline, "the copy never started"
                time.sleep(0.02)
            if gc_it:
                local = dcpstore.open_storage(dirs[1])
                try:
                    report = gc(local, older_than_s=0)
                finally:
                    local.close()
                (flag / "gc").write_text(json.dumps({"running": report.kept_running, "removed": report.removed}))
            (flag / "go").write_text("")
        mgr.wait()  # on node 1: its replicator committed the copy
        dist.barrier()
        assert (copy / METADATA).exists()
        state = zeros(world, False)
        assert mgr.load(state) == 3
        check(state, 3, scalar=False)


@pytest.mark.parametrize("gc_it", [False, True], ids=["wait", "gc-meanwhile"])
def test_a_replacement_node_makes_its_copies_for_its_peers_in_the_background(
    s3_endpoint: S3Endpoint, proxy: FaultProxy, tmp_path: Path, gc_it: bool
) -> None:
    """The constructor returns while the copy is held mid-commit; ``wait()``
    returns once it is committed, whole; ``gc`` meanwhile leaves it alone (the
    copy's lease); and node 0, lost after it, resumes from that copy."""
    uri, prefix = _durable(s3_endpoint, f"peers-background-{gc_it}")
    dirs = node_dirs(tmp_path, 2, 1)
    run_ranks(_save, 2, uri, dirs, {"local_replicas": 2})
    shutil.rmtree(tmp_path / "node1")
    flags = tmp_path / "flags"
    flags.mkdir()
    run_ranks(_replaced, 2, uri, dirs, str(flags), gc_it)
    copy = tmp_path / "node1" / peer_step_dir(0, 3)
    assert (copy / METADATA).read_bytes() == (tmp_path / "node0" / step_dir(3) / METADATA).read_bytes()
    assert _share(tmp_path / "node1", peer_step_dir(0, 3)) == _share(tmp_path / "node0", step_dir(3))
    if gc_it:
        report = json.loads((flags / "gc").read_text())
        assert peer_step_dir(0, 3) in report["running"], report
        assert not [r for r in report["removed"] if r.startswith(PEERS)], report
    shutil.rmtree(tmp_path / "node0")
    proxy.stats.got.clear()
    run_ranks(_load, 2, uri, dirs, {"local_replicas": 2}, 3)
    assert _data_bytes_fetched(s3_endpoint, proxy, prefix) == 0, proxy.stats.got


# -- SIGKILL of the whole job while a peer copy is written --------------------------


class KillOnPeerCopy(KillJob):
    """:class:`KillJob` counting this rank's writes into its peer copies of step 2."""

    def __call__(self, event: str) -> None:
        if "peers/" in event and step_dir(2) in event and not event.startswith(("read:", "list")):
            super().__call__(event)


def _killed_while_copying(
    rank: int, world: int, durable: str, dirs: list[str], pids: str, killer: int, at: int
) -> None:
    Path(pids, str(rank)).write_text(str(os.getpid()))
    kwargs: dict[str, Any] = {"local_dir": dirs[rank], "async_": False, "local_replicas": 2}
    with dcpstore.CheckpointManager(durable, **kwargs) as mgr:
        mgr.save(sharded(world, 1, scalar=False), 1)
        mgr.wait()
    dist.barrier()
    hook = KillOnPeerCopy(at if rank == killer else -1, Path(pids))
    hook_all_storage({dirs[rank]: hook})
    with dcpstore.CheckpointManager(durable, **kwargs) as mgr:
        mgr.save(sharded(world, 2, scalar=False), 2)
        mgr.wait()
    Path(pids, f"events{rank}").write_text(str(hook.seen))


def test_sigkill_while_a_peer_copy_is_written_loses_no_committed_step(tmp_path: Path) -> None:
    """Each node's copy for its peer is whole and committed, or has no
    ``.metadata``; the restarted job resumes from step 2 and makes the
    copies the kill cut short, so that a node lost after it still resumes
    from step 2 with no durable tier at all."""
    probe = tmp_path / "probe"
    (probe / "pids").mkdir(parents=True)
    run_ranks(_killed_while_copying, 2, str(probe / "durable"), node_dirs(probe, 2, 1), str(probe / "pids"), -1, -1)
    points = [(rank, i) for rank in (0, 1) for i in spread(int((probe / "pids" / f"events{rank}").read_text()), 3)]
    assert len(points) >= 4, points
    cut = 0
    for i, (killer, at) in enumerate(points):
        case = tmp_path / f"kill{i}"
        durable, pids = case / "durable", case / "pids"
        pids.mkdir(parents=True)
        dirs = node_dirs(case, 2, 1)
        with pytest.raises(ProcessExitedException) as died:
            run_ranks(_killed_while_copying, 2, str(durable), dirs, str(pids), killer, at)
        assert died.value.signal_name == "SIGKILL", ((killer, at), str(died.value))
        whole = []
        for n in (0, 1):
            own, copy = case / f"node{n}", case / f"node{1 - n}" / peer_step_dir(n, 2)
            assert (own / step_dir(2) / METADATA).exists()  # committed on its node before it is copied
            if (copy / METADATA).exists():  # a copy is committed only whole
                assert (copy / METADATA).read_bytes() == (own / step_dir(2) / METADATA).read_bytes()
                assert _share(case / f"node{1 - n}", peer_step_dir(n, 2)) == _share(own, step_dir(2))
                whole.append(n)
        run_ranks(_load, 2, str(durable), dirs, {"local_replicas": 2}, 2)  # every node: step 2
        for n in (0, 1):  # and the restart made the copies the kill cut short
            copy = case / f"node{1 - n}" / peer_step_dir(n, 2)
            assert (copy / METADATA).read_bytes() == (case / f"node{n}" / step_dir(2) / METADATA).read_bytes()
        shutil.rmtree(case / "node1")
        shutil.rmtree(durable)  # and an empty durable tier: only what the peers hold
        durable.mkdir()
        run_ranks(_load, 2, str(durable), dirs, {"local_replicas": 2}, 2)  # node 1 lost: step 2 from node 0's copy
        cut += len(whole) < 2
    assert cut, "no kill point cut a copy short"
    killcount.record(len(points), len(points), len(points))  # each one was asserted to kill


# -- a peer SIGKILLed while it receives a copy ----------------------------------------


class KillSelfOnCopy:
    """SIGKILL this rank at its first data file write into a peer copy of
    step 2 (``sender``: at its first read of a data file of step 2, for the
    copy or the upload beside it: either way its peer is then waiting for
    the copy)."""

    def __init__(self, sender: bool) -> None:
        self.sender = sender

    def __call__(self, event: str) -> None:
        if self.sender:
            hit = event.startswith(f"read:{step_dir(2)}/") and event.endswith(".distcp")
        else:
            hit = event.startswith(f"open:{PEERS}/") and step_dir(2) in event and event.endswith(".distcp")
        if hit:
            os.kill(os.getpid(), signal.SIGKILL)


def _peer_dies(rank: int, world: int, durable: str, dirs: list[str], out: str, killed: int) -> None:
    """Step 1 is saved and copied; then rank ``killed`` dies during node 0's
    copy of step 2 to node 1 (rank 0 sends, rank 1 receives); the other,
    which survives, writes what its wait() raised."""
    kwargs: dict[str, Any] = {"local_dir": dirs[rank], "local_replicas": 2, "replicate_timeout_s": 3.0}
    with dcpstore.CheckpointManager(durable, **kwargs) as mgr:
        mgr.save(sharded(world, 1, scalar=False), 1)
        mgr.wait()
    dist.barrier()
    if rank == killed:
        hook_all_storage({dirs[rank]: KillSelfOnCopy(sender=rank == 0)})
    mgr = dcpstore.CheckpointManager(durable, **kwargs)
    mgr.save(sharded(world, 2, scalar=False), 2)
    started = time.monotonic()
    try:
        mgr.wait()
        outcome = "returned"
    except dcpstore.SaveError as e:
        outcome = f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps({"outcome": outcome, "s": time.monotonic() - started}))
    os._exit(0)  # its peer is gone: no collective (close, the group's teardown) can pair up


def _launch(fn: Any, world: int, *args: Any, timeout: float = 120.0) -> list[int | None]:
    """Each rank's exit code: run_ranks' ranks, without its rule that one
    rank's death ends the others (here the survivors must go on)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = multiprocessing.get_context("forkserver")
    port, env = free_port(), dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, fn, world, port, env, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


# The two sides fail the same transfer; the receiver's case waits out the upload's timeout too.
@pytest.mark.parametrize("killed", [pytest.param(1, marks=pytest.mark.slow), 0], ids=["receiver", "sender"])
def test_a_peer_killed_mid_copy_fails_the_survivor_clearly_and_a_restart_resumes(tmp_path: Path, killed: int) -> None:
    """Gloo reports the dead peer at once (connection reset): the survivor's
    wait() raises a SaveError naming the copy; no committed step is lost,
    no half copy is committed, and the restart loads step 2 and makes the copy."""
    durable, out = tmp_path / "durable", tmp_path / "outcome.json"
    dirs = node_dirs(tmp_path, 2, 1)
    codes = _launch(_peer_dies, 2, str(durable), dirs, str(out), killed)
    assert codes[killed] == -signal.SIGKILL and codes[1 - killed] == 0, codes
    found = json.loads(out.read_text())
    assert found["outcome"].startswith("SaveError"), found
    # (either direction: each node sends its share while it receives the other's)
    assert re.search(r"the copy of node (\d)'s share of step 2 from node \1 to node \d", found["outcome"]), found
    assert found["s"] < 60, found
    # Both nodes committed step 2 before the copies; node 1's copy of node 0's share is not committed.
    for n in (0, 1):
        assert (tmp_path / f"node{n}" / step_dir(2) / METADATA).exists()
    assert not (tmp_path / "node1" / peer_step_dir(0, 2) / METADATA).exists()
    run_ranks(_load, 2, str(durable), dirs, {"local_replicas": 2}, 2)  # the restart resumes from step 2
    copy = tmp_path / "node1" / peer_step_dir(0, 2)  # and made the copy the kill cut short
    assert (copy / METADATA).read_bytes() == (tmp_path / "node0" / step_dir(2) / METADATA).read_bytes()
    assert _share(tmp_path / "node1", peer_step_dir(0, 2)) == _share(tmp_path / "node0", step_dir(2))


# -- the choice of peers, the restore plan, bad options --------------------------


def test_peers_spread_by_the_jump() -> None:
    assert peers_of(0, 8, 3, 1) == [1, 2]
    assert peers_of(6, 8, 2, 4) == [2]  # a jump of a "rack" of 4 nodes: the copy lives in the other rack
    assert peers_of(7, 8, 3, 3) == [2, 5]


@pytest.mark.parametrize(
    ("count", "replicas", "jump", "match"),
    [
        (1, 2, 1, "one directory every rank sees"),
        (2, 3, 1, "on each of 2 nodes"),
        (4, 2, 4, "two copies"),
        (4, 3, 2, "two copies"),
    ],
)
def test_replicas_that_cannot_spread_are_refused(count: int, replicas: int, jump: int, match: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=match):
        check_peers(count, replicas, jump, "dir")


def test_the_restore_plan_takes_the_newest_step_every_node_can_get() -> None:
    a, b, c = ["__0_0.distcp"], ["__1_0.distcp"], ["__2_0.distcp"]
    ring = [(0, 1), (1, 2), (2, 0)]
    # node 1 lost everything; node 0 holds node 1's copies of 2 and 3 (not node 2's of 3), node 2 node 0's
    views: list[View] = [
        ({2: a, 3: a}, {1: {2: b, 3: b}}),
        ({}, {}),
        ({2: c, 3: c}, {0: {2: a, 3: a}}),
    ]
    # node 1's share comes back from node 0; then the copy node 0 lacks of node 2's share
    assert restore_plan(views, [(0, 2), (1, 0), (2, 0)]) == Plan(3, ((0, 1, 1),), (), ((2, 0, 2),))
    # on a ring every peer copy node 1 held, and the copy of its own share on node 2, are made too
    assert restore_plan(views, ring) == Plan(3, ((0, 1, 1),), (), ((0, 1, 0), (1, 2, 1), (2, 0, 2)))
    two = [(0, 1), (1, 0)]
    assert restore_plan([({2: a, 3: a}, {1: {3: b}}), ({2: b, 3: b}, {0: {3: a}})], two, [2]) is None  # all there
    assert restore_plan([({2: a, 3: a}, {1: {3: b}}), ({2: b, 3: b}, {})], two, [2]) == Plan(3, (), (), ((0, 1, 0),))
    # step 2, not in the durable tier either, has no copies: they are made too (newest first)
    behind = Plan(3, (), (), (), ((2, ((0, 1, 0), (1, 0, 1))),))
    assert restore_plan([({1: a, 2: a, 3: a}, {1: {3: b}}), ({1: b, 2: b, 3: b}, {0: {3: a}})], two, [1]) == behind
    assert restore_plan([({3: a}, {}), ({}, {})], two) is None  # nobody holds node 1's share
    # node 1 has the commit of 3 (caught up) but not its files, or some only: its peer's copy brings them
    more = b + ["__1_1.distcp"]
    assert restore_plan([({3: a}, {1: {3: more}}), ({3: []}, {0: {3: a}})], two) == Plan(3, ((0, 1, 1),), (), ())
    assert restore_plan([({3: a}, {1: {3: more}}), ({3: b}, {0: {3: a}})], two) == Plan(3, ((0, 1, 1),), (), ())


def test_the_restore_plan_fetches_what_no_peer_holds_from_the_durable_tier() -> None:
    a, b = ["__0_0.distcp"], ["__1_0.distcp"]
    two = [(0, 1), (1, 0)]
    # nobody holds node 1's share of 3, the durable tier does: node 0 sends the commit, node 1 fetches
    assert restore_plan([({3: a}, {}), ({}, {})], two, [2, 3]) == Plan(3, (), ((0, 1, 0),), ((0, 1, 0), (1, 0, 1)))
    # node 0's share comes back from node 1's copy, whose commit node 1 fetches its own share by
    assert restore_plan([({}, {}), ({}, {0: {3: a}})], two, [3]) == Plan(3, ((1, 0, 0),), ((1, 1, 0),), ((1, 0, 1),))
    # step 3 is nowhere whole (no copy, not durable): step 2 comes back from the peer's copy
    views: list[View] = [({2: a, 3: a}, {1: {2: b}}), ({}, {})]
    assert restore_plan(views, two, [1, 2]) == Plan(2, ((0, 1, 1),), (), ((0, 1, 0),))
    # the durable tier holds a newer step than any node: the load reads that one
    assert restore_plan([({3: a}, {1: {3: b}}), ({}, {})], two, [4]) is None


def test_a_node_s_share_is_its_ranks_data_files() -> None:
    names = ["__0_0.distcp", "__1_ab12_0.distcp", "p1/__2_0.distcp", "__12_0.distcp", "model.safetensors"]
    assert share_of(names, (1, 2)) == ["__1_ab12_0.distcp", "p1/__2_0.distcp"]
    assert share_of(names, (0,)) == ["__0_0.distcp"]


@pytest.mark.parametrize("kwargs", [{"local_replicas": 0}, {"replica_jump": True}, {"local_replicas": "2"}])
def test_bad_replica_options_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(dcpstore.InvalidArgument, match=name):
        dcpstore.CheckpointManager(str(tmp_path / "d"), local_dir=str(tmp_path / "l"), **kwargs)
    with pytest.raises(dcpstore.InvalidArgument, match="need local_dir"):
        dcpstore.CheckpointManager(str(tmp_path / "d"), local_replicas=2)


def test_replicas_on_one_shared_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=r"local_replicas=2 needs as many nodes"):
        dcpstore.CheckpointManager(str(tmp_path / "d"), local_dir=str(tmp_path / "l"), local_replicas=2)
