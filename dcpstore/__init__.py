"""dcpstore: where and how PyTorch Distributed Checkpoint bytes go.

    import dcpstore
    h = dcpstore.save(state_dict, "s3://bucket/run/step100", async_=True)
    # ... training goes on and may mutate state_dict in place ...
    info = h.result()
    dcpstore.load(state_dict, "s3://bucket/run/step100")

This module is the public surface and nothing else; the package layout (and
which layer may import which) is in docs/layout.md.

The names that need torch (:data:`TORCH_NAMES`: ``save``, ``load``, the
saver, the manager, the handles, :class:`SaveOptions` and
:class:`LoadOptions`) are imported on first use (PEP 562), so
that ``import dcpstore`` -- and with it the ``dcpstore`` command's ``--help``,
``ls`` and ``gc`` -- does not import torch (seconds). The exceptions,
:class:`StorageOptions` and :func:`open_storage` are torch-free and imported
at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcpstore._impl.util.errors import (
    BackendUnavailable,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    EngineFallbackWarning,
    InvalidArgument,
    InvalidURI,
    LoadError,
    SaveError,
    StateDictMismatch,
    StorageError,
    StorageNotFound,
    StoragePermissionError,
    UnsafeCheckpoint,
)
from dcpstore._impl.util.lazy_names import first_use
from dcpstore.storage import StorageOptions, open_storage

if TYPE_CHECKING:
    from dcpstore._impl.api import load, save
    from dcpstore._impl.dropin import StorageReader, StorageWriter
    from dcpstore._impl.engines.saver import AsyncSaver
    from dcpstore._impl.manager import CheckpointManager
    from dcpstore._impl.safetensors import SafetensorsReader, SafetensorsWriter, consolidate_safetensors
    from dcpstore._impl.values.options import LoadOptions, SaveOptions
    from dcpstore._impl.values.results import CheckpointInfo, SaveHandle

__version__ = "0.1.0"

#: Public names imported on first use: name -> the module that defines it.
TORCH_NAMES: dict[str, str] = {
    "AsyncSaver": "dcpstore._impl.engines.saver",
    "CheckpointInfo": "dcpstore._impl.values.results",
    "CheckpointManager": "dcpstore._impl.manager",
    "LoadOptions": "dcpstore._impl.values.options",
    "SaveHandle": "dcpstore._impl.values.results",
    "SaveOptions": "dcpstore._impl.values.options",
    "SafetensorsReader": "dcpstore._impl.safetensors",
    "SafetensorsWriter": "dcpstore._impl.safetensors",
    "StorageReader": "dcpstore._impl.dropin",
    "StorageWriter": "dcpstore._impl.dropin",
    "consolidate_safetensors": "dcpstore._impl.safetensors",
    "load": "dcpstore._impl.api",
    "save": "dcpstore._impl.api",
}


__getattr__ = first_use(TORCH_NAMES, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(TORCH_NAMES))


__all__ = [
    "AsyncSaver",
    "BackendUnavailable",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "EngineFallbackWarning",
    "InvalidArgument",
    "InvalidURI",
    "LoadError",
    "LoadOptions",
    "SafetensorsReader",
    "SafetensorsWriter",
    "SaveError",
    "SaveHandle",
    "SaveOptions",
    "StateDictMismatch",
    "StorageError",
    "StorageNotFound",
    "StorageOptions",
    "StorageReader",
    "StorageWriter",
    "StoragePermissionError",
    "UnsafeCheckpoint",
    "consolidate_safetensors",
    "load",
    "open_storage",
    "save",
]
