"""Which files of a checkpoint directory a save left, and which a commit
makes stale: the one predicate of every clean-up (a save's, a replica's, a
node's copy's, ``gc``'s) and of ``ls``. Torch-free.

A directory holds, besides its commit (:mod:`dcpstore._impl.dcp.commit.from_listing`) and files no DCP save
writes (``gc`` leaves such a directory alone), what a save writes on its
way to a commit: data files, manifests, save-unique commit files, alive
files, a tiered manager's replica reports, stock DCP's rank-local commits,
and the in-flight marker. Once a commit lands, every such file it does not
name is stale: an older commit's (an overwrite) or an interrupted save's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from dcpstore._impl.dcp.liveness.alive_file import ALIVE_PREFIX, is_alive_file
from dcpstore._impl.dcp.liveness.inflight_marker import is_marker, remove_markers
from dcpstore._impl.format.layout import (
    METADATA,
    is_commit_file,
    is_commit_side_file,
    is_data_file,
    is_manifest,
    is_replica_report,
    is_tagged_safetensors_file,
    name_tag,
    save_tag,
)
from dcpstore._impl.storage import Storage

#: What an interrupted stock commit leaves (written, then renamed).
_STOCK_TEMP_RE = re.compile(r"^(__\d+)?\.metadata\.tmp$")


def is_save_file(name: str) -> bool:
    """Whether ``name`` (relative to its checkpoint directory) is a file a
    save writes before or beside its commit, other than the marker and the
    alive files: a data file (or a safetensors shard with a save tag), a manifest, a save-unique commit file, a
    replica report, or stock DCP's rank-local commit."""
    return (
        is_data_file(name)
        or is_tagged_safetensors_file(name)
        or is_manifest(name)
        or is_commit_side_file(name)
        or is_replica_report(name)
        or (is_commit_file(name) and name != METADATA)
    )


def is_leftover(name: str) -> bool:
    """Whether ``name`` is what an interrupted save (ours or stock DCP's)
    leaves in a directory without a commit."""
    return is_save_file(name) or is_marker(name) or is_alive_file(name) or bool(_STOCK_TEMP_RE.match(name))


def stale_after_commit(names: Iterable[str], commit: Iterable[str]) -> list[str]:
    """The files among ``names`` that the commit consisting of ``commit``
    (:attr:`dcpstore._impl.dcp.commit.from_listing.Commit.files`) makes stale: the marker and the alive
    files first (a commit ends every writer's claim on the directory), then
    every save file it does not name (:func:`unnamed`)."""
    names = set(names)
    ends = sorted(n for n in names if is_marker(n)) + sorted(n for n in names if is_alive_file(n))
    return ends + unnamed(names, commit)


def unnamed(names: Iterable[str], commit: Iterable[str]) -> list[str]:
    """The save files among ``names`` (:func:`is_save_file`) that the commit
    consisting of ``commit`` does not name, sorted."""
    commit = set(commit)
    return sorted(n for n in set(names) if is_save_file(n) and n not in commit)


def several_saves(names: Iterable[str]) -> bool:
    """Whether ``names`` hold data files or manifests of more than one save
    (in a committed directory: an overwrite killed between its commit and
    its clean-up, or a save that failed beside the commit)."""
    names = list(names)
    tags = {name_tag(n) for n in names} - {None}
    return len(tags) > 1 or sum(map(is_manifest, names)) > 1


def alive_tag(path: str) -> str | None:
    """The save tag of the alive file at ``path`` (its last part), or None
    for any other file: which save's writer it is the lease of."""
    name = path.rpartition("/")[2]
    return save_tag(name[len(ALIVE_PREFIX) :]) if is_alive_file(name) else None


def remove_leftovers(storage: Storage, paths: Iterable[str], markers: Mapping[str, Iterable[str]]) -> None:
    """``gc``'s removal: the leftovers and stale files at ``paths`` (never a
    marker), then the markers of the directories in ``markers`` (directory
    -> the names listed in it), last: see :func:`~.inflight_marker.remove_markers`."""
    paths = list(paths)
    if paths:
        storage.delete(paths)
    remove_markers(storage, markers)
