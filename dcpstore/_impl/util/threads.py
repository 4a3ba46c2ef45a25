"""Daemon threads for the writers' per-file work and the async background.

Foundation layer: imports nothing of dcpstore's.

Why not ``concurrent.futures.ThreadPoolExecutor``: its workers are not daemon
threads, and at interpreter exit ``concurrent.futures`` joins every one of
them with no timeout. One storage call that never returns (a hung NFS write,
a stalled FUSE mount, a socket without a timeout) then keeps the process
from ever exiting -- the hang of Megatron-LM #2422. dcpstore's own threads
are daemon threads, so exit is never held hostage by them; how long exit
*waits* for a pending async save is bounded separately
(:class:`~dcpstore._impl.engines.saver.AsyncSaver`'s ``hang_timeout``).

The storage backends' small pools (S3 parts and ranged GETs, MSC reads) stay
``ThreadPoolExecutor``s: every call they make is bounded by the client's
connect/read timeouts and ``op_timeout_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int, name: str) -> list[R]:
    """``[fn(x) for x in items]`` on up to ``workers`` daemon threads.

    Results come back in ``items`` order. Every call runs to its end (as with
    a ``ThreadPoolExecutor`` block); then the first failure, in ``items``
    order, is raised. One item or one worker: runs on the calling thread.
    """
    if len(items) <= 1 or workers <= 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # re-raised on the calling thread
                errors[i] = e

    threads = [threading.Thread(target=work, name=f"{name}_{k}", daemon=True) for k in range(min(workers, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for error in errors:
        if error is not None:
            raise error
    return results


class Beside:
    """``fn(*args)`` on a daemon thread of its own, beside what the caller
    does meanwhile; :meth:`join` waits for it and raises its error, on the
    caller's thread (:meth:`wait` returns it instead)."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # raised by join(), on the caller's thread
            self._error = e

    def wait(self) -> BaseException | None:
        self._thread.join()
        return self._error

    def join(self) -> None:
        error = self.wait()
        if error is not None:
            raise error


class BackgroundThread:
    """One daemon thread running submitted calls in submission order
    (``ThreadPoolExecutor(1)`` without the unbounded join at exit).

    ``started_at(future)`` tells when a call began running (monotonic
    seconds), so callers can bound how long they wait for a call that has
    been running too long.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], R]) -> Future[R]:
        future: Future[R] = Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn))
        return future

    def started_at(self, future: Future[Any]) -> float | None:
        """When ``future``'s call started running; None if it has not (yet)."""
        with self._lock:
            return self._started.get(id(future))

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop after the calls already submitted; False if the thread is
        still running after ``timeout`` seconds (it is a daemon: it cannot
        keep the process alive)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._queue.put(None)
        thread.join(timeout)
        return not thread.is_alive()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._started[id(future)] = time.monotonic()
            try:
                result = fn()
            except BaseException as e:  # the caller sees it through the future
                future.set_exception(e)
            else:
                future.set_result(result)
            finally:
                with self._lock:
                    self._started.pop(id(future), None)
            del future, fn, item  # drop references before blocking on the queue
