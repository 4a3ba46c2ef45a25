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
* **One directory, or one per node** (:mod:`.nodes`; found when the
  manager is made, a collective then). Node-local: each node holds the
  files its ranks wrote; its leader puts the in-flight marker with the
  manager's save id there before each save and commits the coordinator's
  manifest and ``.metadata`` (broadcast on the replicator's own gloo group:
  every rank's replicator handles the same jobs in the same order, so those
  collectives pair up) after it, and applies local retention there.
  Catch-up broadcasts the coordinator's commits when the manager is made;
  each leader uploads what its node holds of them (a step no node holds
  whole stays local, logged).
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
* **gc**: every writer of a step directory holds a lease there
  (:mod:`.leases`), so ``dcpstore gc`` on either tier never takes a step
  in progress.
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

from ...dcp.commit import Commit
from ...errors import CheckpointError, InvalidArgument, SaveError
from ...format.layout import METADATA
from ...handle import SaveHandle
from ...storage import Storage, join_uri
from ..roots import group_rank, is_distributed, not_found
from ..steps import (
    check_step,
    commit_times,
    committed_steps,
    delete_step,
    read_pointer,
    retire,
    step_dir,
    write_pointer,
)
from .leases import TierLeases
from .nodes import NodeSync, put_marker, reads_locally, share_commit
from .replicate import (
    check_no_clash,
    commit_replica,
    needs_replication,
    read_local_commit,
    replica_lease,
    replica_taken_over,
    upload_files,
    whole_local_steps,
    write_report,
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
    commit: Commit | None = None


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
        #: Durable steps as of construction, plus those replicated since: what
        #: ``save`` checks (no object-store round trip while the caller waits).
        self._durable_known: set[int] = set()
        #: Markers' and lingering replica leases; what failed replications left undone.
        self._leases = TierLeases()
        try:
            self._sync = NodeSync.open(self._local, group, self._rank)  # collective (torch.distributed)
            self._nodes = self._sync.nodes
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
        return any(self._sync.gather(mine)) if self._nodes.node_local else mine

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
        """Selected, and the local commit still has to go to the durable tier
        (:func:`~.replicate.needs_replication`)."""
        return self.selected(step) and needs_replication(self._local, self._durable, step, durable, self._keep)

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
        Node-local directories: see :meth:`_before_node_save`."""
        if self._nodes.node_local:
            return self._before_node_save(step, overwrite)
        if overwrite and self._coordinator:
            self.wait(self._timeout_s)
            prefix = step_dir(step)
            if any(True for _ in self._durable.list(f"{prefix}/")):
                self._leases.hold_marker(step, put_marker(self._local, step, os.urandom(8).hex()))
        return None

    def _before_node_save(self, step: int, overwrite: bool) -> str:
        """Every rank derives the same save id (:meth:`NodeSync.save_id`: no
        collective where the training waits); each leader puts the marker
        holding it into its step directory (so every save has save-unique
        names there). An overwrite first waits for the replicator on every
        rank: the node's copy of the older commit is made and cleaned up
        before the new save writes beside it."""
        if overwrite:
            self._wait_idle(self._timeout_s)  # a replication error stays for wait() to raise
        save_id = self._sync.save_id(step)
        if self._leader:
            try:
                lease = put_marker(self._local, step, save_id)
                if lease is not None:
                    self._leases.hold_marker(step, lease)
            except CheckpointError as e:  # the node's ranks then fail the save together, through DCP
                log.error("could not put the in-flight marker of step %d under %s: %s", step, self.local_uri, e)
        return save_id

    def saved(self, step: int, handle: SaveHandle) -> None:
        """Queue ``step`` for replication as soon as its local save commits."""

        def done(h: SaveHandle) -> None:
            failed = h.exception() is not None
            if failed or not self._nodes.node_local or self._coordinator:
                self._leases.end_marker(step)  # the save committed this directory's copy, or failed
            if not failed:
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
        found: list[tuple[int, Commit]] = []
        if self._coordinator and durable is not None:
            try:
                for step in self.local_steps():
                    commit = read_local_commit(self._local, step) if self._needs_replication(step, durable) else None
                    if commit is not None:
                        found.append((step, commit))
            except CheckpointError as e:  # saves still commit locally; a later manager catches up
                log.error("catch-up under %s skipped: %s", self.local_uri, e)
                found = []
        for step, commit in self._sync.from_coordinator(found):
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
            self._leases.leftovers.retry()
            try:
                self._replicate(job)
            except BaseException as e:  # kept for wait()/close(); the thread goes on
                log.error("replicating step %d to %s failed: %s", job.step, self.uri, e)
                with self._cond:
                    self._errors.append(e)
            self._leases.keep_unfinished((self._durable, self._local))
            if self._leader and self._local_keep is not None:
                self._retire_local(job.step)

    def _replicate(self, job: _Job) -> None:
        commit: Commit | None
        files: tuple[str, ...] | None
        if self._nodes.node_local:
            mine = job.commit
            if self._coordinator and job.files is not None:
                try:
                    mine = read_local_commit(self._local, job.step)
                except CheckpointError as e:  # every rank still joins the broadcast, and fails alike
                    log.error("could not read the local commit of step %d: %s", job.step, e)
            try:
                shared = share_commit(self._sync, self._local, job.step, self._rank, mine, job.files is None)
            finally:
                self._leases.end_marker(job.step)  # the node's copy is committed now (or cannot be)
            if shared is None:
                return
            commit, files = shared[0], job.files if job.files is not None else shared[1]
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
            lease = replica_lease(self._durable, job.step)
            try:
                own = upload_files(self._local, self._durable, job.step, files, expected, self._workers)
                report = write_report(self._durable, job.step, self._rank, own)
            except BaseException:
                lease.stop()
                raise
            # Its files need the lease until the coordinator commits them (or gives up).
            lease.linger(lambda: replica_taken_over(self._durable, job.step, report, commit), started + self._timeout_s)
            self._leases.linger(lease)
            self._durable_known.add(job.step)  # the coordinator commits it (or wait() raises there)
            return
        lease = replica_lease(self._durable, job.step)
        try:
            own = upload_files(self._local, self._durable, job.step, files, expected, self._workers)
            commit_replica(self._local, self._durable, job.step, own, started + self._timeout_s)
        finally:
            lease.stop()
        self._durable_known.add(job.step)
        log.info("step %d replicated to %s in %.2f s", job.step, self.uri, time.monotonic() - started)
        write_pointer(self._durable, job.step)
        if self._keep is not None:
            retire(self._durable, job.step, self._keep)
            self._durable_known = set(self.durable_steps())

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
            if s in local and (state_dict is None or self._reads_locally(s, state_dict)):
                return s, self.save_uri(s)
            if s in durable:
                return s, self.durable_uri(s)
            if s in local:
                log.warning("step %d is committed locally, but not every rank's local_dir holds what it reads, "
                            "and %s does not hold it: loading an older step", s, self.uri)
        raise not_found(f"{self.uri} or {self.local_uri}")

    def _reads_locally(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Every rank's local copy of ``step`` holds what it reads (collective
        with node-local directories; a whole copy in one directory does)."""
        return not self._nodes.node_local or all(self._sync.gather(reads_locally(self._local, step, state_dict)))

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
        """Finish the queued replications (at most ``replicate_timeout_s``;
        on other ranks than the coordinator, until it committed the steps
        they uploaded: their files need their lease until then, see
        :func:`~.replicate.replica_lease`), then release both storages."""
        try:
            self.wait(self._timeout_s)
        finally:
            with self._cond:
                self._closed = True
                idle = not (self._busy or self._queue)
                self._cond.notify_all()
            self._leases.close((self._durable, self._local))
            if idle:
                self._durable.close()
                self._local.close()


def check_tier_options(local_keep: object, replicate_every: object, timeout_s: object) -> None:
    if local_keep is not None and (isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 1):
        raise InvalidArgument(f"local_keep must be None (keep all) or an int >= 1, got {local_keep!r}")
    if isinstance(replicate_every, bool) or not isinstance(replicate_every, int) or replicate_every < 1:
        raise InvalidArgument(f"replicate_every must be an int >= 1, got {replicate_every!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"replicate_timeout_s must be a positive number of seconds, got {timeout_s!r}")
