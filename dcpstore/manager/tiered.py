"""Tiered checkpoints: commit to a local directory at disk speed, replicate
to the durable root in the background, resume from the nearest good copy.

Layout: the same step directories in both tiers::

    local_dir/step_00000100/...    committed by the save itself (its handle
                                   completes here)
    root_uri/step_00000100/...     the replica: data files, manifest,
                                   .metadata last (:mod:`.replicate`)

Which rank does what (every rank constructs the manager alike):

* **Saving**: every rank saves to ``local_dir/step_N`` through the ordinary
  save path (same layout and commit protocol as any dcpstore checkpoint).
  When its save commits, each rank queues the step on its own replicator
  thread, which uploads the data files *this rank* wrote; the coordinator
  commits the replica once every file arrived (:mod:`.replicate`). Steps are
  replicated one at a time, in the order they were committed.
  ``replicate_every=N``: only steps divisible by N are replicated (``step %
  N == 0``: the same choice on every rank and after a restart).
* **Retention** (coordinator, on the replicator thread, after each step):
  the durable tier keeps the ``keep`` newest committed steps (as a plain
  manager does); the local tier the ``local_keep`` newest committed, but a
  local step that still needs replicating is never deleted (one replication
  failed: it stays until a later manager replicates it).
* **Overwrites**: saving a step again (``overwrite=True``) never loses its
  durable copy: the new replica commits over it as an overwrite save does
  (save-unique names, ``.metadata`` last, then the old files go; see
  :meth:`TieredRoots.before_save` and :mod:`.replicate`).
* **Catch-up**: a new manager's coordinator queues the committed local steps
  that need replicating (selected; missing from the durable tier and not
  older than the durable tier's ``keep`` newest, or there as an older
  commit: an overwrite whose replication did not finish), so that a crash
  during replication loses nothing that was committed locally (from its
  whole local copy: every file the manifest names). Local retention keeps
  such steps too.
* **One directory, or one per node**: ``local_dir`` is either one
  directory every rank sees (one node's disk, or a path every node mounts)
  or each node's own (:mod:`.nodes`; found when the manager is made, a
  collective then). With node-local directories each node holds the files
  its ranks wrote, and its leader (lowest rank) keeps the node's own copy
  of what the coordinator's directory holds: before each save the in-flight
  marker with the save id the manager chose (so the node's ranks pass the
  ownership check; the save then uses save-unique names, since the claim
  sees one node's directory only), after the commit the manifest and
  ``.metadata``, which the coordinator broadcasts on the replicator's own
  gloo group (every rank's replicator handles the same steps in the same
  order, so these collectives pair up; no other collective runs there).
  Each node's leader applies local retention to its own directory.
  Catch-up: the coordinator's commits are broadcast when the manager is
  made, and each node's leader uploads the files of them its directory
  holds; a step some of whose files no node holds stays local (logged).
* **Loading** (collective): the step is the newest committed one in either
  tier (every rank holds a local commit of it, or the durable tier does);
  it is read from the local tier if every rank's local copy holds what it
  reads (one directory: a *whole* copy, every file the manifest names at its
  size; node-local: the files this rank's load plan reads, at their sizes;
  DCP puts a replicated item in one rank's file only, so a load that
  reshards or reads such an item from another node reads the durable
  copy), else by every rank from the durable tier; a step neither serves
  (a lost node, not yet replicated) gives way to the next older one. A fresh
  node with an empty ``local_dir`` thus resumes from the durable tier; DCP
  resharding works from either, since every rank reads one whole checkpoint.
* **Errors**: a failed replication is logged when it happens and raised
  from the next :meth:`wait` or :meth:`close`; saves keep committing locally.
  ``close()`` waits for the queue at most ``replicate_timeout_s``.

Layer: manager. Imports :mod:`dcpstore.storage`, :mod:`dcpstore.format`,
:mod:`dcpstore.handle`, :mod:`dcpstore.errors` and this package's
:mod:`.steps`, :mod:`.roots` and :mod:`.replicate`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError, InvalidArgument, SaveError, StorageNotFound
from ..format.layout import INFLIGHT, METADATA
from ..format.manifest import METADATA_LIMIT, read_capped
from ..handle import SaveHandle
from ..storage import Storage, join_uri
from .nodes import ONE_DIR, detect_nodes, held_files, holds, localize, plan_files, put_marker
from .replicate import (
    LocalCommit,
    check_no_clash,
    commit_replica,
    keep_alive,
    read_local_commit,
    upload_files,
    whole_local_steps,
    write_report,
)
from .roots import coordinator_rank, group_rank, is_distributed, not_found
from .steps import (
    check_step,
    commit_times,
    committed_steps,
    delete_step,
    read_pointer,
    retire,
    step_dir,
    write_pointer,
)

log = logging.getLogger(__name__)

#: Default bound on one step's replication and on ``close()``'s wait.
REPLICATE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class _Job:
    step: int
    #: The data files this rank's save wrote; None: catch-up (one directory:
    #: the coordinator, every file the local manifest names; node-local: each
    #: node's leader, the files of ``commit`` its directory holds).
    files: tuple[str, ...] | None
    #: Node-local catch-up: the coordinator's commit of the step.
    commit: LocalCommit | None = None


class TieredRoots:
    """A local tier and a durable tier; see the module docstring.

    ``durable`` and ``local`` are the two roots' storages (this object owns
    and closes them); ``workers``: parallel file uploads per rank.
    """

    def __init__(
        self,
        durable: Storage,
        durable_uri: str,
        local: Storage,
        local_uri: str,
        *,
        keep: int | None,
        local_keep: int | None,
        replicate_every: int,
        workers: int,
        group: dist.ProcessGroup | None,
        timeout_s: float,
    ) -> None:
        self._durable, self._durable_uri = durable, durable_uri
        self._local, self._local_uri = local, local_uri
        self._keep, self._local_keep = keep, local_keep
        self._every = replicate_every
        self._workers = workers
        self._group = group
        self._timeout_s = timeout_s
        self._rank = group_rank(group)
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._busy = False
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self._nodes = ONE_DIR
        #: Node-local directories: the replicator threads' own group.
        self._bg: dist.ProcessGroup | None = None
        #: Durable steps as of construction, plus those replicated since: what
        #: ``save`` checks (no object-store round trip while the caller waits).
        self._durable_known: set[int] = set()
        try:
            if is_distributed():
                self._nodes = detect_nodes(self._local, group, self._rank)
                if self._nodes.node_local:
                    self._bg = dist.new_group(
                        ranks=dist.get_process_group_ranks(group or dist.group.WORLD),
                        backend="gloo",
                        use_local_synchronization=True,
                        group_desc="dcpstore_tiered",
                    )
            failure: BaseException | None = None
            try:
                replicas = commit_times(self._durable)  # also: the durable root is reachable
            except BaseException as e:  # raised after the node-local catch-up's collective
                failure, replicas = e, {}
            self._durable_known = set(replicas)
            if self._nodes.node_local:
                self._catch_up_nodes(None if failure else replicas)
            if failure is not None:
                raise failure
            if not self._nodes.node_local and self._coordinator:
                self._catch_up(replicas)
        except BaseException:
            self.close()
            raise

    @property
    def _coordinator(self) -> bool:
        return self._rank == 0

    @property
    def _leader(self) -> bool:
        """Whether this rank keeps its directory's commits and retention."""
        return self._rank == self._nodes.leader

    # -- naming and listing ---------------------------------------------------
    @property
    def uri(self) -> str:
        return self._durable.uri

    @property
    def local_uri(self) -> str:
        return self._local.uri

    @property
    def save_storage(self) -> Storage:
        return self._local

    def save_uri(self, step: int) -> str:
        return join_uri(self._local_uri, step_dir(step))

    def durable_uri(self, step: int) -> str:
        return join_uri(self._durable_uri, step_dir(step))

    def selected(self, step: int) -> bool:
        """Whether ``step`` goes to the durable tier (``replicate_every``)."""
        return step % self._every == 0

    def is_committed(self, step: int) -> bool:
        """In the local tier (looked up) or the durable one (as this manager
        knows it: listed at construction, plus what it replicated since).
        Node-local directories: collective, committed if any rank says so."""
        mine = step in self._durable_known or self._local.exists(f"{step_dir(step)}/{METADATA}")
        if not self._nodes.node_local:
            return mine
        views = [mine] * dist.get_world_size(self._group)
        dist.all_gather_object(views, mine, group=self._group)
        return any(views)

    def local_steps(self) -> list[int]:
        """Steps this rank holds a local copy of: a whole one (every file the
        manifest names) in one shared directory; node-local, a commit (the
        node's share is checked against the load plan, :meth:`locate`)."""
        return committed_steps(self._local) if self._nodes.node_local else whole_local_steps(self._local)

    def durable_steps(self) -> list[int]:
        return committed_steps(self._durable)

    def all_steps(self) -> list[int]:
        return sorted(set(self.local_steps()) | set(self.durable_steps()))

    def read_pointer(self) -> int | None:
        """The newer of the two tiers' ``latest`` hints."""
        hints = [p for p in (read_pointer(self._local), read_pointer(self._durable)) if p is not None]
        return max(hints) if hints else None

    def _needs_replication(self, step: int, durable: Mapping[int, float | None]) -> bool:
        """Whether the local commit of ``step`` still has to go to the durable
        tier, whose committed steps (and their ``.metadata`` times) are
        ``durable``: selected, and missing there or there as an older commit
        (:meth:`_replica_is_older`)."""
        if not self.selected(step):
            return False
        if step in durable:
            try:
                return self._replica_is_older(step, durable[step])
            except CheckpointError as e:  # cannot tell: keep it, replicate it (its old copy is safe)
                log.warning("could not compare the local and durable copies of step %d: %s", step, e)
                return True
        # Older than the durable tier's keep newest: retention would delete it at once.
        return self._keep is None or sum(1 for d in durable if d > step) < self._keep

    def _replica_is_older(self, step: int, durable_time: float | None) -> bool:
        """Whether the durable copy of ``step`` is another commit than the local
        one and older: the step was saved again (``overwrite=True``) and that
        save's replication did not finish (a crash, a failure). A replica is
        written after the local commit it copies, so a durable ``.metadata``
        newer than the local one is that replica (or a later save's, from
        another local directory: never replaced by this older local copy);
        only an older-looking one is read and compared, since the two clocks
        (node, object store) may differ and object stores keep whole seconds."""
        prefix = step_dir(step)
        local_time = next(
            (o.get("mtime") for o in self._local.list(f"{prefix}/") if o["path"] == f"{prefix}/{METADATA}"), None
        )
        if local_time is None or (durable_time is not None and durable_time >= local_time):
            return False
        commit = read_local_commit(self._local, step)
        if commit is None:
            return False
        try:
            replica = read_capped(self._durable, f"{prefix}/{METADATA}", METADATA_LIMIT)
        except StorageNotFound:  # retracted meanwhile
            return True
        return replica != commit.metadata_blob

    # -- saving ---------------------------------------------------------------
    def before_save(self, step: int, overwrite: bool) -> str | None:
        """Every rank, before each save; returns the save id the save must
        use (node-local directories), else None.

        Overwriting a step never loses its durable copy (coordinator, after
        any replication under way): the new replica goes up beside it and
        commits over it as any overwrite save does (:mod:`dcpstore.dcp.commit`):
        data files and manifest under the new save's names, ``.metadata``
        last, then the old copy's files go. That needs names the durable
        copy does not use: the local save picks save-unique ones where its
        directory holds anything, so where the durable tier holds files of
        the step an in-flight marker is put in the local step directory
        first (the claim replaces it). Should the random tags still meet
        (1 in 2**32), the replication refuses
        (:func:`~.replicate.check_no_clash`) rather than touch the old copy.

        Node-local directories (collective): the coordinator picks the save
        id and every node's leader puts the in-flight marker holding it into
        its step directory (:func:`~.nodes.put_marker`), so every save there
        has save-unique names; an overwrite first waits on every rank for
        the replicator (the node's copy of the step's older commit is made
        and cleaned up before the new save writes beside it)."""
        if self._nodes.node_local:
            return self._before_node_save(step, overwrite)
        if overwrite and self._coordinator:
            self.wait(self._timeout_s)
            prefix = step_dir(step)
            if any(True for _ in self._durable.list(f"{prefix}/")):
                self._local.put(f"{prefix}/{INFLIGHT}", b"")
        return None

    def _before_node_save(self, step: int, overwrite: bool) -> str:
        if overwrite:
            self._wait_idle(self._timeout_s)  # a replication error stays for wait() to raise
        box: list[str | None] = [os.urandom(8).hex() if self._coordinator else None]
        dist.broadcast_object_list(box, src=coordinator_rank(self._group), group=self._group)
        save_id = box[0]
        assert save_id is not None
        if self._leader:
            try:
                put_marker(self._local, step, save_id)
            except CheckpointError as e:  # the node's ranks then fail the save together, through DCP
                log.error("could not put the in-flight marker of step %d under %s: %s", step, self.local_uri, e)
        return save_id

    def saved(self, step: int, handle: SaveHandle) -> None:
        """Queue ``step`` for replication as soon as its local save commits."""

        def done(h: SaveHandle) -> None:
            if h.exception() is None:
                self._submit(_Job(step, h.result().files))

        handle.add_done_callback(done)

    def committed(self, step: int) -> None:
        write_pointer(self._local, step)

    def _submit(self, job: _Job) -> None:
        with self._cond:
            if self._closed:
                log.error("step %d committed locally after the manager closed; not replicated", job.step)
                return
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcpstore-replicate", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _catch_up(self, durable: Mapping[int, float | None]) -> None:
        for step in self.local_steps():
            if self._needs_replication(step, durable):
                log.info("step %d is committed locally but not (as this commit) in %s: replicating it", step, self.uri)
                self._submit(_Job(step, None))

    def _catch_up_nodes(self, durable: Mapping[int, float | None] | None) -> None:
        """Node-local directories (collective): the coordinator's commits
        that need replicating go to every rank; each rank queues them
        (``durable`` None: this rank could not list the durable tier, and
        raises after this)."""
        found: list[tuple[int, LocalCommit]] = []
        if self._coordinator and durable is not None:
            try:
                for step in self.local_steps():
                    commit = read_local_commit(self._local, step) if self._needs_replication(step, durable) else None
                    if commit is not None:
                        found.append((step, commit))
            except CheckpointError as e:  # saves still commit locally; a later manager catches up
                log.error("catch-up under %s skipped: %s", self.local_uri, e)
                found = []
        box: list[list[tuple[int, LocalCommit]]] = [found]
        dist.broadcast_object_list(box, src=coordinator_rank(self._group), group=self._group)
        for step, commit in box[0]:
            if self._coordinator:
                log.info("step %d is committed locally but not (as this commit) in %s: replicating it", step, self.uri)
            self._submit(_Job(step, None, commit))

    # -- the replicator thread ------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    if self._closed:
                        return
                    self._cond.wait()
                job = self._queue.popleft()
                self._busy = True
            try:
                self._replicate(job)
            except BaseException as e:  # kept for wait()/close(); the thread goes on
                log.error("replicating step %d to %s failed: %s", job.step, self.uri, e)
                with self._cond:
                    self._errors.append(e)
            if self._leader and self._local_keep is not None:
                self._retire_local(job.step)

    def _replicate(self, job: _Job) -> None:
        if self._nodes.node_local:
            shared = self._share_commit(job)
            if shared is None:
                return
            commit, files = shared
        else:
            commit, files = read_local_commit(self._local, job.step), job.files
        if not self.selected(job.step):
            return
        started = time.monotonic()
        expected = commit.manifest if commit is not None else None
        if files is None:  # catch-up: the coordinator copies every file the manifest names
            if expected is None:
                raise SaveError(f"{self._local.describe(step_dir(job.step))} has no {METADATA} with its manifest")
            files = tuple(expected["files"])
        check_no_clash(self._durable, job.step, files, commit)
        if not self._coordinator:
            if not files:
                return
            own = upload_files(self._local, self._durable, job.step, files, expected, self._workers)
            write_report(self._durable, job.step, self._rank, own)
            self._durable_known.add(job.step)  # the coordinator commits it (or wait() raises there)
            return
        with keep_alive(self._durable, job.step):
            own = upload_files(self._local, self._durable, job.step, files, expected, self._workers)
            commit_replica(self._local, self._durable, job.step, own, started + self._timeout_s)
        self._durable_known.add(job.step)
        log.info("step %d replicated to %s in %.2f s", job.step, self.uri, time.monotonic() - started)
        write_pointer(self._durable, job.step)
        if self._keep is not None:
            retire(self._durable, job.step, self._keep)
            self._durable_known = set(self.durable_steps())

    def _share_commit(self, job: _Job) -> tuple[LocalCommit | None, tuple[str, ...] | None] | None:
        """Node-local directories, every rank's replicator, for every job (the
        collectives on the replicator's group pair up: every rank queues the
        same jobs in the same order). The coordinator's commit of the step
        (broadcast, or the catch-up's) becomes every node's (its leader's
        :func:`~.nodes.localize`); returns it and the files this rank
        uploads: those its save wrote, or in a catch-up the ones its node
        holds (the leader's), once the gathered holdings cover the commit;
        None when they do not (a lost node: the step cannot be replicated,
        and stays local until retention removes it; logged, not raised,
        since no later call could mend it)."""
        assert self._bg is not None
        src = coordinator_rank(self._group)
        commit = job.commit
        if job.files is not None:
            mine = None
            if self._coordinator:
                try:
                    mine = read_local_commit(self._local, job.step)
                except CheckpointError as e:
                    log.error("could not read the local commit of step %d: %s", job.step, e)
            box: list[LocalCommit | None] = [mine]
            dist.broadcast_object_list(box, src=src, group=self._bg)
            commit = box[0]
        if commit is None:
            raise SaveError(f"the coordinator's local copy of step {job.step} has no {METADATA} with its manifest")
        held: list[str] = []
        if self._leader:
            try:
                if not self._coordinator and read_local_commit(self._local, job.step) != commit:
                    localize(self._local, job.step, commit)
                held = held_files(self._local, job.step, commit)
            except CheckpointError as e:  # the node's copy stays uncommitted; the durable one is made all the same
                log.error("could not commit the local copy of step %d under %s: %s", job.step, self.local_uri, e)
        if job.files is not None:
            return commit, job.files
        views: list[list[str]] = [[]] * dist.get_world_size(self._bg)
        dist.all_gather_object(views, held, group=self._bg)
        missing = set(commit.manifest["files"]).difference(*views)
        if missing:
            if self._coordinator:
                log.warning(
                    "step %d cannot be replicated to %s: no node's local_dir holds %s (%d file(s)); it stays local",
                    job.step, self.uri, sorted(missing)[:3], len(missing),
                )
            return None
        return commit, tuple(held)

    def _retire_local(self, newest: int) -> None:
        """Keep the ``local_keep`` newest committed local steps up to ``newest``;
        delete older ones unless they still need replicating."""
        assert self._local_keep is not None
        try:
            durable = commit_times(self._durable)
            candidates = [s for s in committed_steps(self._local) if s <= newest]
        except CheckpointError as e:
            log.warning("local retention under %s skipped: %s", self.local_uri, e)
            return
        for step in candidates[: -self._local_keep]:
            if self._needs_replication(step, durable):
                continue
            try:
                delete_step(self._local, step)
            except CheckpointError as e:
                log.warning("local retention could not delete step %d under %s: %s", step, self.local_uri, e)

    # -- loading --------------------------------------------------------------
    def locate(
        self, step: int | None, group: dist.ProcessGroup | None, state_dict: dict[str, Any] | None = None
    ) -> tuple[int, str]:
        """Collective: every rank's local steps and the coordinator's durable
        listing are gathered, so every rank decides alike. ``state_dict``:
        what the load fills in (node-local directories: the local copy is
        read only if every rank's holds what its load plan reads); None
        (``latest_step``): only where the step lives."""
        mine = (self.local_steps(), self.durable_steps() if self._coordinator else [])
        views: list[tuple[list[int], list[int]]] = [mine]
        if is_distributed():
            views = [mine] * dist.get_world_size(group)
            dist.all_gather_object(views, mine, group=group)
        local = set.intersection(*(set(v[0]) for v in views))
        durable = set(views[0][1])
        candidates = sorted(local | durable, reverse=True) if step is None else [check_step(step)]
        for s in candidates:
            if s in local and (state_dict is None or self._reads_locally(s, state_dict, group)):
                return s, self.save_uri(s)
            if s in durable:
                return s, self.durable_uri(s)
            if s in local:
                log.warning("step %d is committed locally, but not every rank's local_dir holds what it reads, "
                            "and %s does not hold it: loading an older step", s, self.uri)
        raise not_found(f"{self.uri} or {self.local_uri}")

    def _reads_locally(self, step: int, state_dict: dict[str, Any], group: dist.ProcessGroup | None) -> bool:
        """Whether every rank's local copy of ``step`` holds the files its load
        plan reads (collective with node-local directories; a whole copy, as
        one shared directory holds, always does)."""
        if not self._nodes.node_local:
            return True
        ok = False
        try:
            commit = read_local_commit(self._local, step)
            if commit is not None:
                where = self._local.describe(f"{step_dir(step)}/{METADATA}")
                ok = holds(self._local, step, commit, plan_files(state_dict, commit, where))
        except Exception as e:  # noqa: BLE001 -- the durable copy's load then reports it properly
            log.warning("the local copy of step %d is not read: %s", step, e)
        views = [ok] * dist.get_world_size(group)
        dist.all_gather_object(views, ok, group=group)
        return all(views)

    # -- waiting --------------------------------------------------------------
    def wait(self, timeout: float | None) -> None:
        """Until every queued step is replicated (or ``timeout`` s); then
        raise the first replication error since the last wait, if any. On the
        coordinator "replicated" means the replica is committed; on other
        ranks, that their files are uploaded and reported (a failure on any
        rank makes the coordinator's wait raise, naming the missing files)."""
        self._wait_idle(timeout)
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            raise SaveError(f"replication to {self.uri} failed: {errors[0]}") from errors[0]

    def _wait_idle(self, timeout: float | None) -> None:
        """Until the replicator has nothing queued or in progress (or raise
        :class:`SaveError` after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    pending = sorted({j.step for j in self._queue})
                    raise SaveError(
                        f"replication to {self.uri} still running after {timeout:g} s "
                        f"(steps queued: {pending or 'none'}; one in progress: {self._busy})"
                    )
                self._cond.wait(left)

    def close(self) -> None:
        """Finish the queued replications (at most ``replicate_timeout_s``),
        then release both storages."""
        try:
            self.wait(self._timeout_s)
        finally:
            with self._cond:
                self._closed = True
                idle = not (self._busy or self._queue)
                self._cond.notify_all()
            if idle:
                self._durable.close()
                self._local.close()
                self._drop_group()

    def _drop_group(self) -> None:
        group, self._bg = self._bg, None
        if group is not None and is_distributed():
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as e:  # its default group went first
                log.debug("the replicator's group was already gone: %s", e)


def check_tier_options(local_keep: object, replicate_every: object, timeout_s: object) -> None:
    if local_keep is not None and (isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 1):
        raise InvalidArgument(f"local_keep must be None (keep all) or an int >= 1, got {local_keep!r}")
    if isinstance(replicate_every, bool) or not isinstance(replicate_every, int) or replicate_every < 1:
        raise InvalidArgument(f"replicate_every must be an int >= 1, got {replicate_every!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"replicate_timeout_s must be a positive number of seconds, got {timeout_s!r}")
