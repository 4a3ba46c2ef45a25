"""Liveness: who may write, and who may delete what, in a checkpoint directory.

A save that is running must never be collected, a save that was overtaken
must not publish, and whatever a failed save leaves must be recognisable
and removable. One module per rule:

* :mod:`.alive_file`: the alive file's format, and the rule ``gc`` keeps by
  (a running save's proof of life; torch-free, ``ls`` reads it);
* :mod:`.lease`: :class:`~.lease.Lease`, the one writer of alive files, and
  :func:`~.lease.mark` (a lease, then the in-flight marker);
* :mod:`.inflight_marker`: the in-flight marker, the save id of the save
  that claimed a directory last;
* :mod:`.owner_gate`: one ownership check shared by a rank's parallel
  writes of data files;
* :mod:`.save_leftovers`: which files a save left and which a commit makes
  stale: the one predicate of every clean-up, ``ls`` and ``gc``;
* :mod:`.retried_cleanups`: clean-ups a failed save could not do (the
  endpoint was down), kept by its saver and tried again.

Below :mod:`dcpstore._impl.dcp.commit`, which uses them; nothing here
imports torch.
"""

from __future__ import annotations

from dcpstore._impl.dcp.liveness.inflight_marker import is_marker, put_marker, read_marker, remove_markers
from dcpstore._impl.dcp.liveness.lease import Lease, mark
from dcpstore._impl.dcp.liveness.save_leftovers import (
    alive_tag,
    is_leftover,
    is_save_file,
    remove_leftovers,
    several_saves,
    stale_after_commit,
    unnamed,
)

__all__ = [
    "Lease",
    "alive_tag",
    "is_leftover",
    "is_marker",
    "is_save_file",
    "mark",
    "put_marker",
    "read_marker",
    "remove_leftovers",
    "remove_markers",
    "several_saves",
    "stale_after_commit",
    "unnamed",
]
