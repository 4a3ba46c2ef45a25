"""How many requests a storage keeps in flight: HTTP connections per
object-store client (:func:`http_pool_size`) and threads per local disk
(:func:`disk_workers`)."""

from __future__ import annotations

import os

#: Connections beyond the request pool: the writer and reader threads make
#: their own small requests (start and complete an upload, a HEAD, a
#: one-range GET) beside the pool's, one at a time each.
CALLER_CONNECTIONS = 16


def http_pool_size(max_concurrency: int) -> int:
    """Connections an object-store client keeps open for a storage whose
    request pool is ``max_concurrency`` wide (see :mod:`.request_pool`): one per pool
    thread, plus :data:`CALLER_CONNECTIONS` for the callers' own requests.
    Fewer would make a request wait for a connection, or open and drop one
    (urllib3 discards connections beyond its pool)."""
    return max_concurrency + CALLER_CONNECTIONS


def disk_workers() -> int:
    """Writer/reader threads per rank on a local (or locally mounted) disk:
    one per CPU, between 2 and 8. A disk's throughput grows with the requests
    queued at it and every thread also copies and checksums, so the CPUs
    are the parallelism; beyond 8 the queue is deep enough for an NVMe
    drive and more files only add fsyncs."""
    return max(2, min(8, os.cpu_count() or 1))
