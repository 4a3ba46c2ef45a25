"""Clean-ups a failed save could not do, kept by its saver and tried again.

A save that fails because the endpoint is down cannot abort its open
multipart uploads or remove its alive file either: the storage records
each such clean-up (:meth:`~dcpstore._impl.storage.base.Storage.leave_unfinished`)
and the saver that ran the save keeps them here. They are tried again at
the saver's next save (in the background: a save to another storage does
not wait for a dead endpoint), at ``close()`` and at interpreter exit (both
waiting for the attempt, bounded by the storage's own timeouts); each is
forgotten once it succeeds. What is still left when the process ends,
``dcpstore gc`` removes: the alive file stops being refreshed when the save
fails, so after the lease it no longer keeps the directory
(:mod:`dcpstore._impl.dcp.liveness.alive_file`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from dcpstore._impl.storage import Storage
from dcpstore._impl.storage.incomplete import Unfinished
from dcpstore._impl.util.errors import CheckpointError, SaveError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Kept:
    uri: str
    item: Unfinished


def what_happens(uri: str, items: Sequence[Unfinished]) -> str:
    """The sentence a failed save's error ends with when its clean-up failed too."""
    shown = "; ".join(i.what for i in items[:3]) + ("; ..." if len(items) > 3 else "")
    return (
        f". Its clean-up failed as well ({len(items)} step(s): {shown}): this saver tries again at its next "
        f"save, at close() and at exit, once the storage answers; what is left after that, 'dcpstore gc {uri}' "
        "removes (the save's alive file is no longer refreshed, so gc takes it once it is older than "
        "--older-than and two minutes)"
    )


def with_leftovers(error: CheckpointError, storage: Storage, leftovers: Leftovers) -> CheckpointError:
    """After a save to ``storage`` failed with ``error``: keep the clean-ups
    the storage could not do in ``leftovers``, and say so in the error (of
    the same class where its constructor takes just the message, else a
    :class:`SaveError`)."""
    items = storage.take_unfinished()
    if not items:
        return error
    leftovers.keep(storage.uri, items)
    message = str(error) + what_happens(storage.uri, items)
    try:
        return type(error)(message)
    except TypeError:  # a class with more to say than a message (ObjectTooLarge)
        return SaveError(message)


class Leftovers:
    """The unfinished clean-ups of one saver's failed saves."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[_Kept] = []
        self._thread: threading.Thread | None = None

    def keep(self, uri: str, items: Sequence[Unfinished]) -> None:
        with self._lock:
            self._kept += [_Kept(uri, item) for item in items]

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def retry_in_background(self) -> None:
        """Try every kept clean-up again on a daemon thread (one at a time;
        a call while one runs does nothing)."""
        with self._lock:
            if not self._kept or (self._thread is not None and self._thread.is_alive()):
                return
            self._thread = threading.Thread(target=self.retry, name="dcpstore-leftovers", daemon=True)
            self._thread.start()

    def retry(self) -> list[str]:
        """Try every kept clean-up again now; returns what still failed
        (kept for the next try)."""
        with self._lock:
            todo, self._kept = self._kept, []
        failed: list[_Kept] = []
        for kept in todo:
            try:
                kept.item.retry()
            except CheckpointError as e:
                log.debug("still cannot %s: %s", kept.item.what, e)
                failed.append(kept)
            else:
                log.info("done now, after the failed save to %s: %s", kept.uri, kept.item.what)
        with self._lock:
            self._kept = failed + self._kept
        return [f"{k.item.what} (save to {k.uri})" for k in failed]

    def finish(self, when: str) -> None:
        """``close()`` or exit: wait for a background try, try once more,
        and log what is still left (with what removes it)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        left = self.retry()
        if left:
            log.warning(
                "dcpstore: %s, the clean-up of failed saves is still not done (the storage does not answer): %s; "
                "'dcpstore gc' on their URIs removes what they left",
                when,
                "; ".join(left),
            )
