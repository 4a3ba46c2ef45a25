"""Checkpoints at rest, as functions: what the ``dcpstore`` command runs.

    from dcpstore import tools
    for entry in tools.ls("s3://bucket/run1"):
        print(entry.path, entry.committed)
    report = tools.verify("s3://bucket/run1/step100")   # reads every byte
    tools.gc("s3://bucket/run1", older_than_s=600)

``ls`` and ``gc`` read no checkpoint content and never import torch;
``inspect``, ``verify`` and ``commit_file`` (a small file of yours kept in
the commit, checked) read ``.metadata`` (through the restricted unpickler:
nothing in a checkpoint is executed) and import torch on first use. Each takes a URI and the storage options to open it with, and raises
:class:`~dcpstore.CheckpointError` subclasses naming the URI.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from dcpstore._impl.storage import StorageOptions
from dcpstore._impl.storage.backend_registry import opened
from dcpstore._impl.tools.listing import CheckpointEntry, GcReport, list_checkpoints
from dcpstore._impl.tools.listing import gc as _collect
from dcpstore._impl.util.lazy_names import first_use

if TYPE_CHECKING:
    from dcpstore._impl.tools.maintenance import VerifyReport, commit_file, inspect, verify

__all__ = ["CheckpointEntry", "GcReport", "VerifyReport", "commit_file", "gc", "inspect", "ls", "verify"]


def ls(uri: str | os.PathLike[str], *, storage_options: StorageOptions | None = None) -> list[CheckpointEntry]:
    """The checkpoints under ``uri``: committed ones, and what interrupted
    saves left.

    Args:
        uri: a root or a checkpoint, on any backend.
        storage_options: how to open it (:class:`~dcpstore.StorageOptions`).

    Returns:
        One entry per checkpoint directory found.

    Raises:
        CheckpointError: the storage cannot be opened or listed.
    """
    with opened(uri, storage_options) as storage:
        return list_checkpoints(storage)


def gc(
    uri: str | os.PathLike[str],
    *,
    older_than_s: float = 300.0,
    dry_run: bool = False,
    storage_options: StorageOptions | None = None,
) -> GcReport:
    """Remove what interrupted saves left under ``uri``: never a committed
    checkpoint, never a running save, whatever ``older_than_s`` says.

    Args:
        uri: a root or a checkpoint.
        older_than_s: keep leftovers modified more recently than this.
        dry_run: say what would go, remove nothing.
        storage_options: how to open it.

    Returns:
        What was (or, with ``dry_run``, would be) removed.

    Raises:
        InvalidArgument: ``older_than_s`` is not a number of seconds >= 0.
        CheckpointError: the storage cannot be opened, listed or written.
    """
    with opened(uri, storage_options) as storage:
        return _collect(storage, older_than_s=older_than_s, dry_run=dry_run)


#: ``inspect``, ``verify`` and ``commit_file`` read ``.metadata``, which needs
#: torch: imported on first use (PEP 562), as :mod:`dcpstore` does.
_NEEDS_TORCH = {
    name: "dcpstore._impl.tools.maintenance" for name in ("VerifyReport", "commit_file", "inspect", "verify")
}
__getattr__ = first_use(_NEEDS_TORCH, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NEEDS_TORCH))
