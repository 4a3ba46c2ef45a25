"""Megatron's state-dict formats (:data:`FORMATS`, Megatron-Bridge's
``ckpt_format`` values; :func:`dcpstore.adapters.fsdp.save_app_state` takes
them as ``format``; :class:`~dcpstore.adapters.megatron.CheckpointConfig`
checks its ``ckpt_format`` against them):

``fsdp_dtensor``
    DCP receives FSDP2's own DTensor shards (``full_state_dict=False``).
``torch_dist``
    Every DTensor is handed to DCP as a torch ``ShardedTensor`` over the same
    local storage: each rank's shard with its global shape and offsets, built
    from one metadata all-gather per mesh (no copies). That is what Megatron's
    ``torch_dist`` strategy hands DCP. Megatron additionally stores its
    distributed-optimizer state as *flattened* 1-D ranges, which ties those
    files to the data-parallel size; that layout is deliberately not
    reproduced: FSDP2 shards are row ranges of the original shape, so both
    formats stay fully reshardable. ``torch_dist`` needs a 1-D device mesh
    (plain FSDP2); use ``fsdp_dtensor`` for HSDP/TP meshes. ShardedTensor is
    deprecated in torch in favour of DTensor, hence ``fsdp_dtensor`` is the
    default.

On storage the two are identical -- stock DCP chunked tensors with global
shapes and offsets -- so either loads into the other, on any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.torch_compat import Shard as StShard
from dcpstore._impl.util.torch_compat import (
    ShardedTensor,
    ShardedTensorMetadata,
    ShardedTensorProperties,
    ShardMetadata,
    compute_local_shape_and_global_offset,
)


@dataclass(frozen=True)
class StateDictFormat:
    """How a model/optimizer section is handed to DCP."""

    name: str
    summary: str
    #: Turns a section of DTensors into what DCP receives (collective).
    convert: Callable[[dict[str, Any]], dict[str, Any]]


def _as_is(section: dict[str, Any]) -> dict[str, Any]:
    return section


def _as_sharded_tensors(section: dict[str, Any]) -> dict[str, Any]:
    """DTensors -> torch ShardedTensors over the same local storage."""
    dtensors = {k: v for k, v in section.items() if isinstance(v, DTensor)}
    if not dtensors:
        return dict(section)
    pieces = _gather_pieces(dtensors)
    me = dist.get_rank()
    out = dict(section)
    for key, dt in dtensors.items():
        shards_md, mine = [], None
        for rank, device, offsets, sizes in pieces[key]:
            md = ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=f"rank:{rank}/{device}")
            shards_md.append(md)
            if rank == me:
                mine = md
        props = ShardedTensorProperties(dtype=dt.dtype, layout=torch.strided, requires_grad=False)
        st_md = ShardedTensorMetadata(shards_metadata=shards_md, size=dt.shape, tensor_properties=props)
        local = [StShard(tensor=dt.to_local().detach(), metadata=mine)] if mine is not None else []
        out[key] = ShardedTensor._init_from_local_shards_and_global_metadata(local, st_md)
    return out


def _gather_pieces(dtensors: dict[str, DTensor]) -> dict[str, list[tuple[int, str, tuple[int, ...], tuple[int, ...]]]]:
    """Every rank's (rank, device, offsets, sizes) of each DTensor, from one
    all-gather per device mesh. Zero-size pieces and the non-first copies of
    replicated ones are left out: a ShardedTensor's shards must not overlap."""
    by_mesh: dict[int, list[str]] = {}
    for key, dt in dtensors.items():
        mesh = dt.device_mesh
        if mesh.ndim != 1:
            raise InvalidArgument(
                f"format 'torch_dist' needs a 1-D device mesh (plain FSDP2); {key!r} lives on a "
                f"{mesh.ndim}-D mesh: use format 'fsdp_dtensor'"
            )
        if not all(isinstance(p, (Shard, Replicate)) for p in dt.placements):
            raise InvalidArgument(f"format 'torch_dist' cannot express {key!r} with placements {dt.placements}")
        by_mesh.setdefault(id(mesh), []).append(key)
    result: dict[str, list[tuple[int, str, tuple[int, ...], tuple[int, ...]]]] = {k: [] for k in dtensors}
    for keys in by_mesh.values():
        mesh = dtensors[keys[0]].device_mesh
        mine: dict[str, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
        for key in keys:
            dt = dtensors[key]
            sizes, offsets = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
            replica = isinstance(dt.placements[0], Replicate) and mesh.get_local_rank() != 0
            empty = any(s == 0 for s in sizes)
            mine[key] = None if replica or empty else (tuple(offsets), tuple(sizes))
        device = str(dtensors[keys[0]].to_local().device)
        gathered: list[Any] = [None] * mesh.size()
        dist.all_gather_object(gathered, (dist.get_rank(), device, mine), group=mesh.get_group())
        for rank, dev, pieces in gathered:
            for key, piece in pieces.items():
                if piece is not None:
                    result[key].append((rank, dev, piece[0], piece[1]))
    return result


FORMATS: Mapping[str, StateDictFormat] = {
    f.name: f
    for f in (
        StateDictFormat("fsdp_dtensor", "DTensor shards, as FSDP2 holds them", _as_is),
        StateDictFormat(
            "torch_dist",
            "torch ShardedTensors (global shape + row offsets), as Megatron's torch_dist",
            _as_sharded_tensors,
        ),
    )
}
DEFAULT_FORMAT = "fsdp_dtensor"


def check_format(name: str) -> StateDictFormat:
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {name!r}") from None
