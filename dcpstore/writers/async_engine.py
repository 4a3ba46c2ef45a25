"""Async saves: stage on the caller's thread, write and commit in the background.

Call order of ``AsyncSaver.save`` (what ``dcpstore.save(..., async_=True)``
runs on a per-process default saver)::

    caller's thread   validate; open the storage; choose the engine
                      wait until fewer than ``max_in_flight`` saves are pending
                      (a new save first finishes the oldest one)
                      first use of a process group: create its background group
                      stage: a consistent host copy (writers/staging.py)
                      submit to the background thread; return a SaveHandle
    background thread plan, write, commit, finalize (the whole DCP save, or
                      NVRx's plan/write/finalize) on the staged copy, then hand
                      the staging buffers back for the next save

There is one background thread per saver, so saves finalize in save order and
every rank runs its background collectives in the same order. It is a daemon
thread (writers/threads.py says why): at interpreter exit the saver waits for
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

Engines: ``native`` (dcpstore's ``DcpStorageWriter``, any backend) and
``nvrx`` (:mod:`dcpstore.writers.nvrx`, POSIX and MSC). ``auto`` picks NVRx
where it is installed and can write the URI, else native with one
:class:`~dcpstore.errors.EngineFallbackWarning` naming why.

State kept by a saver, all bounded: the background thread, the staging-buffer
pool (``staging_cache`` structures x ``max_in_flight`` buffer sets), one
background group per process group used, and one NVRx metadata cache per
background group (for the structure saved last). ``close()`` releases them.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit hook before ours: see _finish_all_at_exit)
import functools
import logging
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Hashable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner

from ..adapters import nvrx as nvrx_adapter
from ..errors import CheckpointError, EngineFallbackWarning, InvalidArgument, SaveError
from ..storage import Storage, StorageOptions, open_storage, redact
from ..storage.secrets import scrub
from .dcp import DcpStorageWriter, SaveStats, check_workers, default_workers
from .staging import StagedState, Stager, StagingPool
from .threads import BackgroundThread

if TYPE_CHECKING:
    from ..api import CheckpointInfo, SaveHandle

log = logging.getLogger(__name__)

ENGINES = ("auto", "native", "nvrx")


def select_engine(engine: str, storage: Storage, *, stacklevel: int = 2) -> str:
    """Resolve ``engine`` for ``storage`` to ``"native"`` or ``"nvrx"``.

    Explicit choices are honoured or refused with the reason; ``"auto"``
    falls back to native with one warning that says why. Never silently.
    """
    if engine not in ENGINES:
        raise InvalidArgument(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "native":
        return "native"
    if engine == "nvrx":
        nvrx_adapter.require()
        nvrx_adapter.check_target(storage)
        return "nvrx"
    reason = nvrx_adapter.import_error()
    if reason is None:
        target = nvrx_adapter.target_for(storage)
        if not isinstance(target, str):
            return "nvrx"
        reason = target
    warnings.warn(
        f"engine='auto' uses dcpstore's native async engine: {reason} "
        "(pass engine='native' to choose it explicitly)",
        EngineFallbackWarning,
        stacklevel=stacklevel + 1,
    )
    return "native"


def native_save(
    state_dict: dict[str, Any],
    storage: Storage,
    *,
    workers: int,
    process_group: dist.ProcessGroup | None,
    planner: SavePlanner | None,
) -> SaveStats:
    """The native engine: the whole DCP save with dcpstore's writer."""
    writer = DcpStorageWriter(storage, workers=workers)
    try:
        dcp_save(
            state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=process_group is None,
        )
    except BaseException:
        writer.release()  # e.g. another rank failed: gc may collect what this save left
        raise
    return writer.stats


class _BackgroundGroups:
    """One dedicated gloo group per process group (see the module docstring)."""

    def __init__(self, timeout: timedelta | None) -> None:
        self.timeout = timeout
        # key -> (default group it belongs to, the user's group, our group)
        self._groups: dict[int, tuple[Any, Any, dist.ProcessGroup]] = {}

    def get(self, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        default = dist.distributed_c10d._get_default_group()
        # After destroy_process_group() + a new init, the old groups are dead.
        self._groups = {k: v for k, v in self._groups.items() if v[0] is default}
        key = id(process_group) if process_group is not None else 0
        entry = self._groups.get(key)
        if entry is None or entry[1] is not process_group:
            ranks = dist.get_process_group_ranks(process_group or default)
            group = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=self.timeout,
                use_local_synchronization=True,
                group_desc="dcpstore_async_save",
            )
            entry = (default, process_group, group)
            self._groups[key] = entry
        return entry[2]

    def destroy(self) -> None:
        groups, self._groups = self._groups, {}
        if not (dist.is_available() and dist.is_initialized()):
            return
        default = dist.distributed_c10d._get_default_group()
        for owner, _, group in groups.values():
            if owner is default:
                dist.destroy_process_group(group)


class AsyncSaver:
    """Runs async saves: stages on the caller's thread, writes in the background.

    Keep one per training job (``dcpstore.save(async_=True)`` uses a
    per-process default one) so staging buffers, background groups and NVRx
    plan caches are reused across saves::

        saver = dcpstore.AsyncSaver(max_in_flight=1)
        h = saver.save(model.state_dict(), "s3://b/run/step100", engine="native")
        ...            # training continues; may mutate the tensors
        h.result()     # CheckpointInfo, or raises SaveError
        saver.close()

    ``max_in_flight``: saves allowed to be pending at once; a new save first
    waits for the oldest (default 1: each save finishes the previous one).
    ``staging_cache``: how many state-dict structures keep their staging
    buffers between saves (0: allocate every time).
    ``collective_timeout``: timeout of the background process groups.
    ``hang_timeout``: seconds a background save may run before it is
    presumed hung (default 1800; ``None``: never). Past it, a new ``save``
    no longer waits for it but raises :class:`SaveError`, ``close()`` stops
    waiting and raises, and interpreter exit stops waiting and logs an error
    naming the URI (the process then exits; nothing hangs forever --
    Megatron-LM #2422). Raise it for saves that legitimately take longer.
    ``handle.result(timeout=...)`` bounds a single wait independently.
    """

    def __init__(
        self,
        *,
        max_in_flight: int = 1,
        staging_cache: int = 2,
        collective_timeout: timedelta | float | None = None,
        hang_timeout: float | None = 1800.0,
    ) -> None:
        self.max_in_flight = _check_positive("max_in_flight", max_in_flight)
        if hang_timeout is not None and (
            isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float)) or not hang_timeout > 0
        ):
            raise InvalidArgument(f"hang_timeout must be None or a positive number of seconds, got {hang_timeout!r}")
        self.hang_timeout = hang_timeout
        if isinstance(staging_cache, bool) or not isinstance(staging_cache, int) or staging_cache < 0:
            raise InvalidArgument(f"staging_cache must be an int >= 0, got {staging_cache!r}")
        if isinstance(collective_timeout, (int, float)):
            collective_timeout = timedelta(seconds=collective_timeout)
        self.pool = StagingPool(max_structures=staging_cache, max_sets=self.max_in_flight)
        self._stager = Stager(self.pool)
        self._groups = _BackgroundGroups(collective_timeout)
        # id(background group) -> (structure key of the last NVRx save, its cache)
        self._nvrx_caches: dict[int, tuple[Hashable, Any]] = {}
        # (future, printable URI) of every save not yet popped, oldest first
        self._pending: deque[tuple[Future[CheckpointInfo], str]] = deque()
        self._background = BackgroundThread("dcpstore-async")
        self._lock = threading.RLock()
        self._closed = False
        _LIVE.add(self)

    # -- public ---------------------------------------------------------------
    def save(
        self,
        state_dict: dict[str, Any],
        uri: str | os.PathLike[str],
        *,
        workers: int | None = None,
        enable_msc: bool = False,
        engine: str = "auto",
        process_group: dist.ProcessGroup | None = None,
        planner: SavePlanner | None = None,
        storage_options: StorageOptions | None = None,
        max_in_flight: int | None = None,
        _snapshot: bool = True,
        _stacklevel: int = 1,
    ) -> SaveHandle:
        """Stage ``state_dict`` and save it to ``uri`` in the background.

        Returns once the snapshot is taken. Arguments as :func:`dcpstore.save`;
        ``max_in_flight`` overrides the saver's limit for this call.
        """
        t0 = time.perf_counter()
        if not isinstance(state_dict, dict):
            raise InvalidArgument(f"state_dict must be a dict, got {type(state_dict).__name__}")
        limit = self.max_in_flight if max_in_flight is None else _check_positive("max_in_flight", max_in_flight)
        workers = check_workers(workers, default_workers())
        storage = open_storage(uri, enable_msc=enable_msc, storage_options=storage_options)
        try:  # until the background job owns the storage, close it on any failure
            name = select_engine(engine, storage, stacklevel=_stacklevel + 1)
            with self._lock:
                if self._closed:
                    raise InvalidArgument("this AsyncSaver is closed")
                self._wait_for_slot(limit)
                group = self._groups.get(process_group)
                t_stage = time.perf_counter()
                staged = self._stager.stage(state_dict, alias_cpu=not _snapshot)
                stage_s = time.perf_counter() - t_stage
                blocked_s = time.perf_counter() - t0
                job = functools.partial(
                    self._run, name, staged, storage, group, workers, planner, t0, stage_s, blocked_s
                )
                future = self._background.submit(job)
                self._pending.append((future, storage.uri))
        except BaseException:
            storage.close()
            raise
        from ..api import SaveHandle

        return SaveHandle(
            future,
            storage.uri,
            engine=name,
            bounded_wait=functools.partial(self._wait_bounded, future),
            hang_timeout=self.hang_timeout,
        )

    def pending(self) -> int:
        """Saves submitted and not finished yet."""
        with self._lock:
            return sum(not f.done() for f, _ in self._pending)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save has finished (their handles report
        success or failure); raise ``TimeoutError`` after ``timeout`` seconds."""
        with self._lock:
            futures = [f for f, _ in self._pending]
        _, not_done = wait_futures(futures, timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} async save(s) still running after {timeout} s")

    def close(self) -> None:
        """Finish pending saves, then release the thread, buffers and groups.

        Raises :class:`SaveError` if a pending save runs past ``hang_timeout``:
        it is abandoned (its daemon thread cannot keep the process alive) and
        the background groups it may still use are left alone.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _LIVE.discard(self)
            hung = self._finish_pending()
            self.pool.clear()
            self._nvrx_caches.clear()
            if hung:
                raise SaveError(self._hung_message(hung, "close() stopped waiting"))
            self._background.shutdown()
            self._groups.destroy()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------
    def _wait_for_slot(self, limit: int) -> None:
        self.pool.max_sets = max(self.pool.max_sets, limit)
        while True:
            while self._pending and self._pending[0][0].done():
                self._pending.popleft()
            if sum(not f.done() for f, _ in self._pending) < limit:
                return
            # One background thread: the oldest pending save finishes first.
            oldest = next(p for p in self._pending if not p[0].done())
            if not self._wait_bounded(oldest[0]):
                raise SaveError(
                    self._hung_message([oldest[1]], "this save was not started (its handle can still be waited on)")
                )

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
        for i, (future, _) in enumerate(pending):
            if not self._wait_bounded(future):
                return [uri for f, uri in pending[i:] if not f.done()]
        return []

    def _hung_message(self, uris: list[str], consequence: str) -> str:
        return (
            f"async save to {', '.join(uris)} has been running for more than hang_timeout={self.hang_timeout:g} s "
            f"and is presumed hung (a storage call that does not return); {consequence}. Nothing it left "
            "is visible as a checkpoint unless its .metadata was written; 'dcpstore gc ROOT' removes leftovers. "
            "Pass AsyncSaver(hang_timeout=...) for saves that legitimately take longer"
        )

    def _finish_at_exit(self) -> None:
        """Interpreter exit: let pending saves finish, but never forever."""
        if self._closed:
            return
        hung = self._finish_pending()
        if hung:
            log.error("dcpstore: at interpreter exit, %s", self._hung_message(hung, "exit stopped waiting for it"))

    def _run(
        self,
        engine: str,
        staged: StagedState,
        storage: Storage,
        group: dist.ProcessGroup | None,
        workers: int,
        planner: SavePlanner | None,
        t0: float,
        stage_s: float,
        blocked_s: float,
    ) -> CheckpointInfo:
        """The background half of one save (runs on the saver's thread)."""
        from ..api import CheckpointInfo

        try:
            _agree_on_engine(engine, group)
            if engine == "nvrx":
                from .nvrx import nvrx_save

                # A user planner may plan differently per call: never cache its plans.
                cache = self._nvrx_cache(staged.key, group) if planner is None else None
                try:
                    stats = nvrx_save(
                        staged.state_dict, storage, workers=workers, process_group=group, planner=planner, cache=cache
                    )
                except BaseException:
                    self._nvrx_caches.pop(id(group), None)  # every rank fails together: re-plan next time
                    raise
            else:
                stats = native_save(staged.state_dict, storage, workers=workers, process_group=group, planner=planner)
        except BaseException as e:
            err = _as_save_error(e, storage)
            log.error("%s", err)
            raise err from e
        finally:
            staged.release()
            storage.close()
        return CheckpointInfo.from_stats(
            storage, stats, engine, stage_s=stage_s, blocked_s=blocked_s, total_s=time.perf_counter() - t0
        )

    def _nvrx_cache(self, key: Hashable, group: dist.ProcessGroup | None) -> Any | None:
        """NVRx's metadata cache for this save, kept in lockstep across ranks.

        NVRx decides *locally* whether to skip the plan exchange (its cache is
        "validated" once two consecutive plans are equal); if ranks disagreed,
        some would skip a collective the others enter, and hang. So the cache
        is reused only when every rank saves the same structure as in its
        previous NVRx save on this group *and* every rank's cache is in the
        same state; otherwise every rank starts a fresh one. One 3-int
        all-reduce on the background group decides. Single-process saves
        plan locally and need no cache.
        """
        if group is None:
            return None
        fresh = nvrx_adapter.new_metadata_cache()
        if fresh is None:
            return None
        last = self._nvrx_caches.get(id(group))
        same = last is not None and last[0] == key
        validated = int(bool(getattr(last[1], "validated_cache_reuse", False))) if same and last else 0
        votes = torch.tensor([int(same), validated, -validated], dtype=torch.int32)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
        all_same, min_validated, max_validated = int(votes[0]), int(votes[1]), -int(votes[2])
        if not all_same or min_validated != max_validated or last is None:
            last = (key, fresh)
            self._nvrx_caches[id(group)] = last
        return last[1]


def _agree_on_engine(engine: str, group: dist.ProcessGroup | None) -> None:
    """Every rank must run the same engine (their collectives differ): with
    engine="auto" a node without NVRx would otherwise pick native and hang
    the others. One tiny all-reduce on the background group checks it."""
    if group is None:
        return
    code = ENGINES.index(engine)
    votes = torch.tensor([code, -code], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    if int(votes[0]) != -int(votes[1]):
        raise SaveError(
            f"ranks chose different async engines (this one: {engine!r}); pass the same explicit "
            "engine= on every rank, or install nvidia-resiliency-ext on every node"
        )


def _as_save_error(e: BaseException, storage: Storage) -> SaveError:
    if isinstance(e, SaveError):
        return SaveError(str(e))
    if isinstance(e, CheckpointException):
        from ..api import _first_failure

        return SaveError(f"async save to {storage.uri} failed: {_first_failure(e)}")
    if isinstance(e, CheckpointError):
        return SaveError(f"async save to {storage.uri} failed: {e}")
    return SaveError(f"async save to {storage.uri} failed: {type(e).__name__}: {scrub(redact(str(e)))}")


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
    return value


#: Savers not closed yet; at interpreter exit each gets to finish its saves.
_LIVE: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


def _finish_all_at_exit() -> None:
    """Runs among threading's exit callbacks (newest first), so before
    ``concurrent.futures``' own, registered when it was imported: the S3
    backend's part pool still accepts work while a last save finishes."""
    for saver in list(_LIVE):
        saver._finish_at_exit()


try:
    threading._register_atexit(_finish_all_at_exit)  # type: ignore[attr-defined]
except RuntimeError:  # imported while the interpreter is already shutting down
    atexit.register(_finish_all_at_exit)

_default_lock = threading.Lock()
_default_saver: AsyncSaver | None = None


def default_saver() -> AsyncSaver:
    """The per-process saver behind ``dcpstore.save(async_=True)``.

    Created on first use; it is a cache (thread, buffers, groups), not a
    setting: every call still chooses its engine, URI and limits itself.
    """
    global _default_saver
    with _default_lock:
        if _default_saver is None or _default_saver._closed:
            _default_saver = AsyncSaver()
        return _default_saver
