"""Async saves: stage on the caller's thread, write and commit in the background.

Call order of ``AsyncSaver.save`` (what ``dcpstore.save(..., async_=True)``
runs on the per-process default saver, :func:`default_saver`)::

    caller's thread   validate; open the storage; choose the engine
                      wait until fewer than ``max_in_flight`` saves are pending
                      (a new save first finishes the oldest one)
                      raise an earlier save's failure that its handle never
                      reported (see "Failures nobody looked at" below)
                      first use of a process group: create its background group
                      stage: a consistent host copy (engines/staging.py)
                      submit to the background thread; return a SaveHandle
    background thread the engine plans, writes, commits and finalizes on the
                      staged copy (the whole DCP save; NVRx's plan/write/
                      finalize; or the DCP save in the checkpoint process),
                      then the staging buffers go back for the next save

There is one background thread per saver, so saves finalize in save order and
every rank runs its background collectives in the same order. It is a daemon
thread (dcpstore/_impl/util/threads.py says why): at interpreter exit the saver waits for
its pending saves, but a save running longer than ``hang_timeout`` is
presumed hung and abandoned with a logged error, so a storage call that never
returns cannot keep the process from exiting; nor does it block the next
``save`` or ``close()`` forever (they raise :class:`SaveError`).

Background collectives. DCP's planning and commit are collectives. Run on a
background thread they must not interleave with the training thread's own
collectives, so each saver creates, on first use of a process group, a
*dedicated* gloo group with the same ranks (``dist.new_group``, a collective
itself, run on the caller's thread where every rank calls ``save`` in step).
This is done for a gloo default group too: sharing it between two threads
would interleave their collectives. CPU-only and NCCL jobs both work, since the
staged tensors are in host memory. The commit happens only if every rank's
write succeeded (DCP / NVRx gather the results); otherwise every rank's handle
raises. A rank that fails *before* its first background collective (e.g. dies)
leaves the others waiting until the group's timeout (``collective_timeout``).

Failures nobody looked at. A save's failure is *observed* when its handle's
``result()`` or ``exception()`` reports it. One that is not is raised, once,
chained to it, by the next ``save`` on the same saver (before it starts
anything: every rank sees the same failure, so every rank raises) and by
``close()``; at interpreter exit it is logged at ERROR with its traceback.
The exit status is left alone (docs/usage.md, "Async saves", says why). The
failure is also logged at ERROR when it happens.

Engines (:mod:`.engine`; chosen by :mod:`.selection`): the background half
is the engine's (:meth:`~dcpstore._impl.engines.engine.Engine.save`), the rest
-- staging, the order of saves, failures, limits -- is the saver's, for
every engine alike. ``native`` (:mod:`.native`: DCP's save with dcpstore's
writer; any backend), ``nvrx`` (:mod:`.nvrx`, POSIX and MSC) and
``process`` (:mod:`.process`: the native save in a checkpoint process per
rank, staged in shared memory; any backend). ``auto`` picks the process
engine for an object store from a process that uses CUDA or has enough
cores, else native (:mod:`.selection` says why, and warns with
:class:`~dcpstore._impl.util.errors.EngineFallbackWarning` when its
preference cannot run).

State kept by a saver, all bounded: the background thread, the staging-buffer
pool (``staging_cache`` structures x ``max_in_flight`` buffer sets), one
background group per process group used, and one instance of each engine it
ran (NVRx: a metadata cache per background group, for the structure saved
last; process: a checkpoint process per background group). ``close()``
releases them.

Process state: :func:`default_saver` keeps one saver per process for
``dcpstore.save(async_=True)`` and :class:`~dcpstore.CheckpointManager`. It
is a cache (thread, buffers, groups), not a setting: every call still
chooses its engine, URI and limits. Exit: every saver registers with
:mod:`.exit`, the one interpreter-exit hook.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from typing import Any

from dcpstore._impl.dcp.failures import save_error
from dcpstore._impl.dcp.liveness.retried_cleanups import Leftovers, with_leftovers
from dcpstore._impl.engines import exit as exit_hook
from dcpstore._impl.engines.engine import Engine, SaveJob, engine_class
from dcpstore._impl.engines.selection import agree_on_engine, select_engine
from dcpstore._impl.engines.staging import Staging
from dcpstore._impl.storage import open_storage
from dcpstore._impl.util.errors import InvalidArgument, SaveError
from dcpstore._impl.util.groups import BackgroundGroups
from dcpstore._impl.util.keyword_hints import hint_keywords, hint_keywords_with
from dcpstore._impl.util.progress import Progress
from dcpstore._impl.util.threads import BackgroundThread
from dcpstore._impl.util.units import check_seconds
from dcpstore._impl.values.keywords import pass_whole, resolve_options
from dcpstore._impl.values.options import SaveOptions, check_positive, check_workers, rank_label, shows_progress
from dcpstore._impl.values.results import CheckpointInfo, SaveHandle

log = logging.getLogger(__name__)


class AsyncSaver:
    """Runs async saves: stages on the caller's thread, writes in the background.

    Keep one per training job (``dcpstore.save(async_=True)`` uses a
    per-process default one) so staging buffers, background groups and NVRx
    plan caches are reused across saves::

        saver = dcpstore.AsyncSaver(max_in_flight=1)
        h = saver.save(model.state_dict(), "s3://b/run/step100", options=dcpstore.SaveOptions(engine="native"))
        ...            # training continues; may mutate the tensors
        h.result()     # CheckpointInfo, or raises SaveError
        saver.close()

    A save whose failure its handle never reported (no ``result()`` or
    ``exception()``) is raised by the next ``save`` and by ``close()``, and
    logged at interpreter exit.

    Args:
        max_in_flight: saves allowed to be pending at once; a new save first
            waits for the oldest (default 1: each save finishes the previous
            one).
        staging_cache: how many state-dict structures keep their staging
            buffers between saves (0: allocate every time).
        collective_timeout: timeout of the background process groups
            (seconds or a ``timedelta``; default: torch's).
        hang_timeout: seconds a background save may run before it is
            presumed hung (default 1800; ``None``: never). Past it, a new
            ``save`` no longer waits for it but raises :class:`SaveError`,
            ``close()`` stops waiting and raises, and interpreter exit stops
            waiting and logs an error naming the URI (the process then
            exits; nothing hangs forever -- Megatron-LM #2422). Raise it for
            saves that legitimately take longer. ``handle.result(timeout=...)``
            bounds a single wait independently.

    Raises:
        InvalidArgument: a value out of range.
    """

    @hint_keywords
    def __init__(
        self,
        *,
        max_in_flight: int = 1,
        staging_cache: int = 2,
        collective_timeout: timedelta | float | None = None,
        hang_timeout: float | None = 1800.0,
    ) -> None:
        self.max_in_flight = check_positive("max_in_flight", max_in_flight)
        if hang_timeout is not None:  # None: never presumed hung; infinity alike
            check_seconds("hang_timeout", hang_timeout, infinite=True)
        self.hang_timeout = hang_timeout
        if isinstance(staging_cache, bool) or not isinstance(staging_cache, int) or staging_cache < 0:
            raise InvalidArgument(f"staging_cache must be an int >= 0, got {staging_cache!r}")
        if isinstance(collective_timeout, timedelta):
            if collective_timeout <= timedelta(0):
                raise InvalidArgument(f"collective_timeout must be above zero, got {collective_timeout!r}")
        elif collective_timeout is not None:
            collective_timeout = timedelta(seconds=check_seconds("collective_timeout", collective_timeout))
        self._staging = Staging(max_structures=staging_cache, max_sets=self.max_in_flight)
        self.pool = self._staging.pool
        self._groups = BackgroundGroups(collective_timeout, desc="dcpstore_async_save")
        self._collective_timeout = collective_timeout
        #: One instance per engine this saver has run (name -> engine).
        self._engines: dict[str, Engine] = {}
        # every save not yet seen finished, oldest first
        self._pending: deque[SaveHandle] = deque()
        # saves seen failed whose handle has not reported it yet (see _raise_unobserved)
        self._failed: list[SaveHandle] = []
        self._background = BackgroundThread("dcpstore-async")
        #: Clean-ups of failed saves that the storage refused, tried again later.
        self.leftovers = Leftovers()
        self._lock = threading.RLock()
        self._closed = False
        exit_hook.watch(self, exit_hook.Stage.SAVERS)

    # -- public ---------------------------------------------------------------
    @hint_keywords_with(pass_whole(SaveOptions()))
    def save(
        self,
        state_dict: dict[str, Any],
        uri: str | os.PathLike[str],
        *,
        options: SaveOptions | None = None,
    ) -> SaveHandle:
        """Stage ``state_dict`` and save it to ``uri`` in the background.

        Every rank calls it (SPMD). Returns once the snapshot is taken; the
        caller may then change its tensors::

            saver.save(state, uri, options=dcpstore.SaveOptions(engine="native", workers=4))

        Args:
            state_dict, uri: as for :func:`dcpstore.save`.
            options: how to save (:class:`~dcpstore.SaveOptions`; default:
                its defaults); ``options.max_in_flight`` is this call's
                limit on pending saves (``None``: the saver's). A saver's
                saves run in the background whatever ``options.async_`` says.

        Returns:
            The save's :class:`~dcpstore.SaveHandle`.

        Raises:
            SaveError: an earlier save on this saver failed and its handle
                never reported it (this save was not started); or the
                pending save this one waits for is presumed hung.
            InvalidArgument: a bad option, or a closed saver.
            TypeError: a keyword this method does not take (naming the
                likely fix: an option goes in ``options``).
            InvalidURI, BackendUnavailable: as for :func:`dcpstore.save`.
        """
        options = resolve_options(AsyncSaver.save, options, base=_BACKGROUND)
        return self.submit(state_dict, uri, options if options.async_ else dataclasses.replace(options, async_=True))

    def submit(
        self,
        state_dict: dict[str, Any],
        uri: str | os.PathLike[str],
        options: SaveOptions,
        commit_files: Mapping[str, bytes] | None = None,
    ) -> SaveHandle:
        """:meth:`save` with its options as one value (for layers that keep
        one). A sync save (``options.async_`` False: a sync save on an
        engine other than the native one) is not snapshotted where the
        engine writes from this process: its CPU tensors are written as they
        are, so the caller must wait for the handle before changing them.

        Args:
            state_dict, uri: as for :meth:`save`.
            options: everything else, validated.

        Returns:
            The save's handle.

        Raises:
            SaveError, InvalidArgument, InvalidURI, BackendUnavailable: as
            :meth:`save`.
        """
        t0 = time.perf_counter()
        if not isinstance(state_dict, dict):
            raise InvalidArgument(f"state_dict must be a dict, got {type(state_dict).__name__}")
        limit = self.max_in_flight if options.max_in_flight is None else options.max_in_flight
        storage = open_storage(uri, storage_options=options.storage_options)
        workers = check_workers(options.workers, storage.default_workers())
        try:  # until the background job owns the storage, close it on any failure
            choice = select_engine(options.engine, storage)
            with self._lock:
                if self._closed:
                    raise InvalidArgument("this AsyncSaver is closed")
                self._wait_for_slot(limit)
                self._raise_unobserved(f"this save to {storage.uri} was not started")
                self.leftovers.retry_in_background()
                engine = self._engine(choice.name)
                group = self._groups.get(options.process_group)
                t_stage = time.perf_counter()
                staged = self._staging.stage(state_dict, alias_cpu=not options.async_, shared=engine.shared_staging)
                stage_s = time.perf_counter() - t_stage
                blocked_s = time.perf_counter() - t0
                bar = Progress(f"save {storage.uri}", enabled=shows_progress(options.progress, options.process_group))
                job = SaveJob(staged, storage, group, workers, options, bar, dict(commit_files or {}))
                future = self._background.submit(
                    functools.partial(self._run, engine, job, choice.reason, t0, stage_s, blocked_s)
                )
                handle = SaveHandle(
                    future,
                    storage.uri,
                    engine=choice.name,
                    bounded_wait=functools.partial(self._wait_bounded, future),
                    hang_timeout=self.hang_timeout,
                )
                self._pending.append(handle)
        except BaseException:
            storage.close()
            raise
        return handle

    def pending(self) -> int:
        """Saves submitted and not finished yet."""
        with self._lock:
            return sum(not h.done() for h in self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has finished.

        Their handles report success or failure; a failure no handle has
        reported is raised by the next save or by :meth:`close`.

        Args:
            timeout: seconds to wait at most (``None``: no limit).

        Raises:
            TimeoutError: saves are still running after ``timeout`` seconds.
        """
        with self._lock:
            futures = [h._future for h in self._pending]
        _, not_done = wait_futures(futures, timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} async save(s) still running after {timeout} s")

    def close(self) -> None:
        """Finish pending saves, then release the thread, buffers and groups.

        Idempotent. Raises:
            SaveError: a save failed and its handle never reported it (no
                ``result()`` or ``exception()`` call); or a pending save ran
                past ``hang_timeout``: it is abandoned (its daemon thread
                cannot keep the process alive) and the background groups it
                may still use are left alone.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            exit_hook.forget(self)
            hung = self._finish_pending()
            self._staging.clear()
            self._close_engines()
            self.leftovers.finish("at close()")
            if hung:
                raise SaveError(self._hung_message(hung, "close() stopped waiting"))
            self._background.shutdown()
            self._groups.destroy()
            self._raise_unobserved("the saver is closed")

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------
    def _wait_for_slot(self, limit: int) -> None:
        self.pool.max_sets = max(self.pool.max_sets, limit)
        while True:
            self._settle()
            if sum(not h.done() for h in self._pending) < limit:
                return
            # One background thread: the oldest pending save finishes first.
            oldest = next(h for h in self._pending if not h.done())
            if not oldest.wait_bounded():
                raise SaveError(
                    self._hung_message([oldest.uri], "this save was not started (its handle can still be waited on)")
                )

    def _settle(self) -> None:
        """Move finished saves off the pending queue, keeping the failed ones."""
        while self._pending and self._pending[0].done():
            handle = self._pending.popleft()
            if handle.unobserved_failure is not None:
                self._failed.append(handle)

    def _unobserved(self) -> list[tuple[str, BaseException]]:
        """``(uri, error)`` of finished saves whose failure no handle has
        reported, oldest first; each is returned once (and counts as observed
        from then on)."""
        self._settle()
        failed: list[tuple[str, BaseException]] = []
        for handle in self._failed:
            error = handle.unobserved_failure
            if error is not None:
                handle.mark_observed()
                failed.append((handle.uri, error))
        self._failed = []
        return failed

    def _raise_unobserved(self, consequence: str) -> None:
        """Raise the failure of an earlier save that nobody observed (the
        first one; the message names every such URI), chained to it."""
        failed = self._unobserved()
        if failed:
            raise SaveError(unobserved_message(failed, consequence)) from failed[0][1]

    def _wait_bounded(self, future: Future[CheckpointInfo]) -> bool:
        """Wait for ``future`` until it is done (True) or has been running for
        ``hang_timeout`` seconds (False)."""
        while not future.done():
            if self.hang_timeout is None:
                wait_futures([future])
                continue
            started = self._background.started_at(future)
            if started is None:  # queued, or finishing right now: look again shortly
                wait_futures([future], timeout=0.05)
                continue
            left = started + self.hang_timeout - time.monotonic()
            if left <= 0:
                return False
            wait_futures([future], timeout=left)
        return True

    def _finish_pending(self) -> list[str]:
        """Wait for every pending save, oldest first, each bounded by
        ``hang_timeout``; return the URIs of those abandoned as hung."""
        pending = list(self._pending)
        for i, handle in enumerate(pending):
            if not handle.wait_bounded():
                return [h.uri for h in pending[i:] if not h.done()]
        return []

    def _hung_message(self, uris: list[str], consequence: str) -> str:
        return (
            f"async save to {', '.join(uris)} has been running for more than hang_timeout={self.hang_timeout:g} s "
            f"and is presumed hung (a storage call that does not return); {consequence}. Nothing it left "
            "is visible as a checkpoint unless its .metadata was written; 'dcpstore gc ROOT' removes leftovers. "
            "Pass AsyncSaver(hang_timeout=...) for saves that legitimately take longer"
        )

    def finish_at_exit(self) -> None:
        """Interpreter exit: let pending saves finish, but never forever, and
        report every failure no handle reported (the exit status is left
        alone: see docs/usage.md, "Async saves")."""
        if self._closed:
            return
        hung = self._finish_pending()
        if hung:
            log.error("dcpstore: at interpreter exit, %s", self._hung_message(hung, "exit stopped waiting for it"))
        self.leftovers.finish("at interpreter exit")
        with self._lock:
            failed = self._unobserved()
        for uri, error in failed:
            log.error(
                "dcpstore: at interpreter exit: the async save to %s FAILED and nobody asked for its result "
                "(handle.result()); no checkpoint was committed there. %s",
                uri,
                error,
                exc_info=error,
            )
        if not hung:
            self._close_engines()

    def _engine(self, name: str) -> Engine:
        """This saver's instance of engine ``name`` (made on first use)."""
        engine = self._engines.get(name)
        if engine is None:
            engine = self._engines[name] = engine_class(name)(self._collective_timeout)
        return engine

    def _close_engines(self) -> None:
        """Release what each engine keeps between saves (the process
        engine's checkpoint processes stop; a save one still runs fails)."""
        engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.close()

    def _run(
        self, engine: Engine, job: SaveJob, reason: str, t0: float, stage_s: float, blocked_s: float
    ) -> CheckpointInfo:
        """The background half of one save (runs on the saver's thread);
        ``reason``: why ``engine`` runs it."""
        storage = job.storage
        try:
            agree_on_engine(engine.name, job.group)
            stats = engine.save(job)
        except BaseException as e:
            err = with_leftovers(save_error(e, storage.uri, "async save"), storage, self.leftovers)
            log.error("%s%s", rank_label(job.options.process_group), err)
            raise err from e
        finally:
            job.progress.close()
            job.staged.release()
            storage.close()
        info = CheckpointInfo.from_stats(
            storage,
            stats,
            engine.name,
            engine_reason=reason,
            stage_s=stage_s,
            blocked_s=blocked_s,
            total_s=time.perf_counter() - t0,
        )
        log.info("%s%s", rank_label(job.options.process_group), info.describe())
        return info


def unobserved_message(failed: list[tuple[str, BaseException]], consequence: str) -> str:
    """Why a save (or ``close()``) raises an earlier save's failure."""
    uris = ", ".join(uri for uri, _ in failed)
    return (
        f"an earlier async save failed and its handle never reported it (no result() or exception() call): "
        f"{failed[0][1]}; {consequence}. No checkpoint was committed at {uris}. Call result() on each save's "
        "handle to see a failure where it happens"
    )


_default_lock = threading.Lock()
_default_saver: AsyncSaver | None = None


#: :meth:`AsyncSaver.save`'s options when none are given.
_BACKGROUND = SaveOptions(async_=True)


def default_saver() -> AsyncSaver:
    """The per-process saver behind ``dcpstore.save(async_=True)`` (and sync
    saves on the other engines than the native one, and
    :class:`~dcpstore.CheckpointManager`).

    Created on first use; it is a cache (thread, buffers, groups), not a
    setting: every call still chooses its engine, URI and limits itself.
    Keep your own :class:`AsyncSaver` to control its lifetime and limits.
    """
    global _default_saver
    with _default_lock:
        if _default_saver is None or _default_saver._closed:
            _default_saver = AsyncSaver()
        return _default_saver
