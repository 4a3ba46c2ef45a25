"""Which ranks share a local directory, and what a node's directory needs.

A tiered manager's ``local_dir`` is either one directory that every rank
sees (one node, or a path every node mounts) or one per node (each node's
own disk, under the same path or not). :func:`detect_nodes` tells which,
once, when the manager is made: every rank writes a probe file and looks
for every other rank's. The ranks that see each other's probes are a
*node*; the lowest rank of a node is its *leader*, the one that writes the
node's own copies of what only the coordinator's directory would hold:

    leader, before a save   put_marker(local, step, save_id)
                                the in-flight marker, holding the save id the
                                manager chose, so that the node's ranks pass
                                the save's ownership check
                                (:meth:`~dcpstore.dcp.commit.SaveSession.check_owner`)
                                and a later save that takes the step over still
                                fails them
    leader, after commit    localize(local, step, commit)
                                the coordinator's manifest, then its
                                ``.metadata`` (the node's commit point), then the
                                marker and what an older commit of the step left
                                go: the same order and clean-up as
                                :meth:`~dcpstore.dcp.commit.SaveSession.publish`

:func:`plan_files` is the load side: the data files a rank's load plan reads
(DCP puts a replicated item in one rank's file only, so a node may hold a
whole share of what it saved and still miss what it loads).

Layer: manager. Imports :mod:`dcpstore.format`, :mod:`dcpstore.storage` and
:mod:`dcpstore.errors`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ..errors import CheckpointError, InvalidArgument
from ..format.layout import INFLIGHT, METADATA, is_data_file, is_manifest
from ..format.safe_pickle import TOOLS, load_metadata
from ..storage import Storage
from .replicate import LocalCommit
from .steps import step_dir

log = logging.getLogger(__name__)

#: The probe files of the check (``<prefix><rank>.<random>``, in ``local_dir``
#: itself, removed right after it).
PROBE_PREFIX = ".dcpstore.probe."


@dataclass(frozen=True)
class Nodes:
    """How the ranks of a manager's group share ``local_dir``.

    ``node``: the ranks (of the group) that share this rank's directory,
    sorted; ``count``: how many directories the job has.
    """

    node: tuple[int, ...]
    count: int

    @property
    def node_local(self) -> bool:
        """Whether the job has more than one local directory."""
        return self.count > 1

    @property
    def leader(self) -> int:
        """The rank that writes this node's own copies (its lowest)."""
        return self.node[0]


#: A single process, or one directory for every rank.
ONE_DIR = Nodes((0,), 1)


def detect_nodes(local: Storage, group: dist.ProcessGroup | None, rank: int) -> Nodes:
    """Collective over ``group``: every rank writes a probe file into ``local``
    and looks for every rank's. The ranks that see each other's are a node.
    Raises :class:`InvalidArgument` on every rank alike (the gathered views
    are the same everywhere) unless the views split the ranks into nodes: a
    rank that cannot write its probe, or one that sees another's directory
    but not all of it (an overlay, a partly shared mount). A rank that fails
    still joins both gathers, so that no rank waits for it forever."""
    probe = f"{PROBE_PREFIX}{rank}.{os.urandom(8).hex()}"
    token: str | None = probe
    try:
        local.makedirs()
        local.put(probe, b"")
    except CheckpointError as e:
        log.error("could not write the probe file %s: %s", local.describe(probe), e)
        token = None
    try:
        world = dist.get_world_size(group)
        tokens: list[str | None] = [None] * world
        dist.all_gather_object(tokens, token, group=group)
        seen = [r for r, t in enumerate(tokens) if _sees(local, t)]
        views: list[list[int]] = [[]] * world
        dist.all_gather_object(views, seen, group=group)  # also: no probe goes before every rank looked
    finally:
        if token is not None:
            try:
                local.delete([token])
            except CheckpointError as e:  # an empty file beside the steps: harmless
                log.warning("could not remove the probe file %s: %s", local.describe(token), e)
    return nodes_from_views(views, rank, local.uri)


def nodes_from_views(views: list[list[int]], rank: int, uri: str) -> Nodes:
    """The nodes ``views`` (per rank, the ranks whose probe file it sees,
    sorted) split the ranks into, as ``rank`` sees them; raise
    :class:`InvalidArgument` naming ``uri`` unless they split them."""
    odd = [r for r, v in enumerate(views) if r not in v or any(views[q] != v for q in v)]
    if odd:
        shown = "; ".join(f"rank {r} sees the probe files of rank(s) {views[r]}" for r in odd)
        raise InvalidArgument(
            f"local_dir {uri} is neither one directory that every rank sees nor one per node "
            f"({shown}): every rank must write and see its own probe file, and ranks that see one "
            "another's must see the same ones. Nothing was saved"
        )
    return Nodes(tuple(views[rank]), len({tuple(v) for v in views}))


def _sees(local: Storage, probe: str | None) -> bool:
    try:
        return probe is not None and local.exists(probe)
    except CheckpointError:
        return False


def put_marker(local: Storage, step: int, save_id: str) -> None:
    """The node's in-flight marker for the save of ``step`` (leader, before it)."""
    local.put(f"{step_dir(step)}/{INFLIGHT}", save_id.encode())


def localize(local: Storage, step: int, commit: LocalCommit) -> None:
    """Make the coordinator's ``commit`` of ``step`` this node's (leader): the
    manifest, then ``.metadata`` (the commit point), then remove the marker
    and the data files and manifests no longer named (an older commit of the
    step, an interrupted save): never one the new commit names."""
    prefix = step_dir(step)
    local.put(f"{prefix}/{commit.manifest_name}", commit.manifest_blob)
    local.put(f"{prefix}/{METADATA}", commit.metadata_blob)
    named = {*commit.manifest["files"], commit.manifest_name}
    stale = [
        o["path"]
        for o in local.list(f"{prefix}/")
        if _stale(o["path"][len(prefix) + 1 :], named)
    ]
    local.delete([f"{prefix}/{INFLIGHT}", *stale])


def _stale(name: str, named: set[str]) -> bool:
    return name not in named and (is_data_file(name) or is_manifest(name))


def held_files(local: Storage, step: int, commit: LocalCommit) -> list[str]:
    """The data files of ``commit`` this directory holds at their size."""
    prefix = step_dir(step)
    sizes = {o["path"][len(prefix) + 1 :]: o["size"] for o in local.list(f"{prefix}/")}
    return sorted(n for n, e in commit.manifest["files"].items() if sizes.get(n) == e["size"])


def plan_files(state_dict: dict[str, Any], commit: LocalCommit, where: str) -> set[str]:
    """The data files the default load plan of ``state_dict`` reads from the
    checkpoint ``commit`` is the commit of (``where``: its URI, for errors).
    ``.metadata`` goes through the restricted unpickler like every load."""
    metadata, _ = load_metadata(commit.metadata_blob, where, TOOLS)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, False)
    data = metadata.storage_data
    return {data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def holds(local: Storage, step: int, commit: LocalCommit | None, needed: Iterable[str]) -> bool:
    """Whether ``local`` holds every one of ``needed`` of ``commit`` at its size."""
    if commit is None:
        return False
    have = set(held_files(local, step, commit))
    return all(n in have for n in needed)
