"""The leases a tiered manager holds (:mod:`dcpstore._impl.dcp.liveness.lease`) and the
clean-ups its replication could not do, kept between jobs.

* a marker's lease per step: from the in-flight marker put in a local step
  directory before a save (an overwrite of a replicated step; a node
  leader's) until that directory's copy is committed or the save failed;
* other ranks' replica leases, lingering until the coordinator's commit
  (``close()`` waits for them: :meth:`~dcpstore._impl.dcp.liveness.lease.Lease.settle`);
* what a failed replication left undone (:mod:`dcpstore._impl.dcp.liveness.retried_cleanups`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from dcpstore._impl.dcp.liveness import Lease
from dcpstore._impl.dcp.liveness.retried_cleanups import Leftovers
from dcpstore._impl.storage import Storage


class TierLeases:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._markers: dict[int, Lease] = {}
        self._lingering: list[Lease] = []
        self.leftovers = Leftovers()

    def hold_marker(self, step: int, lease: Lease) -> None:
        with self._lock:
            old = self._markers.pop(step, None)
            self._markers[step] = lease
        if old is not None:
            old.stop()

    def end_marker(self, step: int) -> None:
        """The local step directory's copy is committed (or its save failed)."""
        with self._lock:
            lease = self._markers.pop(step, None)
        if lease is not None:
            lease.stop()

    def linger(self, lease: Lease) -> None:
        with self._lock:
            self._lingering = [held for held in self._lingering if held.running] + [lease]

    def keep_unfinished(self, storages: Iterable[Storage]) -> None:
        for storage in storages:
            self.leftovers.keep(storage.uri, storage.take_unfinished())

    def close(self, storages: Iterable[Storage]) -> None:
        """End the markers' leases, wait for the lingering ones, try the
        unfinished clean-ups once more."""
        with self._lock:
            markers, lingering = list(self._markers.values()), self._lingering
            self._markers, self._lingering = {}, []
        for lease in markers:
            lease.stop()
        for lease in lingering:  # another rank's uploads: theirs until the coordinator commits them
            lease.settle()
        self.keep_unfinished(storages)
        self.leftovers.finish("at close() of the tiered manager")
