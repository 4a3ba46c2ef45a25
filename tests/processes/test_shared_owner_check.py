"""One ownership check per save, shared by every rank over the save's
process group (``DcpStorageWriter.exchange_owner_check`` through
``owner_gate.run_shared_gated``).

What must hold with real gloo ranks: the in-flight marker is read a fixed
number of times per save, not once per rank (at 16,384 ranks one key would
take 16,384 GETs in the write phase's last moments); and the guarantee the
per-rank check gave is kept: a URI taken over after the files were written
publishes no data file of the losing save, on any rank, and every rank
fails naming the cause.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate, run_shared_gated
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.format.layout import INFLIGHT, METADATA, is_data_file
from tests.support.dist_utils import run_ranks
from tests.support.faultproxy import FaultProxy
from tests.support.s3_server import S3Endpoint

RANKS = 4


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {f"r{rank}.t{i}": torch.full((1000 + i,), float(rank)) for i in range(4)}


def _save(rank: int, world_size: int, uri: str) -> None:
    dcpstore.save(_state(rank), uri, workers=2).result()


def test_the_marker_is_read_twice_per_save_whatever_the_ranks(proxy: FaultProxy, s3_endpoint: S3Endpoint) -> None:
    """4 ranks, 2 files each, through a counting proxy to the S3 endpoint:
    the shared check and the commit read the marker; no rank reads it on
    its own (that was 1 + 4 reads, and 1 + N at N ranks)."""
    prefix = f"shared-check-{os.getpid()}"
    uri = f"s3://{s3_endpoint.bucket}/{prefix}"
    run_ranks(_save, RANKS, uri)
    marker = f"/{s3_endpoint.bucket}/{prefix}/{INFLIGHT}"
    reads = sum(n for (kind, path), n in proxy.stats.by_key.items() if path == marker and kind != "PutObject")
    assert reads == 2, proxy.stats.by_key
    state: dict[str, Any] = {k: torch.zeros_like(v) for r in range(RANKS) for k, v in _state(r).items()}
    dcpstore.load(state, uri)
    assert all(torch.equal(v, _state(int(k[1:].split(".")[0]))[k]) for k, v in state.items())


def _save_taken_over_by_rank1(rank: int, world_size: int, uri: str) -> None:
    """Rank 1 replaces the marker after writing its files, before the one check."""
    if rank == 1:
        write_file = DcpStorageWriter.write_file

        def taking_over(self: DcpStorageWriter, storage: Any, name: str, items: Any, *a: Any) -> Any:
            gate: OwnerGate = a[1]
            real_wait = gate.wait

            def wait() -> None:
                storage.put(INFLIGHT, b"a-later-save")
                real_wait()

            gate.wait = wait  # type: ignore[method-assign]
            return write_file(self, storage, name, items, *a)

        DcpStorageWriter.write_file = taking_over  # type: ignore[method-assign]
    with pytest.raises(dcpstore.SaveError, match="another save"):
        dcpstore.save(_state(rank), uri, workers=2)


def test_a_uri_taken_over_on_one_rank_publishes_no_file_on_any(s3_endpoint: S3Endpoint) -> None:
    prefix = f"taken-over-{os.getpid()}"
    run_ranks(_save_taken_over_by_rank1, 3, f"s3://{s3_endpoint.bucket}/{prefix}")
    listed = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=f"{prefix}/")
    names = [o["Key"].removeprefix(f"{prefix}/") for o in listed.get("Contents", [])]
    assert not any(is_data_file(n) for n in names), names
    assert METADATA not in names
    marker = s3_endpoint.client().get_object(Bucket=s3_endpoint.bucket, Key=f"{prefix}/{INFLIGHT}")
    assert marker["Body"].read() == b"a-later-save"


def _fail_before_writing_on_rank1(rank: int, world_size: int, uri: str) -> None:
    if rank == 1:

        def broken(self: DcpStorageWriter, items: Any) -> Any:
            raise OSError("rank 1 cannot split its items")

        DcpStorageWriter.bucket_items = broken  # type: ignore[method-assign]
    with pytest.raises(dcpstore.CheckpointError, match="rank 1 cannot split its items"):
        dcpstore.save(_state(rank), uri, workers=2)


def test_a_rank_failing_before_its_files_leaves_no_rank_waiting(s3_endpoint: S3Endpoint) -> None:
    """It still joins the one check's exchange, so the others get past it
    and every rank fails with its error (a hang would time the job out)."""
    prefix = f"fails-early-{os.getpid()}"
    run_ranks(_fail_before_writing_on_rank1, 3, f"s3://{s3_endpoint.bucket}/{prefix}", timeout=90)
    listed = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=f"{prefix}/")
    assert METADATA not in [o["Key"].removeprefix(f"{prefix}/") for o in listed.get("Contents", [])]


def _save_local(rank: int, world_size: int, uri: str) -> None:
    from dcpstore._impl.dcp.liveness import inflight_marker

    reads = []
    real = inflight_marker.read_capped

    def counted(*a: Any, **k: Any) -> bytes:
        reads.append(a[1])
        return real(*a, **k)

    inflight_marker.read_capped = counted  # type: ignore[assignment]
    dcpstore.save(_state(rank), uri, workers=2).result()
    # A directory of this machine's filesystem may be each node's own (a
    # tiered manager's node directories): every rank checks its own marker.
    assert reads.count(INFLIGHT) == (2 if rank == 0 else 1), reads


def test_on_a_local_path_every_rank_checks_its_own_marker(tmp_path: Any) -> None:
    run_ranks(_save_local, 2, str(tmp_path / "ck"))


# -- the shared gate on its own -------------------------------------------------


def _work(fail: str | None = None) -> Any:
    def work(item: str, gate: OwnerGate) -> str:
        if item == fail:
            raise OSError(f"{item} failed")
        gate.wait()
        return item

    return work


def test_the_exchange_runs_once_on_the_calling_thread_after_every_file_is_ready() -> None:
    calls: list[tuple[bool, str]] = []

    def exchange(ready: bool) -> BaseException | None:
        calls.append((ready, threading.current_thread().name))
        return None

    assert run_shared_gated(exchange, _work(), ["a", "b", "c"], "t") == ["a", "b", "c"]
    assert calls == [(True, threading.current_thread().name)]


def test_a_failed_check_is_raised_by_every_file_and_publishes_none() -> None:
    published: list[str] = []

    def work(item: str, gate: OwnerGate) -> str:
        gate.wait()
        published.append(item)
        return item

    with pytest.raises(dcpstore.SaveError, match="taken over"):
        run_shared_gated(lambda ready: dcpstore.SaveError("taken over"), work, ["a", "b"], "t")
    assert published == []


@pytest.mark.parametrize("items, fail", [(["a", "b", "c"], "b"), ([], None)])
def test_a_rank_that_cannot_get_there_still_joins_the_exchange(items: list[str], fail: str | None) -> None:
    """So that no other rank waits for it forever: it reports not ready."""
    calls: list[bool] = []

    def exchange(ready: bool) -> BaseException | None:
        calls.append(ready)
        return None

    if fail:
        with pytest.raises((OSError, dcpstore.SaveError), match="b failed"):
            run_shared_gated(exchange, _work(fail), items, "t")
    else:
        assert run_shared_gated(exchange, _work(fail), items, "t") == []
    assert calls == [False]
