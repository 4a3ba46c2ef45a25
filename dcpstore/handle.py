"""What a save reports: :class:`SaveStats`, :class:`CheckpointInfo`, :class:`SaveHandle`.

Value objects, with no behaviour beyond a future's: the writers fill a
:class:`SaveStats` per rank, the engines turn it into a
:class:`CheckpointInfo`, and every save -- sync or async, through
:func:`dcpstore.save`, an :class:`~dcpstore.AsyncSaver` or a
:class:`~dcpstore.CheckpointManager` -- returns a :class:`SaveHandle`.

Layer: value objects. Imports only :mod:`dcpstore.storage` (for the
:class:`Storage` a :class:`CheckpointInfo` describes).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from .storage import Storage


@dataclass
class SaveStats:
    """Phase timings and volume of one save on this rank (seconds, bytes),
    filled in by the writer as the save goes."""

    plan_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    bytes_written: int = 0
    files: list[str] = field(default_factory=list)
    #: When the save started (``time.perf_counter()``), for ``plan_s``.
    started: float = 0.0


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
    """The outcome of a save, shaped like ``concurrent.futures.Future``.

    A background error is raised from :meth:`result` (every call) as a
    :class:`~dcpstore.SaveError` chained to its cause; :meth:`exception`
    returns it. ``engine`` is the engine that runs the save (``"sync"`` for
    plain synchronous saves).
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

    def wait_bounded(self) -> bool:
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
