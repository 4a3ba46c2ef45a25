"""The tiered manager's :class:`~dcpstore._impl.manager.roots.Roots`: a local tier
that saves commit to, and a replicator thread per rank that copies each
committed step to the durable tier, applies retention to both and answers
which copy a load reads (see :mod:`dcpstore._impl.manager.tiers` for the whole
picture). How the ranks share ``local_dir`` is a :class:`~.local_tier.LocalTier`
strategy, asked wherever one directory and one per node differ.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager.roots import group_rank, not_found
from dcpstore._impl.manager.steps import (
    check_step,
    commit_times,
    committed_steps,
    delete_step,
    read_pointer,
    retire,
    step_dir,
    write_pointer,
)
from dcpstore._impl.manager.tiers.kept_leases import TierLeases
from dcpstore._impl.manager.tiers.local_tier import Job, LocalTier, SharedDir, TierParts
from dcpstore._impl.manager.tiers.nodes import NodeDirs, NodeSync
from dcpstore._impl.manager.tiers.peers import check_peers, check_replica_options
from dcpstore._impl.manager.tiers.replicate import (
    check_no_clash,
    commit_replica,
    needs_replication,
    replica_lease,
    replica_taken_over,
    upload_files,
    write_report,
)
from dcpstore._impl.storage import Storage, join_uri
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointError, InvalidArgument, SaveError
from dcpstore._impl.values.results import SaveHandle

log = logging.getLogger(__name__)


class TieredRoots:
    """A local tier and a durable tier; see :mod:`dcpstore._impl.manager.tiers`.

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
        local_replicas: int = 1,
        replica_jump: int = 1,
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
        self._queue: deque[Job] = deque()
        self._busy = False
        #: Saves whose handle has not run :meth:`saved`'s callback yet: a
        #: handle's result() returns before its callbacks run, so a wait()
        #: right after the save must count them or return before the step is queued.
        self._unqueued = 0
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Durable steps as of construction, plus those replicated since: what
        #: ``save`` checks (no object-store round trip while the caller waits).
        self._durable_known: set[int] = set()
        #: Markers' and lingering replica leases; what failed replications left undone.
        self._leases = TierLeases()
        try:
            sync = NodeSync.open(self._local, group, self._rank)  # collective (torch.distributed)
            parts = TierParts(
                self._local,
                self._durable,
                self._rank,
                self._leases,
                wait=lambda: self.wait(self._timeout_s),
                wait_idle=lambda: self._wait_idle(self._timeout_s),
            )
            check_peers(sync.nodes.count, local_replicas, replica_jump, self._local.uri)  # alike on every rank
            self._tier: LocalTier = (
                NodeDirs(sync, parts, local_replicas, replica_jump) if sync.node_local else SharedDir(parts)
            )
            failure: BaseException | None = None
            try:
                replicas = commit_times(self._durable)  # also: the durable root is reachable
            except BaseException as e:  # raised after the collectives below (node-local)
                failure, replicas = e, {}
            # Before the catch-up, which would commit the coordinator's commit on a replacement node without its files.
            copies = self._tier.restore_from_peers(replicas)  # collective
            self._durable_known = set(replicas)
            for job in copies:  # every rank queues them alike, first
                self._submit(job)
            self._catch_up(None if failure else replicas)
            if failure is not None:
                raise failure
        except BaseException:
            self.close()
            raise

    @property
    def _coordinator(self) -> bool:
        return self._rank == 0

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
        return self._tier.any_rank(mine)

    def local_steps(self) -> list[int]:
        """Steps this rank holds a local copy of: a whole one (every file the
        manifest names) in one shared directory; node-local, a commit (the
        node's share is checked against the load plan, :meth:`locate`)."""
        return self._tier.local_steps()

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
        commits over it as any overwrite save does (:mod:`dcpstore._impl.dcp.commit`):
        data files and manifest under the new save's names, ``.metadata``
        last, then the old copy's files go. That needs names the durable
        copy does not use: the local save picks save-unique ones where its
        directory holds anything, so where the durable tier holds files of
        the step an in-flight marker is put in the local step directory
        first (the claim replaces it). Should the random tags still meet
        (1 in 2**32), the replication refuses
        (:func:`~.replicate.check_no_clash`) rather than touch the old copy.
        Where, and the save id, are the local tier's
        (:meth:`.local_tier.SharedDir.before_save`, :meth:`.nodes.NodeDirs.before_save`)."""
        return self._tier.before_save(step, overwrite)

    def saved(self, step: int, handle: SaveHandle) -> None:
        """Queue ``step`` for replication as soon as its local save commits."""

        def done(h: SaveHandle) -> None:
            try:
                failed = h.exception() is not None
                if failed or self._tier.saves_commit_here:
                    self._leases.end_marker(step)  # the save committed this directory's copy, or failed
                if not failed:
                    self._submit(Job(step, h.result().files))
            finally:
                with self._cond:
                    self._unqueued -= 1
                    self._cond.notify_all()

        with self._cond:
            self._unqueued += 1
        handle.add_done_callback(done)

    def committed(self, step: int) -> None:
        write_pointer(self._local, step)

    def _submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                log.error("step %d committed locally after the manager closed; not replicated", job.step)
                return
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcpstore-replicate", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _catch_up(self, durable: Mapping[int, float | None] | None) -> None:
        """Queue the committed local steps that still need replicating (the
        local tier's choice of ranks; ``durable`` None: this rank could not
        list the durable tier, and raises after this)."""
        needs = None if durable is None else lambda step: self._needs_replication(step, durable)
        for job in self._tier.catch_up(needs):
            if self._coordinator:
                log.info(
                    "step %d is committed locally but not (as this commit) in %s: replicating it", job.step, self.uri
                )
            self._submit(job)

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
                try:
                    self._replicate(job)
                finally:
                    self._tier.copies_done()  # the peer copies beside the upload (raises their error)
            except BaseException as e:  # kept for wait()/close(); the thread goes on
                log.error("replicating step %d to %s failed: %s", job.step, self.uri, e)
                with self._cond:
                    self._errors.append(e)
            self._leases.keep_unfinished((self._durable, self._local))
            if self._tier.leader and self._local_keep is not None:
                self._retire_local(job.step)

    def _replicate(self, job: Job) -> None:
        found = self._tier.commit_of(job)
        if found is None:
            return
        commit, files = found
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
        self._tier.retire_peers(newest, self._local_keep, lambda step: self._not_yet_durable(step, durable))

    def _not_yet_durable(self, step: int, durable: Mapping[int, float | None]) -> bool:
        """Selected, missing from the durable tier and not older than its
        ``keep`` newest: a copy of it may be the last one anywhere."""
        if not self.selected(step) or step in durable:
            return False
        return self._keep is None or sum(1 for d in durable if d > step) < self._keep

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
                log.warning(
                    "step %d is committed locally, but not every rank's local_dir holds what it reads, "
                    "and %s does not hold it: loading an older step",
                    s,
                    self.uri,
                )
        raise not_found(f"{self.uri} or {self.local_uri}")

    def _reads_locally(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Every rank's local copy of ``step`` holds what it reads (collective
        with node-local directories; a whole copy in one directory does)."""
        return self._tier.reads_locally(step, state_dict)

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
            while self._queue or self._busy or self._unqueued:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    pending = sorted({j.step for j in self._queue})
                    raise SaveError(
                        f"replication to {self.uri} still running after {timeout:g} s "
                        f"(steps queued: {pending or 'none'}; one in progress: {self._busy}; "
                        f"saves not yet queued: {self._unqueued})"
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


def check_tier_options(
    local_keep: object, replicate_every: object, timeout_s: object, local_replicas: object = 1, replica_jump: object = 1
) -> None:
    check_replica_options(local_replicas, replica_jump)
    if local_keep is not None and (isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 1):
        raise InvalidArgument(f"local_keep must be None (keep all) or an int >= 1, got {local_keep!r}")
    if isinstance(replicate_every, bool) or not isinstance(replicate_every, int) or replicate_every < 1:
        raise InvalidArgument(f"replicate_every must be an int >= 1, got {replicate_every!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"replicate_timeout_s must be a positive number of seconds, got {timeout_s!r}")
