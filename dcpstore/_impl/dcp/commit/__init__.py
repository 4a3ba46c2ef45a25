"""The commit protocol: every commit anyone writes is written, read,
published and removed here.

* :mod:`.session`: a save's commit, :class:`~.session.SaveSession` (claim,
  names, ownership, publish, release), used by every writer;
* :mod:`.read`: what load, inspect and verify accept as a committed
  checkpoint (:func:`~.read.read_checkpoint_metadata`), its commit files;
* :mod:`.found`: the manifest that belongs to a ``.metadata`` (the one that
  records its CRC32C), for everything that works from a listing;
* :mod:`.marker`: the in-flight marker; :mod:`.lease`: the alive file that
  keeps a writer's directory from ``gc`` (its format and rule are
  :mod:`dcpstore._impl.format.inflight`'s), and both in that order (:func:`~.lease.mark`);
* :mod:`.publish`: the manifest, then ``.metadata`` last, then the
  clean-up: for a save, and for a copy of an existing commit (the
  replicator's durable replica, a node-local tier's own copy);
* :mod:`.leftovers`: what a save leaves and what a commit makes stale (the
  one predicate of every clean-up, ``ls`` and ``gc``);
* :mod:`.uncommit`: deleting a committed checkpoint, ``.metadata`` first.

The file names are :mod:`dcpstore._impl.format.layout`'s. Only :mod:`.session`
and :mod:`.read` import torch (DCP's ``Metadata``); their names are imported
from here on first use (PEP 562), so that ``ls`` and ``gc``
(:mod:`dcpstore._impl.listing`) can use the rest without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcpstore._impl.first_use import first_use
from dcpstore._impl.dcp.commit.found import Commit, disowned, find_manifest, listed_names, read_commit
from dcpstore._impl.dcp.commit.lease import Lease, mark
from dcpstore._impl.dcp.commit.leftovers import (
    alive_tag,
    is_leftover,
    is_save_file,
    remove_leftovers,
    several_saves,
    stale_after_commit,
    unnamed,
)
from dcpstore._impl.dcp.commit.marker import is_marker, put_marker, read_marker, remove_markers
from dcpstore._impl.dcp.commit.publish import clean_up, commit_point, publish_copy
from dcpstore._impl.dcp.commit.uncommit import delete_checkpoint, delete_everything

if TYPE_CHECKING:
    from dcpstore._impl.dcp.commit.read import commit_replaced, read_checkpoint_metadata, read_commit_file
    from dcpstore._impl.dcp.commit.session import ItemRecord, SaveSession, check_commit_files

#: The names that need torch, imported on first use: name -> its module.
TORCH_NAMES: dict[str, str] = {
    "ItemRecord": "dcpstore._impl.dcp.commit.session",
    "SaveSession": "dcpstore._impl.dcp.commit.session",
    "check_commit_files": "dcpstore._impl.dcp.commit.session",
    "commit_replaced": "dcpstore._impl.dcp.commit.read",
    "read_checkpoint_metadata": "dcpstore._impl.dcp.commit.read",
    "read_commit_file": "dcpstore._impl.dcp.commit.read",
}

__getattr__ = first_use(TORCH_NAMES, globals())


__all__ = [
    "Commit",
    "ItemRecord",
    "Lease",
    "SaveSession",
    "alive_tag",
    "check_commit_files",
    "clean_up",
    "commit_point",
    "commit_replaced",
    "delete_checkpoint",
    "delete_everything",
    "disowned",
    "find_manifest",
    "is_leftover",
    "is_marker",
    "is_save_file",
    "listed_names",
    "mark",
    "publish_copy",
    "put_marker",
    "read_checkpoint_metadata",
    "read_commit",
    "read_commit_file",
    "read_marker",
    "remove_leftovers",
    "remove_markers",
    "several_saves",
    "stale_after_commit",
    "unnamed",
]
