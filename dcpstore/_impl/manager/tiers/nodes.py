"""Which ranks share a local directory, and the node-local tier: :class:`NodeDirs`.

A tiered manager's ``local_dir`` is either one directory that every rank
sees (one node, or a path every node mounts) or one per node (each node's
own disk, under the same path or not). :func:`detect_nodes` tells which,
once, when the manager is made: every rank writes a probe file and looks
for every other rank's. The ranks that see each other's probes are a
*node*; the lowest rank of a node is its *leader*, the one that writes the
node's own copies of what only the coordinator's directory would hold:

    leader, before a save   put_marker(local, step, save_id) (:mod:`.local_tier`)
                                a lease (``dcpstore gc`` keeps the step
                                until the node's copy is committed), then
                                the in-flight marker, holding the save id
                                the manager chose, so that the node's ranks
                                pass the save's ownership check
                                (:meth:`~dcpstore._impl.dcp.commit.SaveSession.check_owner`)
                                and a later save that takes the step over still
                                fails them
    leader, after commit    publish_copy(local, commit, step_dir(step))
                                the coordinator's manifest, then its
                                ``.metadata`` (the node's commit point), then the
                                marker and what an older commit of the step left
                                go: the commit protocol's
                                (:mod:`dcpstore._impl.dcp.commit.publish`), as for any save

:func:`plan_files` is the load side: the data files a rank's load plan reads
(DCP puts a replicated item in one rank's file only, so a node may hold a
whole share of what it saved and still miss what it loads).

:class:`NodeDirs` is the tiered manager's strategy for one directory per
node (:class:`~.local_tier.LocalTier`; :class:`~.local_tier.SharedDir` is the other).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dcpstore._impl.dcp.commit import Commit, publish_copy
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.format.safe_pickle import TOOLS, load_metadata
from dcpstore._impl.manager.roots import coordinator_rank
from dcpstore._impl.manager.steps import committed_steps, step_dir
from dcpstore._impl.manager.tiers import peers
from dcpstore._impl.manager.tiers.local_tier import Job, TierParts, put_marker
from dcpstore._impl.manager.tiers.replicate import read_local_commit
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointError, InvalidArgument, SaveError
from dcpstore._impl.util.threads import Beside

log = logging.getLogger(__name__)

#: The probe files of the check (``<prefix><rank>.<random>``, in ``local_dir``
#: itself, removed right after it).
PROBE_PREFIX = ".dcpstore.probe."


@dataclass(frozen=True)
class Nodes:
    """How the ranks of a manager's group share ``local_dir``.

    ``node``: the ranks (of the group) that share this rank's directory,
    sorted; ``count``: how many directories the job has; ``all``: every
    node's ranks, ordered by leader (a node's place there is its index,
    the same on every rank and after a restart of the same job).
    """

    node: tuple[int, ...]
    count: int
    all: tuple[tuple[int, ...], ...] = ()

    @property
    def node_local(self) -> bool:
        """Whether the job has more than one local directory."""
        return self.count > 1

    @property
    def leader(self) -> int:
        """The rank that writes this node's own copies (its lowest)."""
        return self.node[0]

    @property
    def index(self) -> int:
        """This node's place in :attr:`all`."""
        return self.all.index(self.node)


#: A single process, or one directory for every rank.
ONE_DIR = Nodes((0,), 1, ((0,),))


class NodeSync:
    """The collectives a tiered manager runs: on the caller's thread over the
    manager's ``group`` (every rank calls in step: construction, save,
    load), or on the replicator thread over a gloo group of its own
    (``background=True``; node-local directories only).

    ``nodes``: how the ranks share ``local_dir`` (:func:`detect_nodes`).
    """

    def __init__(
        self, nodes: Nodes, group: dist.ProcessGroup | None, background: dist.ProcessGroup | None, nonce: str = ""
    ) -> None:
        self.nodes = nodes
        self._group = group
        self._background = background
        self._nonce = nonce
        self._saves = 0

    def save_id(self, step: int) -> str:
        """The id of this manager's next save (of ``step``), the same on every
        rank without a collective: the ranks call in step (SPMD), and the
        coordinator's random nonce, shared when the manager was made, keeps
        it apart from every other manager's."""
        self._saves += 1
        return hashlib.blake2b(f"{self._nonce}:{step}:{self._saves}".encode(), digest_size=8).hexdigest()

    @classmethod
    def open(cls, local: Storage, group: dist.ProcessGroup | None, rank: int) -> NodeSync:
        """Collective when torch.distributed runs: detect the nodes, and with
        node-local directories make the replicator's group. That group is
        never destroyed here: torch names a group made with
        ``use_local_synchronization`` by its ranks and the number of groups,
        so destroying it would hand its name, and its rendezvous keys, to
        the next group made; it goes with its default group."""
        if not is_distributed():
            return cls(ONE_DIR, None, None)
        nodes = detect_nodes(local, group, rank)
        background = None
        if nodes.node_local:
            background = dist.new_group(
                ranks=dist.get_process_group_ranks(group or dist.group.WORLD),
                backend="gloo",
                use_local_synchronization=True,
                group_desc="dcpstore_tiered",
            )
        sync = cls(nodes, group, background)
        if nodes.node_local:
            sync._nonce = sync.from_coordinator(os.urandom(16).hex() if rank == 0 else None)
        return sync

    @property
    def node_local(self) -> bool:
        return self.nodes.node_local

    def group(self, *, background: bool = False) -> dist.ProcessGroup | None:
        """The group collectives (and point-to-point sends) run on."""
        return self._pick(background)

    @property
    def leaders(self) -> list[int]:
        """Each node's leader (group ranks), by node index."""
        return [node[0] for node in self.nodes.all]

    def _pick(self, background: bool) -> dist.ProcessGroup | None:
        if background:
            assert self._background is not None, "the replicator's group exists with node-local directories only"
            return self._background
        return self._group

    def from_coordinator(self, value: Any, *, background: bool = False) -> Any:
        """The coordinator's ``value`` on every rank."""
        group = self._pick(background)
        box = [value]
        dist.broadcast_object_list(box, src=coordinator_rank(group), group=group)
        return box[0]

    def gather(self, value: Any, *, background: bool = False) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        group = self._pick(background)
        views: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(views, value, group=group)
        return views


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
    every = tuple(sorted({tuple(v) for v in views}))
    return Nodes(tuple(views[rank]), len(every), every)


def _sees(local: Storage, probe: str | None) -> bool:
    try:
        return probe is not None and local.exists(probe)
    except CheckpointError:
        return False


def held_files(local: Storage, step: int, commit: Commit) -> list[str]:
    """The data files of ``commit`` this directory holds at their size."""
    prefix = step_dir(step)
    sizes = {o["path"][len(prefix) + 1 :]: o["size"] for o in local.list(f"{prefix}/")}
    return sorted(n for n, e in commit.manifest["files"].items() if sizes.get(n) == e["size"])


def plan_files(state_dict: dict[str, Any], commit: Commit, where: str) -> set[str]:
    """The data files the default load plan of ``state_dict`` reads from the
    checkpoint ``commit`` is the commit of (``where``: its URI, for errors).
    ``.metadata`` goes through the restricted unpickler like every load."""
    metadata, _ = load_metadata(commit.metadata_blob, where, TOOLS)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, False)
    data = metadata.storage_data
    return {data[item.storage_index].relative_path for item in planner.create_local_plan().items}


def holds(local: Storage, step: int, commit: Commit | None, needed: Iterable[str]) -> bool:
    """Whether ``local`` holds every one of ``needed`` of ``commit`` at its size."""
    if commit is None:
        return False
    have = set(held_files(local, step, commit))
    return all(n in have for n in needed)


def share_commit(
    sync: NodeSync, local: Storage, step: int, rank: int, commit: Commit | None, catch_up: bool
) -> tuple[Commit, tuple[str, ...]] | None:
    """Every rank's replicator, for every job (the collectives on the
    replicator's group pair up: every rank queues the same jobs in the same
    order): the coordinator's ``commit`` of ``step`` (read there and
    broadcast; a catch-up's, every rank has it) becomes every node's (its
    leader's :func:`~dcpstore._impl.dcp.commit.publish.publish_copy`). Returns it, with the files this rank
    uploads in a catch-up: those its node holds (the leader's), once the
    gathered holdings cover the commit; None when they do not (a lost node:
    the step cannot be replicated and stays local until retention removes
    it; logged, not raised, since no later call could mend it)."""
    if not catch_up:
        commit = sync.from_coordinator(commit, background=True)
    if commit is None:
        raise SaveError(f"the coordinator's local copy of step {step} has no {METADATA} with its manifest")
    held: list[str] = []
    if rank == sync.nodes.leader:
        try:
            if rank != 0 and read_local_commit(local, step) != commit:
                publish_copy(local, commit, step_dir(step))
            held = held_files(local, step, commit)
        except CheckpointError as e:  # the node's copy stays uncommitted; the durable one is made all the same
            log.error("could not commit the local copy of step %d under %s: %s", step, local.uri, e)
    if not catch_up:
        return commit, ()
    views: list[list[str]] = sync.gather(held, background=True)
    missing = set(commit.manifest["files"]).difference(*views)
    if missing:
        if rank == 0:
            log.warning(
                "step %d cannot be replicated: no node's local_dir holds %s (%d file(s)); it stays local",
                step,
                sorted(missing)[:3],
                len(missing),
            )
        return None
    return commit, tuple(held)


def reads_locally(local: Storage, step: int, state_dict: dict[str, Any]) -> bool:
    """Whether this node's copy of ``step`` holds the files this rank's load
    of ``state_dict`` reads (any failure: no, and the durable copy's load
    reports it properly)."""
    try:
        commit = read_local_commit(local, step)
        if commit is None:
            return False
        where = local.describe(f"{step_dir(step)}/{METADATA}")
        return holds(local, step, commit, plan_files(state_dict, commit, where))
    except Exception as e:  # noqa: BLE001
        log.warning("the local copy of step %d is not read: %s", step, e)
        return False


class NodeDirs:
    """One ``local_dir`` per node (:func:`detect_nodes` found more than one).
    ``sync``: the collectives, on the caller's thread or the replicator's."""

    def __init__(self, sync: NodeSync, parts: TierParts, replicas: int = 1, jump: int = 1) -> None:
        self._sync, self._parts = sync, parts
        self._local, self._rank, self._leases = parts.local, parts.rank, parts.leases
        #: ``local_replicas``, ``replica_jump``: where each node's share is copied (:mod:`.peers`).
        self._replicas, self._jump = replicas, jump
        #: A save's peer copies in flight, beside its upload.
        self._copying: Beside | None = None

    @property
    def leader(self) -> bool:
        return self._rank == self._sync.nodes.leader

    @property
    def saves_commit_here(self) -> bool:
        """The coordinator's save commits its own node's copy; every other
        node's is its leader's :func:`~dcpstore._impl.dcp.commit.publish.publish_copy`
        of that commit, on the replicator (:meth:`commit_of`)."""
        return self._rank == 0

    def local_steps(self) -> list[int]:
        """A commit: the node's share is checked against the load plan
        (:meth:`reads_locally`)."""
        return committed_steps(self._local)

    def any_rank(self, mine: bool) -> bool:
        """Collective."""
        return any(self._sync.gather(mine))

    def catch_up(self, needs: Callable[[int], bool] | None) -> list[Job]:
        """Collective: the coordinator's commits of the steps that need
        replicating, on every rank (each leader uploads what its node holds
        of them, :func:`share_commit`)."""
        found: list[tuple[int, Commit]] = []
        if self._rank == 0 and needs is not None:
            try:
                for step in self.local_steps():
                    commit = read_local_commit(self._local, step) if needs(step) else None
                    if commit is not None:
                        found.append((step, commit))
            except CheckpointError as e:  # saves still commit locally; a later manager catches up
                log.error("catch-up under %s skipped: %s", self._local.uri, e)
                found = []
        return [Job(step, None, commit) for step, commit in self._sync.from_coordinator(found)]

    def before_save(self, step: int, overwrite: bool) -> str:
        """Every rank derives the same save id (:meth:`NodeSync.save_id`: no
        collective where the training waits); each leader puts the marker
        holding it into its step directory (so every save has save-unique
        names there). An overwrite first waits for the replicator on every
        rank: the node's copy of the older commit is made and cleaned up
        before the new save writes beside it."""
        if overwrite:
            self._parts.wait_idle()  # a replication error stays for wait() to raise
        save_id = self._sync.save_id(step)
        if self.leader:
            try:
                lease = put_marker(self._local, step, save_id)
                if lease is not None:
                    self._leases.hold_marker(step, lease)
            except CheckpointError as e:  # the node's ranks then fail the save together, through DCP
                log.error("could not put the in-flight marker of step %d under %s: %s", step, self._local.uri, e)
        return save_id

    def commit_of(self, job: Job) -> tuple[Commit | None, tuple[str, ...] | None] | None:
        """The coordinator's commit, shared with every node
        (:func:`share_commit`); a catch-up uploads what this node holds. A
        job of peer copies makes them (the leaders, point to point on the
        replicator's group) and replicates nothing."""
        if job.copies:
            if self.leader:
                index, leaders = self._sync.nodes.index, self._sync.leaders
                peers.restore(self._local, job.step, job.copies, index, leaders, self._sync.group(background=True))
            return None
        mine = job.commit
        if self._rank == 0 and job.files is not None:
            try:
                mine = read_local_commit(self._local, job.step)
            except CheckpointError as e:  # every rank still joins the broadcast, and fails alike
                log.error("could not read the local commit of step %d: %s", job.step, e)
        try:
            shared = share_commit(self._sync, self._local, job.step, self._rank, mine, job.files is None)
        finally:
            self._leases.end_marker(job.step)  # the node's copy is committed now (or cannot be)
        if shared is None:
            return None
        if self._replicas > 1 and job.files is not None and self.leader:
            # Beside the durable upload, which uses no collective: the two
            # go over different links (the nodes', the object store's).
            assert self._copying is None, "copies_done() ends every job"
            # A daemon thread: a peer that hangs must not hold up the
            # interpreter's exit, as the replicator's own thread does not.
            self._copying = Beside(
                peers.replicate,
                self._local,
                job.step,
                shared[0],
                self._sync.nodes.index,
                self._sync.leaders,
                self._replicas,
                self._jump,
                self._sync.group(background=True),
                name="dcpstore-peer-copies",
            )
        return shared[0], job.files if job.files is not None else shared[1]

    def copies_done(self) -> None:
        """The replicator, after each job: wait for the peer copies
        :meth:`commit_of` started beside the upload; raise their error."""
        copying, self._copying = self._copying, None
        if copying is not None:
            copying.join()

    def restore_from_peers(self, durable: Iterable[int]) -> list[Job]:
        """Collective (the manager's group), when the manager is made: where
        a node lacks the newest step that every node holds itself, through a
        peer's copy or through the durable tier (whose steps the
        coordinator's ``durable`` lists), the node's share is written back
        into its directory, from a peer's copy or else fetched from the
        durable tier (the files of its own ranks only), so that a load
        reads it locally (and the catch-up replicates it). Returns the jobs
        that make the peer copies of that step that are missing (a
        replacement node's, or a killed job's), and those of the older steps
        the durable tier lacks, in the background: no rank needs them to
        load (:func:`.peers.restore_plan`)."""
        if self._replicas == 1:
            return []
        view: peers.View | None = None
        if self.leader:
            try:
                view = peers.view(self._local, committed_steps(self._local))
            except CheckpointError as e:  # this node then counts as holding nothing
                log.warning("could not list the steps under %s: %s", self._local.uri, e)
                view = ({}, {})
        views = self._sync.gather((view, sorted(durable) if self._rank == 0 else []))
        targets = peers.pairs(self._sync.nodes.count, self._replicas, self._jump)
        plan = peers.restore_plan([views[leader][0] for leader in self._sync.leaders], targets, views[0][1])
        if plan is None:
            return []
        if self.leader:
            index, group = self._sync.nodes.index, self._sync.group()
            peers.restore(self._local, plan.step, plan.restores, index, self._sync.leaders, group)
            peers.fetch(self._local, self._parts.durable, plan.step, plan.fetches, index, self._sync.nodes.all, group)
        self._sync.gather(None)  # a node's other ranks look at their directory after its leader restored it
        steps = [(plan.step, plan.copies), *plan.behind]
        return [Job(step, None, copies=copies) for step, copies in steps if copies]

    def retire_peers(self, newest: int, keep: int, needed: Callable[[int], bool]) -> None:
        """The leader, after its own retention: that of its peer copies."""
        if self._replicas > 1:
            peers.retire(self._local, newest, keep, needed)

    def reads_locally(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Collective: every rank's node holds the files its load plan reads."""
        return all(self._sync.gather(reads_locally(self._local, step, state_dict)))
