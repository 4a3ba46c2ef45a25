"""Async saves across real ranks: gloo process groups in spawned processes.

Each job runs every scenario in one set of processes (start-up dominates):
every engine saves and reloads (plain tensors, a replicated tensor, a DTensor
and per-rank tensors), training collectives run on the default group while
the background save runs its own, NVRx's plan cache survives repeated saves
and a structure change on one rank only, a write failure on one rank commits
nothing and raises on every rank, and so do ranks that chose different
engines. The process engine's checkpoint process SIGKILLed on one rank
mid-save fails the save on every rank, naming that rank, within seconds,
and the next save starts new ones and commits.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

import dcpstore
from dcpstore._impl.util.errors import CheckpointNotFound, SaveError
from tests.support.async_helpers import ENGINES, GatedPlanner
from tests.support.dist_utils import run_ranks


def _state(rank: int, world: int, mesh: object, step: int, rows: int = 8) -> dict[str, object]:
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(world * 4 * 6, dtype=torch.float32).reshape(world * 4, 6) + step
    return {
        "replicated": torch.full((5,), float(step)),
        f"rank{rank}": torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) + rank * 100 + step,
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "meta": {"step": step, "rank_count": world},
    }


def _empty_like_state(state: dict[str, object]) -> dict[str, object]:
    from torch.distributed.tensor import DTensor

    out: dict[str, object] = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            out[k] = DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = {"step": -1, "rank_count": -1}
    return out


def _check_loaded(loaded: dict[str, object], expected: dict[str, object]) -> None:
    from torch.distributed.tensor import DTensor

    for k, v in expected.items():
        got = loaded[k]
        if isinstance(v, DTensor):
            assert isinstance(got, DTensor)
            assert torch.equal(got.to_local(), v.to_local()), k
        elif isinstance(v, torch.Tensor):
            assert torch.equal(got, v), k  # type: ignore[arg-type]
        else:
            assert got == v, k


def _mutate(state: dict[str, object]) -> None:
    from torch.distributed.tensor import DTensor

    for v in state.values():
        if isinstance(v, DTensor):
            v.to_local().add_(1000)
        elif isinstance(v, torch.Tensor):
            v.add_(1000)


def _worker(rank: int, world: int, root: str) -> None:
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    saver = dcpstore.AsyncSaver(collective_timeout=timedelta(seconds=120))
    for engine in ENGINES:
        _roundtrip(rank, world, mesh, saver, engine, os.path.join(root, f"ok-{engine}"))
        _repeated_and_changed_structure(rank, world, mesh, saver, engine, os.path.join(root, f"rep-{engine}"))
        _one_rank_fails(rank, world, mesh, saver, engine, os.path.join(root, f"fail-{engine}"))
    _ranks_disagree_on_engine(rank, world, mesh, saver, os.path.join(root, "mixed"))
    _checkpoint_process_killed(rank, world, mesh, saver, root)
    # The module-level API (per-process default saver) across ranks too.
    uri = os.path.join(root, "default-saver")
    state = _state(rank, world, mesh, step=7)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in state.items()}  # type: ignore[call-overload]
    handle = dcpstore.save(state, uri, async_=True, engine="native")
    _mutate(state)
    handle.result(timeout=120)
    loaded = _empty_like_state(state)
    dcpstore.load(loaded, uri)
    _check_loaded(loaded, expected)
    saver.close()


def _roundtrip(rank: int, world: int, mesh: object, saver: dcpstore.AsyncSaver, engine: str, uri: str) -> None:
    state = _state(rank, world, mesh, step=1)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in state.items()}  # type: ignore[call-overload]
    handle = saver.save(state, uri, options=dcpstore.SaveOptions(engine=engine, workers=2))
    _mutate(state)  # the next "optimizer step", before the write is done
    # Training collectives on the default group while the save runs its own.
    for _ in range(5):
        t = torch.ones(4)
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((4,), float(world)))
    info = handle.result(timeout=120)
    assert info.engine == engine and info.bytes_written > 0
    assert all(f.startswith(f"__{rank}_") for f in info.files), info.files
    dist.barrier()
    names = set(os.listdir(uri))
    assert {".metadata", ".dcpstore.json"} <= names
    assert {f"__{r}_0.distcp" for r in range(world)} <= names
    loaded = _empty_like_state(state)
    dcpstore.load(loaded, uri)
    _check_loaded(loaded, expected)
    dist.barrier()


def _repeated_and_changed_structure(
    rank: int, world: int, mesh: object, saver: dcpstore.AsyncSaver, engine: str, root: str
) -> None:
    # Several saves of one structure (NVRx reuses its plan from the second on),
    # then rank 1 alone changes a tensor's shape: every rank must re-plan
    # (at world 4, ranks that never saw the change too).
    for step in range(4):
        rows = 8 if step < 3 or rank != 1 else 12
        state = _state(rank, world, mesh, step=step, rows=rows)
        expected = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in state.items()}  # type: ignore[call-overload]
        uri = os.path.join(root, f"step{step}")
        handle = saver.save(state, uri, options=dcpstore.SaveOptions(engine=engine, workers=2))
        _mutate(state)
        handle.result(timeout=120)
        if engine == "nvrx":
            # NVRx reuses its plan once two consecutive plans matched on every
            # rank (the round trip above saved this structure already); rank
            # 1's change at step 3 resets every rank's cache.
            ((_, cache),) = saver._engines["nvrx"].caches.values()  # type: ignore[attr-defined]
            assert cache.validated_cache_reuse == (step < 3), (step, cache.validated_cache_reuse)
        dist.barrier()
        loaded = _empty_like_state(state)
        dcpstore.load(loaded, uri)
        _check_loaded(loaded, expected)


def _one_rank_fails(rank: int, world: int, mesh: object, saver: dcpstore.AsyncSaver, engine: str, uri: str) -> None:
    # A committed checkpoint, then a save beside it whose rank-1 write fails:
    # a directory squats on rank 1's first data file (a save to a fresh URI
    # writes stock DCP's names).
    state = _state(rank, world, mesh, step=3)
    saver.save(state, uri, options=dcpstore.SaveOptions(engine=engine, workers=2)).result(timeout=120)
    failing = uri + "-failing"
    dist.barrier()
    if rank == 1:
        os.makedirs(os.path.join(failing, "__1_0.distcp"))
    dist.barrier()
    handle = saver.save(state, failing, options=dcpstore.SaveOptions(engine=engine, workers=2))
    with pytest.raises(SaveError) as info:
        handle.result(timeout=120)
    assert "rank 1" in str(info.value) or rank == 1, str(info.value)
    assert failing in str(info.value)
    dist.barrier()
    assert not os.path.exists(os.path.join(failing, ".metadata"))
    # The coordinator released its claim: nothing says the save still runs, so gc may collect it.
    assert not [n for n in os.listdir(failing) if n.startswith(".dcpstore.alive.")], os.listdir(failing)
    with pytest.raises(CheckpointNotFound):
        dcpstore.load(_empty_like_state(state), failing)
    loaded = _empty_like_state(state)
    dcpstore.load(loaded, uri)  # the committed one beside it: untouched
    dist.barrier()
    if rank == 1:
        os.rmdir(os.path.join(failing, "__1_0.distcp"))
    dist.barrier()
    # The saver (and its background group) still works after the failure.
    saver.save(state, failing, options=dcpstore.SaveOptions(engine=engine, workers=2)).result(timeout=120)
    dist.barrier()
    assert os.path.exists(os.path.join(failing, ".metadata"))


def _ranks_disagree_on_engine(rank: int, world: int, mesh: object, saver: dcpstore.AsyncSaver, uri: str) -> None:
    # As if engine="auto" chose otherwise on the last rank (its CPU
    # affinity or CUDA differs; one rank of ``world`` disagrees): refused
    # on every rank, no hang.
    state = _state(rank, world, mesh, step=4)
    handle = saver.save(state, uri, options=dcpstore.SaveOptions(engine="native" if rank == world - 1 else "nvrx"))
    with pytest.raises(SaveError, match="different async engines"):
        handle.result(timeout=120)
    dist.barrier()
    assert not os.path.exists(os.path.join(uri, ".metadata"))


def checkpoint_processes() -> list[int]:
    """The pids of this process's checkpoint processes (the process engine's)."""
    return [p.pid for p in psutil.Process().children() if "dcpstore._impl.engines.process" in " ".join(p.cmdline())]


def _checkpoint_process_killed(rank: int, world: int, mesh: object, saver: dcpstore.AsyncSaver, root: str) -> None:
    # Every rank's save is held before it plans; then rank 1's checkpoint
    # process is SIGKILLed and the others go on: they must not wait for it.
    state = _state(rank, world, mesh, step=6)
    uri = os.path.join(root, "killed")
    planner = GatedPlanner("setup")
    handle = saver.save(state, uri, options=dcpstore.SaveOptions(engine="process", planner=planner))
    assert planner.reached.wait(120)
    (before,) = checkpoint_processes()
    dist.barrier()
    if rank == 1:
        os.kill(before, signal.SIGKILL)
    dist.barrier()
    started = time.monotonic()
    planner.gate.set()
    with pytest.raises(SaveError, match=r"checkpoint process died \(rank 1: pid \d+, killed by SIGKILL\)") as info:
        handle.result(timeout=60)  # a hang would raise TimeoutError instead
    assert uri in str(info.value)
    assert time.monotonic() - started < 60
    dist.barrier()
    assert not os.path.exists(os.path.join(uri, ".metadata"))
    # The next save starts a new checkpoint process on every rank and commits.
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else dict(v)) for k, v in state.items()}  # type: ignore[call-overload]
    info2 = saver.save(state, uri, options=dcpstore.SaveOptions(engine="process")).result(timeout=120)
    assert info2.engine == "process"
    (after,) = checkpoint_processes()
    assert after != before
    dist.barrier()
    loaded = _empty_like_state(state)
    dcpstore.load(loaded, uri)
    _check_loaded(loaded, expected)
    dist.barrier()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_multirank_async_save(world: int, tmp_path: object) -> None:
    run_ranks(_worker, world, str(tmp_path), timeout=600)
