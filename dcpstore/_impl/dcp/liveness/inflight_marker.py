"""The in-flight marker: which save a checkpoint directory is being written by.

``.dcpstore.inflight`` (:mod:`dcpstore._impl.format.layout`) holds the save id of
the save that claimed the directory last. Saves compare it with their own
before publishing anything (a save whose marker was replaced by a later
save's fails rather than clobber its files: :meth:`dcpstore._impl.dcp.commit.session.SaveSession.check_owner`);
a save's lease stops refreshing once it names another save
(:mod:`.lease`). Its writer's alive file lands before it
(:func:`.lease.mark`), and a commit removes it.

The marker's name is every save's, so ``gc`` removes a dead save's marker
last and only where no alive file appeared since its listing
(:func:`remove_markers`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping

from dcpstore._impl.dcp.liveness.alive_file import is_alive_file
from dcpstore._impl.format.layout import INFLIGHT
from dcpstore._impl.format.manifest import SMALL_FILE_LIMIT, read_capped
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import StorageNotFound


def marker_path(directory: str = "") -> str:
    """The marker of ``directory`` (``""``: the storage's root)."""
    return posixpath.join(directory, INFLIGHT) if directory else INFLIGHT


def is_marker(name: str) -> bool:
    """Whether ``name`` (a file name, no directory) is an in-flight marker."""
    return name == INFLIGHT


def put_marker(storage: Storage, save_id: str, directory: str = "", *, durable: bool = True) -> None:
    """Mark ``directory`` as the save ``save_id``'s. A writer's alive file
    must be there first (:func:`.lease.mark` takes both in that order)."""
    storage.put(marker_path(directory), save_id.encode(), durable=durable)


def read_marker(storage: Storage, directory: str = "") -> str | None:
    """The save id the marker of ``directory`` holds (None: no marker)."""
    try:
        return read_capped(storage, marker_path(directory), SMALL_FILE_LIMIT).decode(errors="replace")
    except StorageNotFound:
        return None


def remove_markers(storage: Storage, listed: Mapping[str, Iterable[str]]) -> None:
    """``gc``, last: remove the markers of the directories in ``listed``
    (directory -> the names listed in it when gc decided), each only where
    no alive file appeared since that listing: a save that claimed the
    directory meanwhile (its alive file lands before its marker) keeps it.
    An uncommitted directory's marker removed in the instant between that
    look and the delete is put back by its save
    (:meth:`~dcpstore._impl.dcp.commit.session.SaveSession.check_owner`)."""
    gone = []
    for path, names in listed.items():
        prefix = f"{path}/" if path else ""
        known = {posixpath.join(path, n) if path else n for n in names}
        now = {o["path"] for o in storage.list(prefix) if "/" not in o["path"][len(prefix) :]}
        if not any(is_alive_file(posixpath.basename(p)) for p in now - known):
            gone.append(marker_path(path))
    if gone:
        storage.delete(gone)
