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
* **One local directory**: ``local_dir`` must be the same directory for
  every rank of the job (one node's disk, or a path every node sees). The
  first save checks it (collective, once per manager): each rank writes a
  probe file there and every rank looks for every other rank's; if any rank
  misses one, every rank's save raises :class:`InvalidArgument` before
  anything is written. Node-local directories are not supported yet: the
  save's commit protocol checks ownership through the coordinator's
  in-flight marker on every rank; the claim chooses the names (stock or
  save-unique) from the coordinator's directory alone, so another node's
  ranks could write over an older copy there in place; and only the
  coordinator's directory would hold the commit (``.metadata`` and
  manifest), which the other nodes' loads, retention and catch-up need.
  (Loads alone already work with differing directories: a rank without a
  whole copy sends every rank to the durable tier.)
* **Loading** (collective): every rank lists its *whole* local copies (the
  manifest and every file it names, at its size); the step is the newest
  committed one in either tier; it is read from the local tier if every rank
  holds a whole local copy of it, else by every rank from the durable tier.
  A fresh node with an empty ``local_dir`` thus resumes from the durable
  tier; DCP resharding works from either, since every rank reads one whole
  checkpoint.
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

import torch.distributed as dist

from ..errors import CheckpointError, InvalidArgument, SaveError, StorageNotFound
from ..format.layout import INFLIGHT, METADATA
from ..format.manifest import METADATA_LIMIT, read_capped
from ..handle import SaveHandle
from ..storage import Storage, join_uri
from .replicate import (
    check_no_clash,
    commit_replica,
    keep_alive,
    read_local_commit,
    upload_files,
    whole_local_steps,
    write_report,
)
from .roots import group_rank, is_distributed, not_found
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

#: The probe files of the one-directory check (``<prefix><rank>.<random>``,
#: in ``local_dir`` itself, removed right after the check).
PROBE_PREFIX = ".dcpstore.probe."


@dataclass(frozen=True)
class _Job:
    step: int
    #: The data files this rank's save wrote; None: catch-up (coordinator,
    #: every file the local manifest names).
    files: tuple[str, ...] | None


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
        self._one_dir_checked = False
        #: Durable steps as of construction, plus those replicated since: what
        #: ``save`` checks (no object-store round trip while the caller waits).
        try:
            replicas = commit_times(self._durable)  # also: the durable root is reachable
            self._durable_known = set(replicas)
            if self._coordinator:
                self._catch_up(replicas)
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
        knows it: listed at construction, plus what it replicated since)."""
        return step in self._durable_known or self._local.exists(f"{step_dir(step)}/{METADATA}")

    def local_steps(self) -> list[int]:
        """Steps this rank holds a whole local copy of."""
        return whole_local_steps(self._local)

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
    def before_save(self, step: int, overwrite: bool) -> None:
        """Every rank, before each save: the first one checks that every
        rank sees one ``local_dir`` (:meth:`_check_one_local_dir`).

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
        (:func:`~.replicate.check_no_clash`) rather than touch the old copy."""
        self._check_one_local_dir()
        if overwrite and self._coordinator:
            self.wait(self._timeout_s)
            prefix = step_dir(step)
            if any(True for _ in self._durable.list(f"{prefix}/")):
                self._local.put(f"{prefix}/{INFLIGHT}", b"")

    def _check_one_local_dir(self) -> None:
        """Collective, once: every rank writes a probe file into ``local_dir``
        and looks for every rank's; raise :class:`InvalidArgument` on every
        rank alike (the gathered views are the same everywhere) if some rank
        misses one. A rank that cannot write its probe still joins both
        gathers, so that no rank waits for it forever."""
        if self._one_dir_checked or not is_distributed():
            return
        probe = f"{PROBE_PREFIX}{self._rank}.{os.urandom(8).hex()}"
        token: str | None = probe
        try:
            self._local.makedirs()
            self._local.put(probe, b"")
        except CheckpointError as e:
            log.error("could not write the probe file %s: %s", self._local.describe(probe), e)
            token = None
        try:
            world = dist.get_world_size(self._group)
            tokens: list[str | None] = [None] * world
            dist.all_gather_object(tokens, token, group=self._group)
            unseen = [r for r, t in enumerate(tokens) if not self._sees(t)]
            views: list[list[int]] = [[]] * world
            dist.all_gather_object(views, unseen, group=self._group)  # also: no probe goes before every rank looked
        finally:
            if token is not None:
                try:
                    self._local.delete([token])
                except CheckpointError as e:  # an empty file beside the steps: harmless
                    log.warning("could not remove the probe file %s: %s", self._local.describe(token), e)
        blind = {rank: missed for rank, missed in enumerate(views) if missed}
        if blind:
            shown = "; ".join(f"rank {r} does not see the file(s) of rank(s) {m}" for r, m in sorted(blind.items()))
            raise InvalidArgument(
                f"local_dir {self.local_uri} is not one directory that every rank sees ({shown}): a tiered "
                "manager needs one local directory for the whole job (one node's disk, or a path every node "
                "mounts); node-local directories are not supported yet. Nothing was saved"
            )
        self._one_dir_checked = True

    def _sees(self, probe: str | None) -> bool:
        try:
            return probe is not None and self._local.exists(probe)
        except CheckpointError:
            return False

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
            if self._coordinator and self._local_keep is not None:
                self._retire_local(job.step)

    def _replicate(self, job: _Job) -> None:
        if not self.selected(job.step):
            return
        started = time.monotonic()
        commit = read_local_commit(self._local, job.step)
        expected = commit.manifest if commit is not None else None
        files = job.files
        if files is None:  # catch-up: the coordinator copies every file the manifest names
            if expected is None:
                raise SaveError(f"{self._local.describe(step_dir(job.step))} has no {METADATA} with its manifest")
            files = tuple(expected["files"])
        check_no_clash(self._durable, job.step, files, commit)
        if not self._coordinator:
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
    def locate(self, step: int | None, group: dist.ProcessGroup | None) -> tuple[int, str]:
        """Collective: every rank's whole local steps and the coordinator's
        durable listing are gathered, so every rank decides alike."""
        mine = (self.local_steps(), self.durable_steps() if self._coordinator else [])
        views: list[tuple[list[int], list[int]]] = [mine]
        if is_distributed():
            views = [mine] * dist.get_world_size(group)
            dist.all_gather_object(views, mine, group=group)
        local = set.intersection(*(set(v[0]) for v in views))
        durable = set(views[0][1])
        if step is None:
            if not local and not durable:
                raise not_found(f"{self.uri} or {self.local_uri}")
            step = max(local | durable)
        step = check_step(step)
        if step in local:
            return step, self.save_uri(step)
        if step in durable:
            return step, self.durable_uri(step)
        raise not_found(f"{self.uri} or {self.local_uri}")

    # -- waiting --------------------------------------------------------------
    def wait(self, timeout: float | None) -> None:
        """Until every queued step is replicated (or ``timeout`` s); then
        raise the first replication error since the last wait, if any. On the
        coordinator "replicated" means the replica is committed; on other
        ranks, that their files are uploaded and reported (a failure on any
        rank makes the coordinator's wait raise, naming the missing files)."""
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
            errors, self._errors = self._errors, []
        if errors:
            raise SaveError(f"replication to {self.uri} failed: {errors[0]}") from errors[0]

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


def check_tier_options(local_keep: object, replicate_every: object, timeout_s: object) -> None:
    if local_keep is not None and (isinstance(local_keep, bool) or not isinstance(local_keep, int) or local_keep < 1):
        raise InvalidArgument(f"local_keep must be None (keep all) or an int >= 1, got {local_keep!r}")
    if isinstance(replicate_every, bool) or not isinstance(replicate_every, int) or replicate_every < 1:
        raise InvalidArgument(f"replicate_every must be an int >= 1, got {replicate_every!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(f"replicate_timeout_s must be a positive number of seconds, got {timeout_s!r}")
