"""One connection budget per storage instance: :class:`RequestPool`.

An object store's throughput is per connection: a rank reaches the
network's limit only by keeping enough requests in flight, and it must count
them across *all* of its files -- per file, a rank writing eight files would
open eight times the connections it was tuned for, and one reading a single
file would open too few. So every parallel request a storage makes (the
ranged GETs of every read, the part uploads of every object being written)
runs on that storage's one pool of ``width`` threads
(``StorageOptions.max_concurrency``): at most ``width`` are in flight at
once, whichever files they belong to, and the HTTP client keeps as many
connections (:func:`~dcpstore._impl.storage.concurrency.http_pool_size`).

A part upload holds a slot from the moment it is handed over until it has
finished (:meth:`RequestPool.submit_buffered`), so that a writer producing
parts faster than the network drains them waits instead of buffering: at
most ``width`` parts per storage are in memory, whatever the number of
objects being written.

Jobs never wait on other jobs of the pool, so the pool cannot deadlock; a
call made from one of its own threads runs inline.

Imports nothing of dcpstore's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

_local = threading.local()


class _Skipped(Exception):
    """A job of a :meth:`RequestPool.map` call that did not start because an
    earlier one had failed."""


def _mark_pool_thread() -> None:
    _local.in_pool = True


class RequestPool:
    """``width`` threads for one storage's requests, created on first use.

    Safe to use from several threads at once; a forked child that inherits
    a pool makes its own on first use (threads do not survive a fork).
    """

    def __init__(self, width: int, name: str) -> None:
        self.width = width
        self._name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(width)
        self._pid = 0

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid():
                self._executor = ThreadPoolExecutor(
                    self.width, thread_name_prefix=self._name, initializer=_mark_pool_thread
                )
                self._slots = threading.BoundedSemaphore(self.width)
                self._pid = os.getpid()
            return self._executor

    def map(self, fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]]) -> list[T]:
        """``[fn(*job) for job in jobs]``, run on the pool (in flight with every
        other request of this storage, ``width`` at most).

        On a failure no further job of this call starts; the call returns or
        raises only once none of its jobs is running (they may be filling the
        caller's buffers), raising the failure of the earliest job. One job,
        a pool of one, or a call from a pool thread: runs on the calling
        thread.
        """
        if len(jobs) <= 1 or self.width <= 1 or getattr(_local, "in_pool", False):
            return [fn(*job) for job in jobs]
        failed = threading.Event()

        def guarded(job: tuple[Any, ...]) -> T:
            if failed.is_set():
                raise _Skipped
            try:
                return fn(*job)
            except BaseException:
                failed.set()
                raise

        pool = self._pool()
        futures = [pool.submit(guarded, job) for job in jobs]
        wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None and not isinstance(error, _Skipped):
                raise error
        return [future.result() for future in futures]

    def submit_buffered(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on the pool, once fewer than ``width`` buffered jobs
        of this pool are queued or running (blocks until then). For part
        uploads: ``args`` hold a part's bytes until the job is done."""
        pool = self._pool()
        slots = self._slots
        slots.acquire()
        try:
            future = pool.submit(fn, *args)
        except BaseException:
            slots.release()
            raise
        future.add_done_callback(lambda _: slots.release())
        return future

    def close(self) -> None:
        """Wait for running jobs and stop the threads (a later call starts new ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=True)
