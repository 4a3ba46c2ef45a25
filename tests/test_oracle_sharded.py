"""Stock DCP as the oracle for sharded state: DTensors saved on one world
size and loaded on another, by dcpstore and by stock DCP, both ways.

Every rank builds the same global tensors from seeds and places each on a
1-D CPU mesh (Shard(0), Shard(1) or Replicate). The sizes do not divide the
world sizes, so shards are uneven and some are empty; one tensor is large
enough per shard (64 KiB and more) for the reader's in-place path, and
reloaded with another placement it is read as sub-boxes of the stored
chunks. Two ranks save it with each dcpstore engine and with stock
``dcp.save``; three ranks load every one of those checkpoints with
``dcpstore.load`` and with stock ``dcp.load``, into other placements. Every
loaded tensor, gathered whole, must be bitwise the global tensor; a plain
tensor and a scalar beside the DTensors must come back too.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import dcpstore
from dist_utils import run_ranks
from dcpstore.engines import nvrx
from oracle import SAVE_ENGINES, assert_same_tensor

#: name -> (global shape, dtype, placement saved with, placement loaded into).
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, Placement, Placement]] = {
    "rows": ((7, 5), torch.float32, Shard(0), Shard(1)),
    "vector": ((5,), torch.bfloat16, Shard(0), Replicate()),
    "cube": ((3, 9, 2), torch.int64, Shard(1), Shard(0)),
    "one_row": ((1, 4), torch.complex64, Shard(0), Shard(1)),  # an empty shard on every rank but one
    "replicated": ((6, 6), torch.float16, Replicate(), Shard(0)),
    "large": ((129, 300), torch.float32, Shard(0), Shard(1)),  # 75 KiB+ per saved shard: read in place
}
SAVED_ON, LOADED_ON = 2, 3
#: Every engine this install has (NVRx is optional).
ENGINES = [e for e in SAVE_ENGINES if e != "nvrx" or nvrx.import_error() is None]


def _global(name: str) -> torch.Tensor:
    shape, dtype, _, _ = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)  # every bit pattern: NaN payloads and -0.0 included


def _state(loading: bool) -> dict[str, Any]:
    """The state to save (``loading=False``) or a destination full of another
    value in the load placements."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state: dict[str, Any] = {}
    for name, (_, _, saved, loaded) in TENSORS.items():
        value = _global(name)
        if loading:
            value = torch.zeros_like(value).view(torch.uint8).fill_(0x5A).view(value.dtype) if value.numel() else value
        state[name] = distribute_tensor(value, mesh, [loaded if loading else saved])
    state["plain"] = torch.arange(11.0) if not loading else torch.full((11,), -1.0)
    state["step"] = 0 if loading else 42
    return state


def _check(state: dict[str, Any], where: str) -> None:
    for name in TENSORS:
        got = state[name]
        assert isinstance(got, DTensor), f"{where}: {name} is a {type(got).__name__}"
        assert got.placements == (TENSORS[name][3],), f"{where}: {name} changed placement to {got.placements}"
        assert_same_tensor(got.full_tensor(), _global(name), f"{where}: {name}")
    assert_same_tensor(state["plain"], torch.arange(11.0), f"{where}: plain")
    assert state["step"] == 42, f"{where}: step {state['step']!r}"


def _save_job(rank: int, world: int, root: str) -> None:
    for engine in ENGINES:
        dcpstore.save(_state(loading=False), os.path.join(root, engine), **SAVE_ENGINES[engine]).result(timeout=120)
    dcp.save(_state(loading=False), checkpoint_id=os.path.join(root, "stock"))


def _load_job(rank: int, world: int, root: str) -> None:
    for saved_by in [*ENGINES, "stock"]:
        path = os.path.join(root, saved_by)
        ours = _state(loading=True)
        dcpstore.load(ours, path)
        _check(ours, f"{saved_by} checkpoint, dcpstore.load on {world} ranks")
        stock = _state(loading=True)
        dcp.load(stock, checkpoint_id=path)
        _check(stock, f"{saved_by} checkpoint, stock dcp.load on {world} ranks")


def test_sharded_state_saved_and_loaded_across_world_sizes_matches_stock_dcp(tmp_path: Any) -> None:
    root = str(tmp_path)
    run_ranks(_save_job, SAVED_ON, root)
    assert all(os.path.exists(os.path.join(root, engine, ".dcpstore.json")) for engine in ENGINES)
    run_ranks(_load_job, LOADED_ON, root)
