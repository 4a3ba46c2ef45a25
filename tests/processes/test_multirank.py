"""Sync saves and loads across real gloo ranks, with resharding."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import dcpstore
from tests.support.dist_utils import run_ranks

FULL = torch.arange(64 * 24, dtype=torch.float32).reshape(64, 24)


def _dtensor_state(world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return {
        "w": distribute_tensor(FULL.clone(), mesh, [Shard(0)]),
        "b": distribute_tensor(FULL[:, 0].clone() * 2, mesh, [Shard(0)]),
        "step": 5,
    }


def _save(rank: int, world_size: int, uri: str) -> None:
    state = _dtensor_state(world_size)
    state[f"rank{rank}_only"] = torch.full((3,), float(rank))  # per-rank key
    info = dcpstore.save(state, uri, workers=2).result()
    assert all(f.startswith(f"__{rank}_") for f in info.files), info.files


def _load(rank: int, world_size: int, uri: str) -> None:
    state = _dtensor_state(world_size)
    for v in state.values():
        if isinstance(v, torch.Tensor):
            v.to_local().zero_()
    state["step"] = 0
    dcpstore.load(state, uri)
    assert torch.equal(state["w"].full_tensor(), FULL)
    assert torch.equal(state["b"].full_tensor(), FULL[:, 0] * 2)
    assert state["step"] == 5


def _fail_on_rank1(rank: int, world_size: int, uri: str) -> None:
    state = _dtensor_state(world_size)
    if rank == 1:
        os.makedirs(uri, exist_ok=True)
        # Make rank 1's first data file name a directory: its write fails.
        os.makedirs(os.path.join(uri, "__1_0.distcp"), exist_ok=True)
    dist.barrier()
    with pytest.raises(dcpstore.SaveError, match="rank 1"):
        dcpstore.save(state, uri, workers=1)
    dist.barrier()
    assert not os.path.exists(os.path.join(uri, ".metadata"))
    # The coordinator released its claim: nothing says the save still runs, so gc may collect it.
    assert not [n for n in os.listdir(uri) if n.startswith(".dcpstore.alive.")], os.listdir(uri)


def test_two_ranks_save_then_two_ranks_and_one_process_load(tmp_path) -> None:
    uri = str(tmp_path / "ck")
    run_ranks(_save, 2, uri)
    files = sorted(f for f in os.listdir(uri) if f.endswith(".distcp"))
    assert {f.split("_")[2] for f in files} == {"0", "1"}
    run_ranks(_load, 2, uri)
    state = {"w": torch.zeros(64, 24), "b": torch.zeros(64), "rank1_only": torch.zeros(3)}
    dcpstore.load(state, uri)  # resharded onto one process without a process group
    assert torch.equal(state["w"], FULL) and torch.equal(state["rank1_only"], torch.ones(3))


def test_one_process_save_then_two_ranks_load(tmp_path) -> None:
    uri = str(tmp_path / "ck")
    dcpstore.save({"w": FULL.clone(), "b": FULL[:, 0] * 2, "step": 5}, uri).result()
    run_ranks(_load, 2, uri)


def test_one_rank_failing_commits_nothing(tmp_path) -> None:
    run_ranks(_fail_on_rank1, 2, str(tmp_path / "ck"))
