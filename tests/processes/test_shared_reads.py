"""Read once per job: what several ranks load is fetched from storage once.

Four gloo ranks load from S3 (moto behind the counting proxy): the commit's
reads (once per job), and the bytes of
data files fetched from the endpoint, against the bytes stored, for states
whose items every rank (plain tensors, objects) or every replica (HSDP's
DTensors) loads, saved by dcpstore or by stock DCP. And the failures: a
damaged item fails the load on every rank with its own error, and a rank
killed in the middle of the exchange fails it on every other rank, promptly.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

import dcpstore
from dcpstore._impl.dcp.reader import DcpStorageReader
from tests.support.dist_utils import PRELOAD, free_port, run_ranks
from tests.support.faultproxy import FaultProxy
from tests.support.s3_server import S3Endpoint

WORLD = 4
ROWS = 512


def _full(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(ROWS, 96, generator=g)


def _plain_state(_world_size: int) -> dict:
    """What every rank holds whole: DCP saves each item once (rank 0's)."""
    return {
        **{f"w{i}": _full(i) for i in range(4)},
        "step": 11,
        "schedule": {"lr": 0.25, "milestones": [3, 7]},
    }


def _hsdp_state(world_size: int) -> dict:
    """HSDP's placement on a 2x2 mesh: replicated over dim 0, sharded over dim 1."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return {f"w{i}": distribute_tensor(_full(i), mesh, [Replicate(), Shard(0)]) for i in range(4)}


STATES = {"plain": _plain_state, "hsdp": _hsdp_state}


def _zeroed(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            local.zero_()
            out[key] = value
        elif isinstance(value, dict):
            out[key] = {k: type(v)() for k, v in value.items()}
        else:
            out[key] = type(value)()
    return out


def _check(state: dict, kind: str, world_size: int) -> None:
    expected = STATES[kind](world_size)
    for key, value in expected.items():
        got = state[key]
        if isinstance(value, torch.Tensor):
            if hasattr(value, "to_local"):
                got, value = got.to_local(), value.to_local()
            assert torch.equal(got, value), key
        else:
            assert got == value, key


def _save(rank: int, world_size: int, uri: str, kind: str) -> None:
    dcpstore.save(STATES[kind](world_size), uri).result()


def _stock_save(rank: int, world_size: int, path: str, kind: str) -> None:
    dcp.save(STATES[kind](world_size), storage_writer=dcp.FileSystemWriter(path))


def _load(rank: int, world_size: int, uri: str, kind: str) -> None:
    state = _zeroed(STATES[kind](world_size))
    dcpstore.load(state, uri)
    _check(state, kind, world_size)


def _fetched_and_stored(endpoint: S3Endpoint, proxy: FaultProxy, prefix: str) -> tuple[int, int]:
    """Bytes of the data files fetched through the proxy, and stored."""
    client = endpoint.client()
    listing = client.list_objects_v2(Bucket=endpoint.bucket, Prefix=f"{prefix}/")["Contents"]
    stored = {f"/{endpoint.bucket}/{o['Key']}": o["Size"] for o in listing if o["Key"].endswith(".distcp")}
    fetched = sum(n for path, n in proxy.stats.got.items() if path in stored)
    return fetched, sum(stored.values())


@pytest.mark.parametrize("kind", sorted(STATES))
@pytest.mark.parametrize("writer", ["dcpstore", "stock"])
def test_each_stored_byte_is_fetched_once_per_job(
    kind: str, writer: str, s3_endpoint: S3Endpoint, proxy: FaultProxy, tmp_path: Path
) -> None:
    prefix = f"shared-reads-{kind}-{writer}"
    uri = f"s3://{s3_endpoint.bucket}/{prefix}"
    s3_endpoint.delete_prefix(f"{prefix}/")
    if writer == "dcpstore":
        run_ranks(_save, WORLD, uri, kind)
    else:  # stock DCP's files, uploaded as they are
        run_ranks(_stock_save, WORLD, str(tmp_path), kind)
        client = s3_endpoint.client()
        for f in tmp_path.iterdir():
            client.put_object(Bucket=s3_endpoint.bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    proxy.stats.got.clear()
    proxy.stats.by_key.clear()
    proxy.stats.requests.clear()
    run_ranks(_load, WORLD, uri, kind)
    fetched, stored = _fetched_and_stored(s3_endpoint, proxy, prefix)
    # Without sharing: 4.00x (plain: every rank reads every item) and 2.00x (hsdp: each shard by 2 replicas).
    assert stored > 0 and fetched / stored <= 1.05, (fetched, stored)
    # The commit too is read once per job, not once per rank: .metadata, the manifest, one listing.
    commit_reads = {key: n for (kind_, key), n in proxy.stats.by_key.items() if kind_ == "GetObject" and "/." in key}
    metadata_key = f"/{s3_endpoint.bucket}/{prefix}/.metadata"
    assert commit_reads.get(metadata_key) == 1, commit_reads
    assert all(n == 1 for n in commit_reads.values()), commit_reads
    assert proxy.stats.requests["ListObjectsV2"] == 1, proxy.stats.requests


def _load_damaged(rank: int, world_size: int, uri: str, kind: str) -> None:
    state = _zeroed(STATES[kind](world_size))
    with pytest.raises(dcpstore.CheckpointCorrupt, match="checksum mismatch"):
        dcpstore.load(state, uri)


def test_a_damaged_shared_item_fails_the_load_on_every_rank_with_its_own_error(tmp_path: Path) -> None:
    """Whichever rank reads the damaged item for the others, every rank
    raises the corruption, not merely "another rank failed"."""
    uri = str(tmp_path / "ck")
    run_ranks(_save, WORLD, uri, "plain")
    data = max((p for p in Path(uri).iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:  # one byte in the middle of the tensors
        f.seek(data.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    run_ranks(_load_damaged, WORLD, uri, "plain")


def _load_failing_early(rank: int, world_size: int, uri: str, kind: str) -> None:
    if rank == 3:  # fails before its part of the exchange begins (a file's size, on its node)

        def fail(self: DcpStorageReader, every_file: object) -> None:
            raise dcpstore.CheckpointCorrupt("injected: rank 3 found a data file truncated")

        DcpStorageReader._check_sizes = fail  # type: ignore[method-assign,assignment]
    state = _zeroed(STATES[kind](world_size))
    with pytest.raises(dcpstore.CheckpointCorrupt, match="injected: rank 3"):
        dcpstore.load(state, uri)


def test_a_rank_failing_before_the_exchange_fails_the_load_on_every_rank_promptly(tmp_path: Path) -> None:
    """The failing rank still takes part in the exchange's first round, to
    tell the others: they would otherwise wait there for it, while it waits
    for them in DCP's own collective."""
    uri = str(tmp_path / "ck")
    run_ranks(_save, WORLD, uri, "plain")
    run_ranks(_load_failing_early, WORLD, uri, "plain", timeout=90)


def _load_and_die(rank: int, world_size: int, port: int, env: dict, uri: str, out: str) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if rank == 1:  # dies as it starts reading what it reads for the others
        DcpStorageReader._read_pieces = lambda self, group, batch, lock: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment,method-assign]
    state = _zeroed(_plain_state(world_size))
    try:
        dcpstore.load(state, uri)
        result = "loaded"
    except BaseException as e:
        result = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    Path(out, f"rank{rank}").write_text(result)
    os._exit(0)  # no barrier or teardown with a dead peer


def test_a_rank_killed_in_the_exchange_fails_the_load_on_every_other_rank(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_save, WORLD, uri, "plain")
    out = tmp_path / "out"
    out.mkdir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port = free_port()
    procs = [
        ctx.Process(target=_load_and_die, args=(rank, WORLD, port, dict(os.environ), uri, str(out)))
        for rank in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        p.kill()
    assert not alive, f"ranks {alive} still waiting two minutes after rank 1 died (a hang)"
    assert procs[1].exitcode == -signal.SIGKILL
    for rank in (0, 2, 3):
        result = (out / f"rank{rank}").read_text()
        assert result.startswith("PeerFailed: load from"), result
        assert uri in result.splitlines()[0] and "was a rank lost?" in result, result


def _load_after_a_replaced_commit_read(rank: int, world_size: int, uri: str, kind: str) -> None:
    """The coordinator's first commit read fails as a replacing save's would
    make it fail: every rank must load again (or none), in step."""
    if rank == 0:
        calls = []
        original = DcpStorageReader.commit_for_sharing

        def first_fails(self: DcpStorageReader) -> object:
            calls.append(1)
            if len(calls) == 1:
                self._commit_crc = 0  # it had read a .metadata, which another save then replaced
                raise dcpstore.CheckpointCorrupt("injected: the files it names are gone")
            return original(self)

        DcpStorageReader.commit_for_sharing = first_fails  # type: ignore[method-assign,assignment]
        DcpStorageReader.replaced = lambda self: True  # type: ignore[method-assign]
    state = _zeroed(STATES[kind](world_size))
    dcpstore.load(state, uri)
    _check(state, kind, world_size)


def test_a_commit_read_that_met_a_replacing_save_is_tried_again_on_every_rank(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_save, 2, uri, "plain")
    run_ranks(_load_after_a_replaced_commit_read, 2, uri, "plain", timeout=90)


def _load_with_a_coordinator_failing_otherwise(rank: int, world_size: int, uri: str, kind: str) -> None:
    if rank == 0:

        def fail(self: DcpStorageReader) -> object:
            raise RuntimeError("injected: not a checkpoint error")

        DcpStorageReader.commit_for_sharing = fail  # type: ignore[method-assign,assignment]
    state = _zeroed(STATES[kind](world_size))
    expected = (RuntimeError, "injected") if rank == 0 else (dcpstore.LoadError, "could not read the commit")
    with pytest.raises(expected[0], match=expected[1]):
        dcpstore.load(state, uri)


def test_a_coordinator_failing_its_commit_read_fails_every_rank_promptly(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_save, 2, uri, "plain")
    run_ranks(_load_with_a_coordinator_failing_otherwise, 2, uri, "plain", timeout=90)
