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

Object-store roots: Bridge joins checkpoint names with ``pathlib.Path``
(``get_checkpoint_name`` -> ``join_paths``), which folds a URI's ``//``:
``checkpoint.save = "s3://bucket/run"`` reaches the writer as
``"s3:/bucket/run/iter_0000010"``. :class:`BridgeRoots` reads such a name
back as the URI it came from, and only under a root the configuration
names: the configured URI decides, never the look of the name or a local
``./s3:`` directory (a relative path that really is named ``s3:/...``
stays a path). Bridge's rank 0 creates that directory
(``ensure_directory_exists``) and, on this route, keeps its own
``latest_train_state.pt``, tracker and ``run_config.yaml`` there with
``open()``: Bridge's resume reads them, so it is left as Bridge makes it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import PurePosixPath
from types import ModuleType
from typing import Any

from dcpstore._impl.adapters.megatron_async import FileSystemWriterAsync
from dcpstore._impl.dropin import StorageReader, StorageWriter
from dcpstore._impl.storage import StorageOptions, with_msc
from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.values.options import LoadOptions, SaveOptions

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


class BridgeRoots:
    """The object-store roots a Bridge configuration names
    (``checkpoint.save``, ``load``, ``pretrained_checkpoint``), and the
    names Bridge's path joins make under them read back as URIs."""

    #: Bridge's ``CheckpointConfig`` fields that hold a root.
    FIELDS = ("save", "load", "pretrained_checkpoint")

    def __init__(self, uris: Sequence[str | os.PathLike[str] | None] = ()) -> None:
        named = (os.fspath(u).rstrip("/") for u in uris if u is not None)
        #: (the URI, what ``pathlib`` makes of it), for URIs that ``pathlib`` changes.
        self.folds = tuple((u, folded) for u in named if "://" in u and (folded := str(PurePosixPath(u))) != u)

    @classmethod
    def of(cls, checkpoint_config: object) -> BridgeRoots:
        """The roots of Bridge's ``ConfigContainer.checkpoint`` (``None``: none)."""
        return cls([getattr(checkpoint_config, name, None) for name in cls.FIELDS])

    def restore(self, name: str | os.PathLike[str]) -> str:
        """``name`` as the URI it was joined from when it lies under a
        configured root (``s3:/b/run/iter_0000010`` -> ``s3://b/run/iter_0000010``);
        any other name as it is."""
        text = os.fspath(name)
        for uri, folded in self.folds:
            if text == folded or text.startswith(folded + "/"):
                return uri + text[len(folded) :]
        return text


def install_in_bridge(
    checkpointing: ModuleType,
    *,
    checkpoint_config: object = None,
    storage_options: StorageOptions | None = None,
    safe_globals: Sequence[Any] | None = None,
    trusted: bool = False,
) -> None:
    """Route Bridge's ``fsdp_dtensor`` saves (async and sync) and loads
    through dcpstore: every path Bridge passes them (local, ``s3://``,
    ``msc://``) then gets dcpstore's commit, checksums and overwrite safety.

    Args:
        checkpointing: ``megatron.bridge.training.checkpointing``.
        checkpoint_config: Bridge's ``ConfigContainer.checkpoint``: the
            names its path joins make under its object-store roots
            (``save``, ``load``, ``pretrained_checkpoint``) are read back as
            those URIs (:class:`BridgeRoots`). Needed for ``s3://`` and, without
            ``--enable-msc``, ``msc://`` roots; ``None``: names as they come.
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

    roots = BridgeRoots.of(checkpoint_config)

    @functools.wraps(FileSystemWriterAsync)  # megatron-core reads the writer's signature for its keywords
    def async_writer(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> FileSystemWriterAsync:
        return FileSystemWriterAsync(roots.restore(path), *args, **{"storage_options": storage_options, **kwargs})

    def sync_writer(checkpoint_path: str | os.PathLike[str]) -> StorageWriter:
        return StorageWriter(roots.restore(checkpoint_path), options=SaveOptions(storage_options=where()))

    def reader(
        checkpoint_dir: str | os.PathLike[str], cache_metadata: bool = False, async_strategy: str = "mcore"
    ) -> StorageReader:
        options = LoadOptions(storage_options=where(), safe_globals=safe_globals or (), trusted=trusted)
        return StorageReader(roots.restore(checkpoint_dir), options=options)

    for name, replacement in zip(BRIDGE_HOOKS, (async_writer, sync_writer, reader)):
        setattr(checkpointing, name, replacement)
