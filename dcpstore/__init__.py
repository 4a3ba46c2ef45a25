"""dcpstore: where and how PyTorch Distributed Checkpoint bytes go.

    import dcpstore
    h = dcpstore.save(state_dict, "s3://bucket/run/step100", async_=True)
    # ... training goes on and may mutate state_dict in place ...
    info = h.result()
    dcpstore.load(state_dict, "s3://bucket/run/step100")

This module is the public surface and nothing else; the package layout (and
which layer may import which) is in the README's Layout section.
"""

from .api import load, save
from .engines.saver import AsyncSaver
from .errors import (
    BackendUnavailable,
    CheckpointCorrupt,
    CheckpointError,
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
from .handle import CheckpointInfo, SaveHandle
from .manager import CheckpointManager
from .storage import StorageOptions, open_storage

__version__ = "0.1.0"

__all__ = [
    "AsyncSaver",
    "BackendUnavailable",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "EngineFallbackWarning",
    "InvalidArgument",
    "InvalidURI",
    "LoadError",
    "SaveError",
    "SaveHandle",
    "StateDictMismatch",
    "StorageError",
    "StorageNotFound",
    "StorageOptions",
    "StoragePermissionError",
    "UnsafeCheckpoint",
    "load",
    "open_storage",
    "save",
]
