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

The slow run adds random layouts: ten tensors of random shapes and dtypes
with random placements on a 2 x 2 mesh of four ranks, loaded by three ranks
with other random placements and by one process without torch.distributed.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import dcpstore
from tests.support import extras
from tests.support.dist_utils import run_ranks
from tests.support.oracle import SAVE_ENGINES, assert_same_tensor, destination

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
#: Every engine this install has (NVRx is optional: a test that ran without
#: it ends in a skip that says so, a failure under CI).
ENGINES = [e for e in SAVE_ENGINES if e != "nvrx" or extras.missing(extras.NVRX) is None]
NO_NVRX = "the NVRx engine's checkpoints were not compared (every other engine's were)"


def _values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of ``dtype``, every bit pattern included (NaN payloads, -0.0)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    numel = 1
    for n in shape:
        numel *= n
    return torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def _global(name: str) -> torch.Tensor:
    shape, dtype, _, _ = TENSORS[name]
    return _values(shape, dtype, sum(map(ord, name)))


def _state(loading: bool) -> dict[str, Any]:
    """The state to save (``loading=False``) or a destination full of another
    value in the load placements."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state: dict[str, Any] = {}
    for name, (_, _, saved, loaded) in TENSORS.items():
        value = _global(name)
        if loading:
            value = destination(value, fill=0x5A)
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
    extras.skip_unless(extras.NVRX, NO_NVRX)


# -- random layouts (slow) ----------------------------------------------------

#: dtypes of the random layouts: widths 1-8, floats, ints, bool, complex.
RANDOM_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int8,
    torch.float64,
    torch.complex64,
    torch.bool,
    torch.uint8,
    torch.int32,
]
RANDOM_SEEDS = range(4)


def _random_spec(seed: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Ten tensors of 1-3 dimensions whose sizes rarely divide a mesh's."""
    r = random.Random(seed)
    sizes = [1, 2, 3, 5, 7, 11, 64, 130]
    shapes = [tuple(r.choice(sizes) for _ in range(r.randint(1, 3))) for _ in range(10)]
    return [(f"t{i}", shape, r.choice(RANDOM_DTYPES)) for i, shape in enumerate(shapes)]


def _random_global(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _values(shape, dtype, sum(map(ord, name)) + 1000 * len(shape))


def _random_state(seed: int, placement_seed: int, *, loading: bool) -> dict[str, Any]:
    """The random tensors on this world's mesh (2 x 2 for four ranks, else
    1-D), each mesh dimension a random Replicate or Shard."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2) if world == 4 else (world,))
    r = random.Random(placement_seed)
    state = {}
    for name, shape, dtype in _random_spec(seed):
        value = _random_global(name, shape, dtype)
        if loading:
            value = destination(value, fill=0x5A)
        placements = [r.choice([Replicate(), *(Shard(d) for d in range(len(shape)))]) for _ in range(mesh.ndim)]
        state[name] = distribute_tensor(value, mesh, placements)
    return state


def _random_save_job(rank: int, world: int, root: str, seed: int) -> None:
    for engine in ENGINES:
        path = os.path.join(root, engine)
        dcpstore.save(_random_state(seed, seed + 1, loading=False), path, **SAVE_ENGINES[engine]).result(timeout=120)
    dcp.save(_random_state(seed, seed + 1, loading=False), checkpoint_id=os.path.join(root, "stock"))


def _random_load_job(rank: int, world: int, root: str, seed: int) -> None:
    for saved_by in [*ENGINES, "stock"]:
        path = os.path.join(root, saved_by)
        for reader in ("dcpstore.load", "stock dcp.load"):
            state = _random_state(seed, seed + 2, loading=True)
            if reader == "dcpstore.load":
                dcpstore.load(state, path)
            else:
                dcp.load(state, checkpoint_id=path)
            for name, shape, dtype in _random_spec(seed):
                got = state[name]
                where = f"seed {seed}, {saved_by} checkpoint, {reader} on {world} ranks: {name} {got.placements}"
                assert_same_tensor(got.full_tensor(), _random_global(name, shape, dtype), where)


@pytest.mark.slow
def test_random_layouts_on_two_dimensional_meshes_match_stock_dcp(tmp_path: Any) -> None:
    """Four ranks (a 2 x 2 mesh) save random layouts; three ranks and one
    process without torch.distributed load them, with both readers."""
    for seed in RANDOM_SEEDS:
        root = str(tmp_path / f"seed{seed}")
        run_ranks(_random_save_job, 4, root, seed)
        run_ranks(_random_load_job, 3, root, seed)
        expected = {name: _random_global(name, shape, dtype) for name, shape, dtype in _random_spec(seed)}
        for saved_by in [*ENGINES, "stock"]:
            plain = {name: destination(value, fill=0x5A) for name, value in expected.items()}
            dcpstore.load(plain, os.path.join(root, saved_by))
            for name, value in expected.items():
                assert_same_tensor(plain[name], value, f"seed {seed}, {saved_by} checkpoint, one process: {name}")
    extras.skip_unless(extras.NVRX, NO_NVRX)
