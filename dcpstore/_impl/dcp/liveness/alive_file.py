"""Proof of life of a running save, so that ``gc`` never collects one.

A save marks its URI as its own with the in-flight marker (its save id, see
:mod:`dcpstore._impl.format.layout`). Beside it, the coordinator keeps an *alive file*,
``.dcpstore.alive.<id>``, naming the process that runs the save (host,
boot id, pid namespace, pid and start time) and rewritten every
:data:`REFRESH_S` seconds while the save runs. One file per writer, so a
refresh never overwrites another's. This module is the file's format and
what ``gc`` concludes from it; it writes nothing (the one writer of alive
files is :class:`dcpstore._impl.dcp.liveness.lease.Lease`).

The rule, both sides (every writer of a checkpoint directory and ``gc``):

1. **A writer's first file in a directory is its alive file**, and its last
   act there removes it: a save's coordinator from its claim (before the
   in-flight marker) to its commit or failure; a tiered manager's marker
   before a save; every rank's replication into the durable tier, until
   the replica is committed (the coordinator's commit removes every alive
   file). So a listing that shows anything of a running writer shows its
   alive file too.
2. **gc keeps a directory with a running writer, and everything in it**
   (its files, markers, temporary files, open uploads): an alive file that
   does not name a process of this machine that has ended and was
   refreshed within max(``--older-than``, :data:`LEASE_S`)
   (:func:`is_running`); or one that was listed and is gone when gc reads
   it -- its writer just ended, and what it committed is newer than the
   listing, so gc decides next time.
3. **gc never removes an in-progress write younger than the lease**
   (:func:`write_is_stale`), whatever ``--older-than`` says: before a
   writer's alive file lands (its very first write) the in-progress write
   of that file is all there is to see. gc lists in-progress writes before
   the checkpoints (a write it lists belongs to a writer whose alive file
   the listing shows) and removes them by identity (an upload begun later
   under the same key is another upload).
4. **The in-flight marker's name is every save's**: gc removes a dead
   save's marker last, only where no alive file appeared since its
   listing; a save whose marker vanished from a directory without a commit
   puts it back (:meth:`dcpstore._impl.dcp.commit.SaveSession.check_owner`).

A save killed on this machine is thus collectable at once (its alive file
names a process that has ended; its temporary files a lease later);
elsewhere, a lease later.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

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


def write_is_stale(age_s: float | None, older_than_s: float) -> bool:
    """Whether ``gc`` may remove an in-progress write (temporary file, open
    upload) that was last written or started ``age_s`` seconds ago (None:
    unknown): older than both ``older_than_s`` and the lease (rule 3)."""
    return age_s is not None and age_s >= max(older_than_s, LEASE_S)
