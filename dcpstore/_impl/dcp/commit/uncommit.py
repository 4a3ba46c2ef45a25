"""Deleting committed checkpoints (retention, an adapter's purge, a
benchmark's scratch root) in the one safe order: ``.metadata`` first, so
that a crash mid-delete leaves an uncommitted directory (never listed as a
checkpoint, removable by ``gc``), never a committed-looking partial one.
Torch-free.
"""

from __future__ import annotations

import posixpath

from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.storage import Storage


def delete_checkpoint(root: Storage, name: str = "") -> None:
    """Delete the checkpoint directory ``name`` under ``root`` (``""``: the
    checkpoint ``root`` is): its ``.metadata``, then everything else in it."""
    root.delete([posixpath.join(name, METADATA) if name else METADATA])
    rest = [o["path"] for o in root.list(f"{name}/" if name else "")]
    if rest:
        root.delete(rest)


def delete_everything(root: Storage, prefix: str = "") -> None:
    """Delete every file under ``prefix`` of ``root`` (``""``: all of it),
    however many checkpoints it holds: every ``.metadata`` first, then the
    rest."""
    paths = [o["path"] for o in root.list(prefix)]
    commits = [p for p in paths if posixpath.basename(p) == METADATA]
    if commits:
        root.delete(commits)
    rest = [p for p in paths if posixpath.basename(p) != METADATA]
    if rest:
        root.delete(rest)
