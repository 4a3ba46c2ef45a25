"""dcpstore: where and how PyTorch Distributed Checkpoint bytes go.

    import dcpstore
    h = dcpstore.save(state_dict, "s3://bucket/run/step100", async_=True)
    # ... training goes on and may mutate state_dict in place ...
    info = h.result()
    dcpstore.load(state_dict, "s3://bucket/run/step100")
"""

from .api import CheckpointInfo, CheckpointManager, SaveHandle, load, save
from .writers.async_engine import AsyncSaver
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
