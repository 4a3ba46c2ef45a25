"""Publishing a commit: its manifest, then ``.metadata`` last -- the commit
point -- then the clean-up. Written once for every commit anyone writes: a
save's (:meth:`.session.SaveSession.publish`), and a copy of an existing
commit in another directory (:func:`publish_copy`: the replica a tiered
manager makes in the durable tier, a node's own copy of the coordinator's
commit). Torch-free.

Until ``.metadata`` lands the directory shows its previous commit (or
none), after it exactly the new one; a crash before the clean-up leaves
files that ``gc`` removes (:mod:`dcpstore._impl.dcp.liveness.save_leftovers`), never a broken commit.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable

from dcpstore._impl.dcp.commit.from_listing import Commit, listed_names
from dcpstore._impl.dcp.liveness.save_leftovers import stale_after_commit
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import CheckpointError

log = logging.getLogger(__name__)


def _join(directory: str, name: str) -> str:
    return posixpath.join(directory, name) if directory else name


def commit_point(
    storage: Storage, manifest_name: str, manifest_blob: bytes, metadata_blob: bytes, directory: str = ""
) -> None:
    """Write a commit into ``directory``: the manifest ``manifest_name``,
    then ``.metadata`` (the commit point: a rename or a single PUT, atomic)."""
    storage.put(_join(directory, manifest_name), manifest_blob)
    storage.put(_join(directory, METADATA), metadata_blob)


def clean_up(storage: Storage, names: Iterable[str], commit: Iterable[str], directory: str = "") -> None:
    """After a commit consisting of ``commit`` landed in ``directory``: remove
    what of ``names`` it makes stale (:func:`~dcpstore._impl.dcp.liveness.save_leftovers.stale_after_commit`),
    in one request. Best effort: the commit already happened, and what
    stays is ``gc``'s."""
    try:
        stale = stale_after_commit(names, commit)
        if stale:
            storage.delete([_join(directory, n) for n in stale])
    except CheckpointError as e:
        log.warning(
            "could not remove the in-flight marker or stale files beside the commit %s: %s",
            storage.describe(directory),
            e,
        )


def publish_copy(storage: Storage, commit: Commit, directory: str = "") -> None:
    """Publish ``commit`` (read from another directory; the files it names
    are in ``directory`` already) there: :func:`commit_point` with its
    bytes, then :func:`clean_up` of what the directory lists. The manifest
    keeps the name the save gave it, so a reader that looks it up by the
    save id ``.metadata`` records finds exactly it."""
    commit_point(storage, commit.manifest_name, commit.manifest_blob, commit.metadata_blob, directory)
    try:
        names = listed_names(storage, directory)
    except CheckpointError as e:
        log.warning("could not list %s to clean up beside its commit: %s", storage.describe(directory), e)
        return
    clean_up(storage, names, commit.files, directory)
