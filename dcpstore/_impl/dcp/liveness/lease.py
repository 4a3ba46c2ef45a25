"""A writer's proof of life in one directory: :class:`Lease`, the one writer
of alive files (:mod:`dcpstore._impl.dcp.liveness.alive_file` is their format and the rule
``gc`` keeps by), and :func:`mark`, a lease and then the in-flight marker.

Every writer that puts files into a checkpoint directory holds a lease
there, taken *before* its first file and ended after its last:

    save (coordinator)      SaveSession.claim .. publish / release
    tiered, before a save   the local step directory, from the marker put
                            before the save (overwrite, node-local leaders)
                            until the node's copy is committed or the save fails
    tiered replication      the durable step directory, on every rank: from
                            before its first upload until the replica is
                            committed (the coordinator commits and removes
                            every alive file; the other ranks' leases
                            :meth:`~Lease.linger` until they see that commit)

Taking the lease writes the alive file at once (an error raises: the writer
must not start). A daemon thread rewrites it every
:data:`~dcpstore._impl.dcp.liveness.alive_file.REFRESH_S` until :meth:`Lease.stop`, until
the storage object is gone, or -- a save's lease -- until the directory's
in-flight marker names another save (it took the URI over; a marker that is
missing is the save's to judge, see
:meth:`~dcpstore._impl.dcp.commit.session.SaveSession.check_owner`).
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import threading
import time
import weakref
from collections.abc import Callable

from dcpstore._impl.dcp.liveness import alive_file
from dcpstore._impl.dcp.liveness.alive_file import Owner, alive_name, encode_alive
from dcpstore._impl.dcp.liveness.inflight_marker import put_marker, read_marker
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import CheckpointError

log = logging.getLogger(__name__)


class Lease:
    """An alive file in ``directory`` of ``storage`` (``""``: its root),
    named by ``lease_id`` (default: a fresh random one), refreshed on a
    daemon thread until :meth:`stop`.

    ``save_id``: the lease of that save: refreshing stops once the
    directory's in-flight marker names another save. ``durable=False``: the
    file is written without fsyncs (the caller's training thread waits for
    it, and losing it in a crash loses nothing).
    """

    def __init__(
        self,
        storage: Storage,
        directory: str = "",
        lease_id: str | None = None,
        *,
        save_id: str | None = None,
        durable: bool = True,
    ) -> None:
        self.lease_id = lease_id or os.urandom(8).hex()
        self.path = posixpath.join(directory, alive_name(self.lease_id)) if directory else alive_name(self.lease_id)
        self._directory = directory
        self._storage = weakref.ref(storage)
        self._uri = storage.uri
        self._save_id = save_id
        self._durable = durable
        self._blob = encode_alive(save_id or self.lease_id, Owner.current())
        self._stopped = threading.Event()
        #: Lingering (:meth:`linger`): until this says the work is taken over, or the deadline.
        self._until: Callable[[], bool] | None = None
        self._deadline = 0.0
        self._lock = threading.Lock()
        storage.put(self.path, self._blob, durable=durable)  # before anything else of the writer's
        self._thread = threading.Thread(target=self._run, name="dcpstore-alive", daemon=True)
        self._thread.start()

    def linger(self, until: Callable[[], bool], deadline: float) -> None:
        """The holder's own writes are done, but its files need the lease
        until another writer takes them over (the coordinator's commit of a
        replica): keep refreshing until ``until()`` says so or ``deadline``
        (``time.monotonic()``) passes, then remove the file. :meth:`stop`
        still ends it at once."""
        with self._lock:
            self._until, self._deadline = until, deadline

    def settle(self, poll_s: float = 0.05, poll_max_s: float = 1.0) -> None:
        """Wait until a lingering lease is done (what it waits for happened,
        or its deadline passed; polled, backing off from ``poll_s`` to
        ``poll_max_s``), then :meth:`stop` it. A lease that does not
        linger is stopped at once."""
        pause = poll_s
        while self.running and self._until is not None and not self._done_lingering():
            time.sleep(pause)
            pause = min(poll_max_s, pause * 2)
        self.stop()

    def stop(self, *, remove: bool = True) -> CheckpointError | None:
        """Stop refreshing; returns once no refresh is under way (so none
        lands after the file is removed). ``remove``: remove the alive file;
        if that fails, the error is returned and the removal left with the
        storage (``Storage.leave_unfinished``) for the owner to try again.
        Idempotent."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        return self._remove() if remove else None

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _remove(self) -> CheckpointError | None:
        storage = self._storage()
        if storage is None:
            return None
        try:
            storage.delete([self.path])
        except CheckpointError as e:  # the storage does not answer: left for the writer's owner to try again
            log.debug("could not remove the alive file %s: %s", storage.describe(self.path), e)
            storage.leave_unfinished(
                f"remove the alive file {storage.describe(self.path)}", functools.partial(storage.delete, [self.path])
            )
            return e
        return None

    def _taken_over(self, storage: Storage) -> bool:
        """A save's lease: whether the directory's marker names another save."""
        if self._save_id is None:
            return False
        owner = read_marker(storage, self._directory)
        # None: removed (gc, by hand): the save itself decides what that means
        return owner is not None and owner != self._save_id

    def _done_lingering(self) -> bool:
        with self._lock:
            until, deadline = self._until, self._deadline
        if until is None:
            return False
        try:
            return until() or time.monotonic() >= deadline
        except CheckpointError as e:
            log.debug("could not tell whether %s is taken over: %s", self._uri, e)
            return time.monotonic() >= deadline

    def _run(self) -> None:
        while not self._stopped.wait(alive_file.REFRESH_S):
            storage = self._storage()
            if storage is None:
                return
            try:
                if self._taken_over(storage):
                    return  # this save will not commit; its release removes the file
                if self._done_lingering():
                    self._stopped.set()
                    self._remove()
                    return
                if not self._stopped.is_set():
                    storage.put(self.path, self._blob, durable=self._durable)
                if self._done_lingering():  # taken over while we wrote: the taker may have removed it before
                    self._stopped.set()
                    self._remove()
                    return
            except CheckpointError as e:
                log.debug("could not refresh the alive file %s: %s", storage.describe(self.path), e)
            finally:
                del storage


def mark(
    storage: Storage, save_id: str, directory: str = "", *, lease_id: str | None = None, durable: bool = True
) -> Lease:
    """Claim ``directory`` for the save ``save_id``: its lease (the alive file
    first, so that any listing showing the marker shows it too), then the
    in-flight marker holding ``save_id``. Returns the lease, which the
    caller ends once the directory's copy is committed or the save failed;
    should the marker not land, it is ended here and the error raised.
    ``lease_id``: the alive file's name (default: a fresh random one);
    ``durable=False``: neither file is fsynced."""
    lease = Lease(storage, directory, lease_id, save_id=save_id, durable=durable)
    try:
        put_marker(storage, save_id, directory, durable=durable)
    except BaseException:
        lease.stop()
        raise
    return lease
