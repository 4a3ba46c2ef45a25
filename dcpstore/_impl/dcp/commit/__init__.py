"""The commit protocol: every commit anyone writes is written, read,
published and removed here.

* :mod:`.session`: a save's commit, :class:`~.session.SaveSession` (claim,
  names, ownership, publish, release), used by every writer;
* :mod:`.reading`: what load, inspect and verify accept as a committed
  checkpoint (:func:`~.reading.read_checkpoint_metadata`), its commit files;
* :mod:`.from_listing`: the manifest that belongs to a ``.metadata`` (the one that
  records its CRC32C), for everything that works from a listing;
* :mod:`.publish`: the manifest, then ``.metadata`` last, then the
  clean-up: for a save, and for a copy of an existing commit (the
  replicator's durable replica, a node-local tier's own copy);
* :mod:`.uncommit`: deleting a committed checkpoint, ``.metadata`` first.

The file names are :mod:`dcpstore._impl.format.layout`'s. Only :mod:`.session`
and :mod:`.reading` import torch (DCP's ``Metadata``); their names are imported
from here on first use (PEP 562), so that ``ls`` and ``gc``
(:mod:`dcpstore._impl.tools.listing`) can use the rest without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcpstore._impl.dcp.commit.from_listing import Commit, disowned, find_manifest, listed_names, read_commit
from dcpstore._impl.dcp.commit.publish import clean_up, commit_point, publish_copy
from dcpstore._impl.dcp.commit.uncommit import delete_checkpoint, delete_everything
from dcpstore._impl.util.lazy_names import first_use

if TYPE_CHECKING:
    from dcpstore._impl.dcp.commit.reading import commit_replaced, read_checkpoint_metadata, read_commit_file
    from dcpstore._impl.dcp.commit.session import ItemRecord, SaveSession, check_commit_files

#: The names that need torch, imported on first use: name -> its module.
TORCH_NAMES: dict[str, str] = {
    "ItemRecord": "dcpstore._impl.dcp.commit.session",
    "SaveSession": "dcpstore._impl.dcp.commit.session",
    "check_commit_files": "dcpstore._impl.dcp.commit.session",
    "commit_replaced": "dcpstore._impl.dcp.commit.reading",
    "read_checkpoint_metadata": "dcpstore._impl.dcp.commit.reading",
    "read_commit_file": "dcpstore._impl.dcp.commit.reading",
}

__getattr__ = first_use(TORCH_NAMES, globals())


__all__ = [
    "Commit",
    "ItemRecord",
    "SaveSession",
    "check_commit_files",
    "clean_up",
    "commit_point",
    "commit_replaced",
    "delete_checkpoint",
    "delete_everything",
    "disowned",
    "find_manifest",
    "listed_names",
    "publish_copy",
    "read_checkpoint_metadata",
    "read_commit",
    "read_commit_file",
]
