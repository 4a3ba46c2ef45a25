"""What a save or a load reports: :class:`SaveStats`, :class:`CheckpointInfo`,
:class:`SaveHandle`, :class:`LoadStats`.

Value objects, with no behaviour beyond a future's: the writers fill a
:class:`SaveStats` per rank, the engines turn it into a
:class:`CheckpointInfo`, and every save -- sync or async, through
:func:`dcpstore.save`, an :class:`~dcpstore.AsyncSaver` or a
:class:`~dcpstore.CheckpointManager` -- returns a :class:`SaveHandle`; the
reader fills a :class:`LoadStats`. ``describe()`` is the one log line of
each (the ``dcpstore`` logger's INFO line per save and load).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from dcpstore._impl.storage import Storage
from dcpstore._impl.util.units import human_bytes


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
    """What one save did, on this rank (``handle.result()`` returns it).

    Attributes:
        uri: the checkpoint, safe to print.
        backend: the storage backend (``"local"``, ``"s3"``, ``"msc"``, ...).
        engine: ``"sync"``, or the engine that ran it (``"native"``,
            ``"nvrx"``, ``"process"``).
        engine_reason: why that engine ran, in words: ``engine='X' was
            passed``, or what ``engine="auto"`` weighed (the storage's kind,
            the cores, CUDA; docs/engines.md) and any fallback; for a sync
            save, that it ran on the caller's thread.
        bytes_written, files: what *this rank* wrote.
        phases: seconds per phase: ``plan`` (DCP planning), ``stage`` (the
            consistent snapshot; 0 for sync saves), ``write`` (data files
            durable), ``commit`` (manifest and ``.metadata``; coordinator only).
        blocked_s: how long the caller's ``save`` call blocked.
        total_s: from the ``save`` call to the commit.
    """

    uri: str
    backend: str
    engine: str
    bytes_written: int
    files: tuple[str, ...]
    phases: dict[str, float] = field(default_factory=dict)
    blocked_s: float = 0.0
    total_s: float = 0.0
    engine_reason: str = ""

    @classmethod
    def from_stats(
        cls,
        storage: Storage,
        stats: SaveStats,
        engine: str,
        *,
        engine_reason: str,
        stage_s: float,
        blocked_s: float,
        total_s: float,
    ) -> CheckpointInfo:
        """The info of a save that wrote ``stats`` to ``storage`` (the engines
        call this; the other arguments are the attributes of the same names)."""
        return cls(
            uri=storage.uri,
            backend=storage.backend,
            engine=engine,
            engine_reason=engine_reason,
            bytes_written=stats.bytes_written,
            files=tuple(stats.files),
            phases={"plan": stats.plan_s, "stage": stage_s, "write": stats.write_s, "commit": stats.commit_s},
            blocked_s=blocked_s,
            total_s=total_s,
        )

    @property
    def write_gbps(self) -> float:
        """This rank's write rate, GB/s (10^9 bytes) over the write phase."""
        return self.bytes_written / self.phases["write"] / 1e9 if self.phases.get("write") else 0.0

    def describe(self) -> str:
        """One line: URI, bytes, rate, phases, backend, engine and why (the
        INFO line of a save)."""
        phases = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in self.phases.items())
        return (
            f"saved {self.uri}: {human_bytes(self.bytes_written)} in {len(self.files)} file(s), {self.write_gbps:.3g} GB/s "
            f"write, {self.total_s:.3g} s in all ({phases}; the caller blocked {self.blocked_s:.3g} s) "
            f"[{self.backend}, {self.engine}: {self.engine_reason}]"
        )


@dataclass(frozen=True)
class LoadStats:
    """What one load read, on this rank: bytes, and seconds per phase
    (``metadata``: the commit files read and checked; ``read``: the data)."""

    bytes_read: int
    metadata_s: float
    read_s: float

    @property
    def read_gbps(self) -> float:
        """This rank's read rate, GB/s (10^9 bytes) over the read phase."""
        return self.bytes_read / self.read_s / 1e9 if self.read_s > 0 else 0.0

    def describe(self, uri: str) -> str:
        """One line: URI, bytes, rate, phases (the INFO line of a load)."""
        return (
            f"loaded {uri}: {human_bytes(self.bytes_read)}, {self.read_gbps:.3g} GB/s read "
            f"(metadata {self.metadata_s:.3g} s, read {self.read_s:.3g} s)"
        )


class SaveHandle:
    """The outcome of a save, shaped like ``concurrent.futures.Future``.

    A background error is raised from :meth:`result` (every call) as a
    :class:`~dcpstore.SaveError` chained to its cause; :meth:`exception`
    returns it. Either call *observes* the outcome. A failure nobody observed
    is not lost: the saver raises it from the next save (and from
    ``close()``), and reports it at interpreter exit.

    Attributes:
        uri: the checkpoint's URI, safe to print.
        engine: the engine that runs the save (``"sync"`` for plain
            synchronous saves, else the engine's name).
        hang_timeout: the saver's ``hang_timeout`` (``None``: a sync save, or
            no bound).

    Args:
        future, uri, engine, bounded_wait, hang_timeout: made by the savers
            (users get handles, they do not build them): the save's future,
            the attributes above, and the saver's bounded wait for
            :meth:`wait_bounded`.
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
        self.hang_timeout = hang_timeout
        self._observed = False

    @classmethod
    def completed(cls, info: CheckpointInfo) -> SaveHandle:
        future: Future[CheckpointInfo] = Future()
        future.set_result(info)
        return cls(future, info.uri, engine=info.engine)

    def done(self) -> bool:
        """Whether the save has finished, committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until the save is committed; re-raise its error if it failed.

        Args:
            timeout: seconds to wait at most (``None``: no limit).

        Returns:
            What the save did on this rank.

        Raises:
            SaveError: the save failed (chained to its cause); raised by
                every call.
            TimeoutError: still running after ``timeout`` seconds (the save
                goes on; call again to keep waiting).
        """
        try:
            result = self._future.result(timeout)
        except FutureTimeoutError as e:
            raise type(e)(f"save to {self.uri} still running after {timeout} s") from None
        except BaseException:
            self._observed = True
            raise
        self._observed = True
        return result

    @property
    def unobserved_failure(self) -> BaseException | None:
        """The save's error if it failed and neither :meth:`result` nor
        :meth:`exception` has reported it yet (else ``None``)."""
        if self._observed or not self._future.done() or self._future.cancelled():
            return None
        return self._future.exception()

    def mark_observed(self) -> None:
        """Record that the outcome has been reported (by the saver, which
        raised or logged an unobserved failure in its place)."""
        self._observed = True

    def wait_bounded(self) -> bool:
        """Wait until the save finishes, either way, or until its saver
        presumes it hung (running longer than ``hang_timeout``). Callers that
        must not block forever (the next save, close, exit) use this instead
        of ``result()``; it does not observe the outcome.

        Returns:
            ``True`` once finished, ``False`` if presumed hung.
        """
        if self._bounded_wait is None:
            wait_futures([self._future])
            return True
        return self._bounded_wait()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait like :meth:`result`, and observe the outcome.

        Args:
            timeout: seconds to wait at most (``None``: no limit).

        Returns:
            The save's error (a :class:`~dcpstore.SaveError`), or ``None`` if
            it committed.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
        """
        error = self._future.exception(timeout)
        self._observed = True
        return error

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(handle)`` when the save finishes (at once if it has), on
        the thread that finishes it. A callback that wants the failure calls
        :meth:`exception`, which observes it."""
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveHandle {self.uri} {self.engine} {state}>"
