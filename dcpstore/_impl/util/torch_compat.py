"""Every name dcpstore takes from torch beyond its public API, in one place.

dcpstore works beneath DCP, and some of what it needs torch keeps private:
DCP's own record of where an item lives (``_StorageInfo``), its stream
transforms, its rank wrapper, the sharded-tensor classes older checkpoints
pickle, the serializer's pieces. Each is imported here and only here
(``tests/unit/test_layers.py`` holds every other module to torch's public
names), so that a torch release that moves one breaks this module alone,
which says what each is for. Names are given without torch's leading
underscore: here they are dcpstore's to use.

Checked against torch 2.10.0, 2.13.0 and 2.14.1: the floor of the range
pyproject.toml declares, constraints.txt's pin, and the newest release the
registry serves. Each name below imports there and is exercised by the
tests: every suite under 2.13.0, ``.ci/run``'s ``TORCH_SUBSET`` under the
two ends. Where a release below the floor lacks one, the table says so.

======================================  ==============================================================  ======================
here                                    torch                                                           checked
======================================  ==============================================================  ======================
StorageInfo, StoragePrefix              ``distributed.checkpoint.filesystem._StorageInfo``,             2.10.0, 2.13.0, 2.14.1
                                        ``._StoragePrefix``
StorageReaderTransforms,                ``distributed.checkpoint.filesystem._StorageReaderTransforms``, 2.10.0, 2.13.0, 2.14.1
StorageWriterTransforms                 ``._StorageWriterTransforms`` (not in 2.6.0)
ExtensionRegistry,                      ``distributed.checkpoint._extension`` (not in 2.6.0)            2.10.0, 2.13.0, 2.14.1
StreamTransformExtension
flatten_state_dict                      ``distributed.checkpoint._nested_dict.flatten_state_dict``      2.10.0, 2.13.0, 2.14.1
set_element, traverse_state_dict        ``distributed.checkpoint._traverse``                            2.10.0, 2.13.0, 2.14.1
wrap_exception                          ``distributed.checkpoint.api._wrap_exception``                  2.10.0, 2.13.0, 2.14.1
DistWrapper, failure_dict               ``distributed.checkpoint.utils._DistWrapper``,                  2.10.0, 2.13.0, 2.14.1
                                        ``._get_failure_dict``
MEM_FORMAT_ENCODING                     ``distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``        2.10.0, 2.13.0, 2.14.1
Shard, ShardedTensor, ShardMetadata,    ``distributed._shard.sharded_tensor`` (and its ``metadata``),   2.10.0, 2.13.0, 2.14.1
ShardedTensorMetadata,                  ``distributed._shard.metadata``
ShardedTensorProperties,
sharded_tensor_metadata
compute_local_shape_and_global_offset   ``distributed.tensor._utils``                                   2.10.0, 2.13.0, 2.14.1
tree_map_only                           ``utils._pytree.tree_map_only``                                 2.10.0, 2.13.0, 2.14.1
weights_only_globals                    ``_weights_only_unpickler._get_allowed_globals``                2.10.0, 2.13.0, 2.14.1
get_layout                              ``serialization._get_layout``                                   2.10.0, 2.13.0, 2.14.1
save_without_crc                        ``serialization._save``, ``._get_storage_alignment`` (not in    2.10.0, 2.13.0, 2.14.1
                                        2.6.0), ``_C.PyTorchFileWriter(stream, compute_crc32,
                                        storage_alignment)`` (2.6.0: no ``storage_alignment``)
neg_view                                ``_neg_view``                                                   2.10.0, 2.13.0, 2.14.1
element_size                            ``_utils._element_size``                                        2.10.0, 2.13.0, 2.14.1
default_group                           ``distributed.distributed_c10d._get_default_group``             2.10.0, 2.13.0, 2.14.1
storage_use_count                       ``_C._storage_Use_Count`` (None where absent)                   2.10.0, 2.13.0, 2.14.1
======================================  ==============================================================  ======================

Below the floor: 2.6.0 lacks the names marked above, so this module does not
import; 2.7.0 has them all, but not the public ``SerializationFormat`` of
``torch.distributed.checkpoint.filesystem`` that the drop-ins take; 2.8.0
and 2.9.0 import everything, but cannot copy a ``float4_e2m1fn_x2`` tensor
(``"copy_kernel" not implemented``), so neither stock DCP nor dcpstore can
save a view of one or load one; 2.8.0's ``dcp.save`` has no
``use_collectives`` either.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import _weights_only_unpickler, serialization
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # type: ignore[attr-defined]
from torch.distributed._shard.sharded_tensor import metadata as sharded_tensor_metadata
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedTensorProperties
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.api import _wrap_exception as wrap_exception
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.filesystem import _StoragePrefix as StoragePrefix
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms as StorageReaderTransforms
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms as StorageWriterTransforms
from torch.distributed.checkpoint.utils import _DistWrapper as DistWrapper
from torch.distributed.checkpoint.utils import _get_failure_dict as failure_dict
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._pytree import tree_map_only

__all__ = [
    "DistWrapper",
    "ExtensionRegistry",
    "MEM_FORMAT_ENCODING",
    "Shard",
    "ShardMetadata",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "ShardedTensorProperties",
    "StorageInfo",
    "StoragePrefix",
    "StorageReaderTransforms",
    "StorageWriterTransforms",
    "StreamTransformExtension",
    "compute_local_shape_and_global_offset",
    "default_group",
    "element_size",
    "failure_dict",
    "flatten_state_dict",
    "get_layout",
    "neg_view",
    "save_without_crc",
    "set_element",
    "sharded_tensor_metadata",
    "storage_use_count",
    "traverse_state_dict",
    "tree_map_only",
    "weights_only_globals",
    "wrap_exception",
]

#: How DCP's ``TensorProperties`` pickles a memory format (the enum its
#: ``.metadata`` refers to by this module-level name).
MEM_FORMAT_ENCODING = dcp_metadata._MEM_FORMAT_ENCODING

#: How every ``torch.layout`` pickles (a function ``.metadata`` names).
get_layout = serialization._get_layout

#: A view of a tensor with its negative bit set (what a record's ``neg`` flag restores).
neg_view: Callable[[torch.Tensor], torch.Tensor] = torch._neg_view


def element_size(dtype: torch.dtype) -> int:
    """The element size DCP's planner computes for ``dtype`` (raises for
    the sub-byte and ``bits`` dtypes, as it does there)."""
    return int(torch._utils._element_size(dtype))  # type: ignore[no-untyped-call]


def default_group() -> dist.ProcessGroup:
    """The default process group (its object, for comparisons and options)."""
    return dist.distributed_c10d._get_default_group()


def storage_use_count() -> Callable[[int], int] | None:
    """torch's count of the strong references to a storage, by its
    ``_cdata`` (None where this torch has none)."""
    return getattr(torch._C, "_storage_Use_Count", None)


def weights_only_globals() -> dict[str, Any]:
    """What ``torch.load(weights_only=True)`` may build, by name."""
    return dict(_weights_only_unpickler._get_allowed_globals())


def save_without_crc(obj: Any, stream: IO[bytes]) -> None:
    """``torch.save(obj, stream)`` without its software CRC-32 over every
    byte: torch's own serializer over a ``PyTorchFileWriter`` told not to
    compute it (the record's CRC fields are zero; ``torch.load`` reads it)."""
    alignment = serialization._get_storage_alignment()
    writer = torch._C.PyTorchFileWriter(stream, False, alignment)
    serialization._save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)  # type: ignore[no-untyped-call]
    writer.write_end_of_file()
