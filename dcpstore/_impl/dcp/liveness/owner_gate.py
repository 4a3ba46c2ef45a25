"""One ownership check for the data files a rank writes side by side.

A writer must not publish a data file once a later save has taken the URI
over (:meth:`~dcpstore._impl.dcp.commit.SaveSession.check_owner`). Checking before
each file costs one read of the in-flight marker per file: ``workers``
requests per rank per save, on one key shared by every rank of the job (at
scale, the busiest key of a save). A rank's files are written by threads
that all run at once, so one check serves them all, and is no weaker than
one per file, when it is made after *every* file is ready to publish and
before *any* is: each file's publication still follows a check made after
that file was written. :class:`OwnerGate` is that meeting point::

    every file's thread   gate.wait()   when its file is ready to publish:
                              returns once every thread arrived and the one
                              check (run by the last to arrive) passed;
                              raises if it failed
    a failing thread      gate.abort(e)  instead, when it cannot get there:
                              the waiting threads raise at once (a
                              :class:`SaveError` caused by ``e``, so that
                              whichever file's error the writer reports
                              names the cause) and publish nothing

Every party must run on its own thread at the same time (a party that waits
for a thread slot would never arrive): :func:`run_gated` creates the gate
and the threads together, and aborts the gate for a call that raises.

The same argument carries from a rank's threads to a job's ranks: one check
made after *every* rank's files are ready to publish, and before any rank
publishes one, keeps that order for every file of the save, and reads the
marker once per save instead of once per rank (at 16,384 ranks, 16,384
reads of one key in the write phase's last moments, several times S3's
5,500 GET/s per prefix). :func:`run_shared_gated` is that gate with the
check swapped for an exchange among the ranks (the writer's: ranks report
ready, the coordinator checks, every rank learns the outcome) made on the
calling thread, where the job's collectives belong.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from dcpstore._impl.util.errors import SaveError
from dcpstore._impl.util.threads import run_parallel

T = TypeVar("T")
R = TypeVar("R")


class OwnerGate:
    """``check`` (a session's ``check_owner``) once for ``parties`` threads."""

    def __init__(self, check: Callable[[], None], parties: int) -> None:
        self._check = check
        self._error: BaseException | None = None
        self._checker: int | None = None
        self._aborted: BaseException | None = None
        self._barrier = threading.Barrier(max(1, parties), action=self._run)

    def _run(self) -> None:
        self._checker = threading.get_ident()
        try:
            self._check()
        except BaseException as e:  # raised by every party, below
            self._error = e

    def wait(self) -> None:
        """Block until every party is ready, then raise if the check failed
        (the thread that made it raises its exception; the others a
        :class:`SaveError` caused by it) or if a party aborted."""
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            cause = self._aborted
            raise SaveError(f"not published: another data file of this rank's save failed: {cause}") from cause
        error = self._error
        if error is None:
            return
        if threading.get_ident() == self._checker:
            raise error
        raise SaveError(f"not published: {error}") from error

    def abort(self, cause: BaseException) -> None:
        """This party will not arrive (``cause``): release the others; they
        raise. The first cause is kept."""
        if self._aborted is None:
            self._aborted = cause
        self._barrier.abort()


def run_gated(check: Callable[[], None], work: Callable[[T, OwnerGate], R], items: Sequence[T], name: str) -> list[R]:
    """``[work(x, gate) for x in items]``, each on its own thread, with one
    gate over ``check`` for all of them: ``work`` calls ``gate.wait()`` when
    its file is ready to publish; a call that raises before that aborts the
    gate, so the others raise instead of waiting for it."""
    gate = OwnerGate(check, len(items))

    def one(item: T) -> R:
        try:
            return work(item, gate)
        except BaseException as e:
            gate.abort(e)
            raise

    return run_parallel(one, items, len(items), name)


def run_shared_gated(
    exchange: Callable[[bool], BaseException | None],
    work: Callable[[T, OwnerGate], R],
    items: Sequence[T],
    name: str,
) -> list[R]:
    """:func:`run_gated` with the check made by the ranks together:
    ``exchange(ready)`` runs on the calling thread exactly once, with
    ``ready`` True once every item's ``gate.wait()`` was reached, False when
    one failed before (or there was nothing to write), so that a rank that
    fails still joins the exchange and no other rank waits for it forever.
    It returns the check's failure (None: the URI is still this save's),
    which the waiting threads raise as :class:`OwnerGate` does."""
    settled = threading.Event()
    ready = threading.Event()
    released = threading.Event()
    outcome: list[BaseException | None] = []
    done: list[list[R]] = []
    failed: list[BaseException] = []

    def check() -> None:  # the gate's one check: on the last thread to arrive
        ready.set()
        settled.set()
        released.wait()
        if outcome[0] is not None:
            raise outcome[0]

    def run() -> None:
        try:
            done.append(run_gated(check, work, items, name))
        except BaseException as e:  # re-raised on the calling thread
            failed.append(e)
        finally:
            settled.set()

    runner = threading.Thread(target=run, name=f"{name}-gated", daemon=True)
    runner.start()
    settled.wait()
    try:
        outcome.append(exchange(ready.is_set()))
    except BaseException as e:
        outcome.append(e)
    released.set()
    runner.join()
    if failed:
        raise failed[0]
    return done[0]
