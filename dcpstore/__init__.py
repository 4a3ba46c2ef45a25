"""dcpstore: where and how PyTorch Distributed Checkpoint bytes go.

    import dcpstore
    h = dcpstore.save(state_dict, "s3://bucket/run/step100", async_=True)
    info = h.result()
    dcpstore.load(state_dict, "s3://bucket/run/step100")
"""

from .api import CheckpointInfo, CheckpointManager, SaveHandle, load, save
from .errors import (
    BackendUnavailable,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    InvalidArgument,
    InvalidURI,
    LoadError,
    SaveError,
    StateDictMismatch,
    StorageError,
    StorageNotFound,
    StoragePermissionError,
)
from .storage import StorageOptions, open_storage

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
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
    "load",
    "open_storage",
    "save",
]
