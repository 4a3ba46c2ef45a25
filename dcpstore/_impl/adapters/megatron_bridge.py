"""dcpstore beneath Megatron-Bridge's ``fsdp_dtensor`` checkpoints, in one call.

Bridge 0.6.2's ``megatron.bridge.training.checkpointing`` reaches storage
through three module-level names (:data:`BRIDGE_HOOKS`): NVRx's
``FileSystemWriterAsync`` for async saves, ``_create_fsdp_dtensor_storage_writer``
for sync ones, and megatron-core's ``_get_filesystem_reader`` for loads.
Replacing one of them leaves the others on stock storage without a word (the
async saves stay on NVRx's writer when only the sync factory is patched);
:func:`install_in_bridge` replaces all three, and refuses a module that lacks
any of them (another Bridge release) instead of patching part of it.

MSC: Megatron's switch is process-global (``--enable-msc``,
``megatron.core.msc_utils.MultiStorageClientFeature``); the writers and the
reader ask it at each save and load, as Bridge's own code does
(:func:`megatron_msc_enabled`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from ..dropin import StorageReader, StorageWriter
from ..errors import InvalidArgument
from ..options import LoadOptions, SaveOptions
from ..storage import StorageOptions, with_msc
from .megatron_async import FileSystemWriterAsync

#: The names in ``megatron.bridge.training.checkpointing`` (0.6.2) that its
#: ``fsdp_dtensor`` saves and loads reach storage through.
BRIDGE_HOOKS = ("FileSystemWriterAsync", "_create_fsdp_dtensor_storage_writer", "_get_filesystem_reader")


def megatron_msc_enabled() -> bool:
    """Whether Megatron's process-global ``--enable-msc`` is on (False where
    megatron-core is not installed)."""
    try:
        from megatron.core.msc_utils import MultiStorageClientFeature
    except ImportError:
        return False
    return bool(MultiStorageClientFeature.is_enabled())


def install_in_bridge(
    checkpointing: ModuleType,
    *,
    storage_options: StorageOptions | None = None,
    safe_globals: Sequence[Any] | None = None,
    trusted: bool = False,
) -> None:
    """Route Bridge's ``fsdp_dtensor`` saves (async and sync) and loads
    through dcpstore: every path Bridge passes them (local, ``s3://``,
    ``msc://``) then gets dcpstore's commit, checksums and overwrite safety.

    Args:
        checkpointing: ``megatron.bridge.training.checkpointing``.
        storage_options: backend tuning for every save and load.
        safe_globals, trusted: as for :func:`dcpstore.load`: classes
            Bridge's non-tensor items may hold beyond the allowlist.

    Raises:
        InvalidArgument: ``checkpointing`` lacks one of :data:`BRIDGE_HOOKS`
            (nothing is replaced then).
    """
    missing = [name for name in BRIDGE_HOOKS if not hasattr(checkpointing, name)]
    if missing:
        raise InvalidArgument(
            f"{getattr(checkpointing, '__name__', checkpointing)!r} has no {', '.join(missing)}: not a "
            "Megatron-Bridge checkpointing module this knows (0.6.2); nothing was replaced"
        )

    def where() -> StorageOptions | None:  # Megatron's --enable-msc as it is at each save and load
        return with_msc(storage_options, megatron_msc_enabled())

    def sync_writer(checkpoint_path: str | os.PathLike[str]) -> StorageWriter:
        return StorageWriter(checkpoint_path, options=SaveOptions(storage_options=where()))

    def reader(checkpoint_dir: str | os.PathLike[str], cache_metadata: bool = False, async_strategy: str = "mcore") -> StorageReader:
        options = LoadOptions(storage_options=where(), safe_globals=safe_globals or (), trusted=trusted)
        return StorageReader(checkpoint_dir, options=options)

    async_writer = FileSystemWriterAsync if storage_options is None else functools.partial(FileSystemWriterAsync, storage_options=storage_options)
    for name, replacement in zip(BRIDGE_HOOKS, (async_writer, sync_writer, reader)):
        setattr(checkpointing, name, replacement)
