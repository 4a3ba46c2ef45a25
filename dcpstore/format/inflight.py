"""Proof of life of a running save, so that ``gc`` never collects one.

A save marks its URI as its own with the in-flight marker (its save id, see
:mod:`dcpstore.writers.layout`). Beside it, the coordinator keeps an *alive
file*, ``.dcpstore.alive.<save id>``, naming the process that runs the save
(host, boot id, pid namespace, pid and start time) and rewritten every
:data:`REFRESH_S` seconds while the save runs (:class:`Refresher`). One file
per save, so a refresh never overwrites another save's marker.

``gc`` (:func:`is_running`) keeps a directory whose alive file names a
process of this machine that still runs (whatever ``--older-than`` says),
or, for a process elsewhere, whose file was refreshed within
max(``--older-than``, :data:`LEASE_S`). A save killed on this machine is
collectable at once; elsewhere, a lease later.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import CheckpointError
from ..storage.base import Storage
from .manifest import SMALL_FILE_LIMIT, read_capped

log = logging.getLogger(__name__)

ALIVE_PREFIX = ".dcpstore.alive."
#: How often a running save rewrites its alive file.
REFRESH_S = 30.0
#: An alive file older than this names a save that stopped (four missed refreshes).
LEASE_S = 4 * REFRESH_S


def alive_name(save_id: str) -> str:
    return f"{ALIVE_PREFIX}{save_id}"


def is_alive_file(name: str) -> bool:
    return name.startswith(ALIVE_PREFIX)


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(4096).strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first)."""
    text = _read(f"/proc/{pid}/stat")
    return text.rpartition(")")[2].split() if ")" in text else None


@dataclass(frozen=True)
class Owner:
    """The process running a save. ``boot`` and ``pidns`` make "same machine,
    same pid namespace" checkable (containers share a hostname and reuse
    pids); ``start`` (clock ticks since boot) tells a reused pid apart."""

    host: str
    boot: str
    pidns: str
    pid: int
    start: str

    @classmethod
    def current(cls) -> Owner:
        fields = _stat_fields(os.getpid())
        try:
            pidns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pidns = ""
        return cls(
            host=socket.gethostname(),
            boot=_read("/proc/sys/kernel/random/boot_id"),
            pidns=pidns,
            pid=os.getpid(),
            start=fields[19] if fields and len(fields) > 19 else "",
        )

    def running(self) -> bool | None:
        """True/False if this process can tell (same boot and pid namespace),
        else None."""
        me = Owner.current()
        if not (self.boot and self.pidns and self.start) or (self.boot, self.pidns) != (me.boot, me.pidns):
            return None
        fields = _stat_fields(self.pid)
        if fields is None or len(fields) <= 19:
            return False
        return fields[0] != "Z" and fields[19] == self.start  # a zombie has exited


def encode_alive(save_id: str, owner: Owner) -> bytes:
    return json.dumps({"save_id": save_id, "owner": asdict(owner), "refresh_s": REFRESH_S}).encode()


def decode_owner(blob: bytes) -> Owner | None:
    """The owner an alive file names; None for anything malformed (hostile
    storage gets no further than "not provably running here")."""
    try:
        data: Any = json.loads(blob)
        fields = data["owner"]
        owner = Owner(**{k: fields[k] for k in ("host", "boot", "pidns", "pid", "start")})
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    ok = all(isinstance(getattr(owner, k), str) for k in ("host", "boot", "pidns", "start"))
    return owner if ok and type(owner.pid) is int else None


def is_running(owner: Owner | None, age_s: float | None, older_than_s: float) -> bool:
    """Whether ``gc`` must treat a save as running, from its alive file's
    owner and age (seconds since it was last written; None: unknown)."""
    if owner is not None and owner.running() is False:
        return False  # its process (on this machine) is gone
    # A running save rewrites its file every REFRESH_S; one that has not for a
    # lease stopped (or its process cannot refresh it any more).
    return age_s is None or age_s < max(older_than_s, LEASE_S)


#: Refreshers by (id of the save's storage object, save id), so that the
#: commit or a failure path can stop the one its claim started.
_running: dict[tuple[int, str], Refresher] = {}
_running_lock = threading.Lock()


class Refresher:
    """Rewrites a save's alive file every :data:`REFRESH_S` seconds until
    :meth:`stop`, until the save's storage object is gone, or until the URI
    is no longer the save's (its in-flight marker replaced or removed)."""

    def __init__(self, storage: Storage, save_id: str, marker: str, interval: float | None = None) -> None:
        self._storage = weakref.ref(storage)
        self._storage_id = id(storage)
        self._uri = storage.uri
        self._save_id = save_id
        self._marker = marker
        self._blob = encode_alive(save_id, Owner.current())
        self._interval = REFRESH_S if interval is None else interval
        self._stopped = threading.Event()
        storage.put(alive_name(save_id), self._blob)
        with _running_lock:
            _running[self._key] = self
        self._thread = threading.Thread(target=self._run, name="dcpstore-alive", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        try:
            self._refresh_until_stopped()
        finally:
            with _running_lock:
                if _running.get(self._key) is self:
                    del _running[self._key]

    @property
    def _key(self) -> tuple[int, str]:
        return (self._storage_id, self._save_id)

    def _refresh_until_stopped(self) -> None:
        while not self._stopped.wait(self._interval):
            storage = self._storage()
            if storage is None:
                return
            try:
                if read_capped(storage, self._marker, SMALL_FILE_LIMIT).decode(errors="replace") != self._save_id:
                    return  # the URI is another save's now (or gc took it): this save will not commit
                storage.put(alive_name(self._save_id), self._blob)
            except CheckpointError as e:
                if isinstance(e, FileNotFoundError):
                    return
                log.debug("could not refresh the alive file of save %s under %s: %s", self._save_id, self._uri, e)
            finally:
                del storage


def start_refresher(storage: Storage, save_id: str, marker: str) -> None:
    """Write the save's alive file and keep it fresh (coordinator, at claim)."""
    Refresher(storage, save_id, marker)


def stop_refresher(storage: Storage, save_id: str, *, remove: bool = False) -> None:
    """Stop refreshing the save's alive file: at commit (which deletes it
    with the marker), or when the save failed (``remove=True``: delete it
    now, best effort, so that ``gc`` may collect what the save left).
    Idempotent."""
    with _running_lock:
        refresher = _running.pop((id(storage), save_id), None)
    if refresher is not None:
        refresher.stop()
    if remove and save_id:
        try:
            storage.delete([alive_name(save_id)])
        except CheckpointError as e:
            log.debug("could not remove the alive file of failed save %s under %s: %s", save_id, storage.uri, e)




def release_claims(storage: Storage) -> None:
    """:func:`stop_refresher` (removing the alive files) for every save
    claimed through this storage object: for failure paths that do not
    know the save id."""
    with _running_lock:
        save_ids = [sid for (sid_storage, sid) in _running if sid_storage == id(storage)]
    for save_id in save_ids:
        stop_refresher(storage, save_id, remove=True)
