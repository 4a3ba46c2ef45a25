"""The public API: :func:`save`, :func:`load`, :class:`SaveHandle`.

*What* is saved is the caller's state dict and DCP's planner; *where* is the
storage a URI names (:mod:`dcpstore.storage`); *how* is the writer
(:mod:`dcpstore.writers`). This module only wires them together per call:
there is no process-global state.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from .errors import CheckpointError, InvalidArgument, LoadError, SaveError
from .options import check_save_options
from .storage import Storage, StorageOptions, open_storage, redact
from .writers.async_engine import ENGINES, AsyncSaver, default_saver
from .writers.dcp import DcpStorageReader, DcpStorageWriter, SaveStats, check_workers
from .writers.state_checks import check_saveable, check_top_level_keys


# DCP warns on every call made without an initialised process group; a
# single-process save is a supported, deliberate use here, so silence that
# one message (only it, matched exactly).
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


@dataclass(frozen=True)
class CheckpointInfo:
    """What one save did, on this rank.

    ``bytes_written`` and ``files`` count what *this rank* wrote. Phase times
    are seconds: ``plan`` (DCP planning), ``stage`` (the consistent snapshot;
    0 for sync saves), ``write`` (data files durable), ``commit`` (manifest
    and ``.metadata``; coordinator only). ``blocked_s`` is how long the
    caller's ``save`` call blocked.
    """

    uri: str
    backend: str
    engine: str
    bytes_written: int
    files: tuple[str, ...]
    phases: dict[str, float] = field(default_factory=dict)
    blocked_s: float = 0.0
    total_s: float = 0.0

    @classmethod
    def from_stats(
        cls, storage: Storage, stats: SaveStats, engine: str, *, stage_s: float, blocked_s: float, total_s: float
    ) -> CheckpointInfo:
        return cls(
            uri=storage.uri,
            backend=storage.backend,
            engine=engine,
            bytes_written=stats.bytes_written,
            files=tuple(stats.files),
            phases={"plan": stats.plan_s, "stage": stage_s, "write": stats.write_s, "commit": stats.commit_s},
            blocked_s=blocked_s,
            total_s=total_s,
        )

    @property
    def write_gbps(self) -> float:
        return self.bytes_written / self.phases["write"] / 1e9 if self.phases.get("write") else 0.0


class SaveHandle:
    """The outcome of :func:`save`, shaped like ``concurrent.futures.Future``.

    A background error is raised from :meth:`result` (every call) as a
    :class:`SaveError` chained to its cause; :meth:`exception` returns it.
    ``engine`` is the engine that runs the save (``"sync"`` for plain
    synchronous saves).
    """

    def __init__(
        self,
        future: Future[CheckpointInfo],
        uri: str,
        *,
        engine: str = "sync",
        bounded_wait: Callable[[], bool] | None = None,
        hang_timeout: float | None = None,
    ) -> None:
        self._future = future
        self.uri = uri
        self.engine = engine
        self._bounded_wait = bounded_wait
        #: The saver's hang_timeout (None: a sync save, or no bound).
        self.hang_timeout = hang_timeout

    @classmethod
    def completed(cls, info: CheckpointInfo) -> SaveHandle:
        future: Future[CheckpointInfo] = Future()
        future.set_result(info)
        return cls(future, info.uri, engine=info.engine)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the save is committed; re-raise its error if it failed.

        ``TimeoutError`` if it is still running after ``timeout`` seconds
        (the save goes on; call again to keep waiting).
        """
        try:
            return self._future.result(timeout)
        except FutureTimeoutError as e:
            raise type(e)(f"save to {self.uri} still running after {timeout} s") from None

    def _wait_bounded(self) -> bool:
        """Wait until the save finishes, either way (True), or until its saver
        presumes it hung (False: running longer than ``hang_timeout``).
        Callers that must not block forever (the next save, close, exit)
        use this instead of ``result()``."""
        if self._bounded_wait is None:
            wait_futures([self._future])
            return True
        return self._bounded_wait()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveHandle {self.uri} {self.engine} {state}>"


def _check_common(workers: int | None, process_group: Any) -> None:
    check_workers(workers, 1)
    if process_group is not None and not dist.is_initialized():
        raise InvalidArgument("process_group was given but torch.distributed is not initialised")


def _no_dist(process_group: Any) -> bool:
    return not (dist.is_available() and dist.is_initialized())


def save(
    state_dict: dict[str, Any],
    uri: str | os.PathLike[str],
    *,
    async_: bool = False,
    workers: int | None = None,
    enable_msc: bool = False,
    engine: str = "auto",
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    storage_options: StorageOptions | None = None,
    max_in_flight: int = 1,
) -> SaveHandle:
    """Save ``state_dict`` to ``uri`` as a DCP checkpoint.

    Every rank calls it with its own shard of the state (SPMD, like
    ``dcp.save``). The checkpoint becomes visible only when its ``.metadata``
    is committed, after every rank's data is durable.

    Sync (default): returns a handle that is already done; errors raise here.

    ``async_=True``: returns once the state is staged (a host-memory copy);
    from then on the caller may mutate its tensors. The write, commit and
    finalize run on a background thread of the per-process default
    :class:`AsyncSaver` (keep your own ``AsyncSaver`` to control its
    lifetime); ``handle.result()`` re-raises a background failure as
    :class:`SaveError`. At most ``max_in_flight`` async saves are pending: a
    new one first waits for the oldest. ``engine`` chooses the async engine:
    ``"native"`` (every backend), ``"nvrx"`` (NVRx's writer; local paths and
    MSC), ``"auto"`` (NVRx where it can, else native with an
    :class:`EngineFallbackWarning` saying why).

    Sync saves use dcpstore's native writer unless ``engine="nvrx"``, which
    runs the NVRx engine and waits for it.
    """
    if not isinstance(state_dict, dict):
        raise InvalidArgument(f"state_dict must be a dict, got {type(state_dict).__name__}")
    # One table decides what save accepts (config layers consult it too).
    check_save_options(async_=async_, engine=engine, workers=workers, planner=planner)
    _check_common(workers, process_group)
    if async_ or engine == "nvrx":
        handle = default_saver().save(
            state_dict,
            uri,
            workers=workers,
            enable_msc=enable_msc,
            engine=engine,
            process_group=process_group,
            planner=planner,
            storage_options=storage_options,
            max_in_flight=max_in_flight,
            _snapshot=async_,
            _stacklevel=2,
        )
        if not async_:
            handle.result()  # sync: raise here, like the native sync path
        return handle
    t0 = time.perf_counter()
    check_saveable(state_dict)  # async saves check while staging
    storage = open_storage(uri, enable_msc=enable_msc, storage_options=storage_options)
    writer = DcpStorageWriter(storage, workers=workers)
    try:
        dcp_save(
            state_dict,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=_no_dist(process_group),
        )
    except CheckpointException as e:
        raise SaveError(f"save to {storage.uri} failed: {_first_failure(e)}") from e
    except CheckpointError as e:
        raise SaveError(f"save to {storage.uri} failed: {e}") from e
    elapsed = time.perf_counter() - t0
    info = CheckpointInfo.from_stats(storage, writer.stats, "sync", stage_s=0.0, blocked_s=elapsed, total_s=elapsed)
    return SaveHandle.completed(info)


def _first_failure(e: CheckpointException) -> str:
    """DCP's CheckpointException maps rank -> exception; summarise it."""
    failures = getattr(e, "failures", None) or {}
    for rank, exc in sorted(failures.items()):
        cause = exc[0] if isinstance(exc, tuple) else exc
        return f"rank {rank}: {type(cause).__name__}: {redact(str(cause))}"
    return str(e)


def load(
    state_dict: dict[str, Any],
    uri: str | os.PathLike[str],
    *,
    workers: int | None = None,
    enable_msc: bool = False,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
    verify: bool = True,
    storage_options: StorageOptions | None = None,
) -> None:
    """Load the checkpoint at ``uri`` into ``state_dict`` in place.

    Like ``dcp.load``: tensors are filled in place and resharded to the
    caller's layout (saved on N ranks, loaded on M). Sizes and checksums are
    verified; a damaged file raises :class:`CheckpointCorrupt` naming it.

    A destination that disagrees with the checkpoint (a stored object where
    it holds a tensor; complex -> real, floating -> integer, anything ->
    bool) raises :class:`StateDictMismatch` before anything is read.
    Missing or truncated files are found before anything is changed too. A
    damaged item stops the load where it is found; the error says which keys
    it had already changed on this rank (its ``loaded_keys``,
    ``partly_loaded_keys`` and ``damaged_keys``; every other key is
    unchanged). Loading a good copy again overwrites every key.
    """
    if not isinstance(state_dict, dict):
        raise InvalidArgument(f"state_dict must be a dict, got {type(state_dict).__name__}")
    _check_common(workers, process_group)
    check_top_level_keys(state_dict, loading=True)
    storage = open_storage(uri, enable_msc=enable_msc, storage_options=storage_options)
    reader = DcpStorageReader(storage, workers=workers, verify=verify)
    reader.check_destination(state_dict)
    try:
        dcp_load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
            no_dist=_no_dist(process_group),
        )
    except CheckpointException as e:
        cause = _root_cause(e)
        if isinstance(cause, CheckpointError):
            error = type(cause)(str(cause))
            vars(error).update(vars(cause))  # e.g. which keys a failed read changed
            raise error from e
        raise LoadError(f"load from {storage.uri} failed: {_first_failure(e)}") from e


def _root_cause(e: CheckpointException) -> BaseException | None:
    failures = getattr(e, "failures", None) or {}
    for _, exc in sorted(failures.items()):
        cause: BaseException = exc[0] if isinstance(exc, tuple) else exc
        return cause
    return None


# Re-exported here so the whole public API lives in one module (DESIGN.md);
# imported last because the manager is built on save/load above.
from .manager import CheckpointManager as CheckpointManager  # noqa: E402
