"""How the ranks share ``local_dir``, one strategy per way: :class:`LocalTier`.

:class:`~.tiered.TieredRoots` (the replicator, the durable tier) holds one,
chosen when the manager is made (:meth:`~.nodes.NodeSync.open` finds which),
and asks it wherever the two ways differ:

* :class:`SharedDir`: one directory every rank sees (one node, or a path
  every node mounts). The coordinator's save commits it; its copy is whole;
  the coordinator catches up and keeps local retention.
* :class:`~.nodes.NodeDirs`: one directory per node. Each node's leader puts
  the manager's save id in its step directory before a save and publishes
  the coordinator's commit there after it; the ranks agree on what is
  committed and what can be read locally through collectives.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from dcpstore._impl.dcp.commit import Commit
from dcpstore._impl.dcp.liveness import Lease, mark
from dcpstore._impl.manager.steps import step_dir
from dcpstore._impl.manager.tiers.kept_leases import TierLeases
from dcpstore._impl.manager.tiers.replicate import read_local_commit, whole_local_steps
from dcpstore._impl.storage import Storage


@dataclass(frozen=True)
class Job:
    """A step queued on a rank's replicator."""

    step: int
    #: The data files this rank's save wrote; None: catch-up (one directory:
    #: the coordinator, every file the local manifest names; node-local: each
    #: node's leader, the files of ``commit`` its directory holds).
    files: tuple[str, ...] | None
    #: Node-local catch-up: the coordinator's commit of the step.
    commit: Commit | None = None
    #: Not a replication: the peer copies of the step to make
    #: (:attr:`.peers.Plan.copies`, each node's leader its part).
    copies: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class TierParts:
    """What :class:`~.tiered.TieredRoots` hands its local tier."""

    local: Storage
    durable: Storage
    rank: int
    #: The markers' leases (and the replicas').
    leases: TierLeases
    #: Wait for the replication under way, raising its error.
    wait: Callable[[], None]
    #: Wait until the replicator has nothing queued or in progress (its error stays for ``wait()``).
    wait_idle: Callable[[], None]


class LocalTier(Protocol):
    @property
    def leader(self) -> bool:
        """Whether this rank keeps its directory's commits and local retention."""

    @property
    def saves_commit_here(self) -> bool:
        """Whether this rank's save committing commits its directory's copy
        (the lease of the marker put before the save ends then)."""

    def local_steps(self) -> list[int]:
        """The steps this rank may read from its directory (see :meth:`reads_locally`)."""

    def any_rank(self, mine: bool) -> bool:
        """Whether any rank's directory says so (``mine``: this rank's)."""

    def catch_up(self, needs: Callable[[int], bool] | None) -> list[Job]:
        """When the manager is made: the committed local steps to replicate
        on this rank, those for which ``needs`` says so (None: this rank
        could not list the durable tier, and raises after this)."""

    def before_save(self, step: int, overwrite: bool) -> str | None:
        """Every rank, before each save of ``step``; the save id the save
        must use, or None (see :meth:`~.tiered.TieredRoots.before_save`)."""

    def commit_of(self, job: Job) -> tuple[Commit | None, tuple[str, ...] | None] | None:
        """The local commit ``job`` replicates and the files this rank
        uploads (None: every file its manifest names); None: nothing to
        replicate (a step no node holds whole)."""

    def copies_done(self) -> None:
        """After each job: wait for what :meth:`commit_of` started beside the
        upload (a save's peer copies), raising its error."""

    def restore_from_peers(self, durable: Iterable[int]) -> list[Job]:
        """When the manager is made: bring back, from peers' copies or the
        durable tier (whose steps ``durable`` lists), the shares of the
        newest step that a node lacks (:mod:`.peers`); returns the job that
        makes the missing copies of that step for peers, on the replicator."""

    def retire_peers(self, newest: int, keep: int, needed: Callable[[int], bool]) -> None:
        """Retention of the copies this directory keeps for peers."""

    def reads_locally(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Whether every rank's directory holds what its load of ``state_dict`` reads."""


def put_marker(local: Storage, step: int, save_id: str) -> Lease:
    """The in-flight marker for the save of ``step``, holding ``save_id``,
    in the local step directory, after the lease it returns
    (:func:`~dcpstore._impl.dcp.liveness.lease.mark`): ``dcpstore gc`` keeps the
    step until the caller ends the lease (once the directory's copy is
    committed, or the save failed), as it keeps the coordinator's save."""
    # Not fsynced: the caller's training thread waits here, and a crash that
    # loses them loses nothing (the save never commits; gc collects its files).
    return mark(local, save_id, step_dir(step), durable=False)


class SharedDir:
    """One ``local_dir`` every rank sees."""

    def __init__(self, parts: TierParts) -> None:
        self._parts = parts
        self._local = parts.local

    @property
    def leader(self) -> bool:
        return self._parts.rank == 0

    @property
    def saves_commit_here(self) -> bool:
        return True

    def local_steps(self) -> list[int]:
        """A whole copy: every file the manifest names, at its size."""
        return whole_local_steps(self._local)

    def any_rank(self, mine: bool) -> bool:
        return mine

    def catch_up(self, needs: Callable[[int], bool] | None) -> list[Job]:
        """The coordinator's, from its whole local copies."""
        if needs is None or self._parts.rank != 0:
            return []
        return [Job(step, None) for step in self.local_steps() if needs(step)]

    def before_save(self, step: int, overwrite: bool) -> str | None:
        """Overwriting a step the durable tier holds files of: the coordinator
        puts an in-flight marker in the local step directory first (after any
        replication under way), so that the local save picks save-unique
        names there (the claim replaces the marker)."""
        if overwrite and self._parts.rank == 0:
            self._parts.wait()
            if any(True for _ in self._parts.durable.list(f"{step_dir(step)}/")):
                self._parts.leases.hold_marker(step, put_marker(self._local, step, os.urandom(8).hex()))
        return None

    def commit_of(self, job: Job) -> tuple[Commit | None, tuple[str, ...] | None]:
        return read_local_commit(self._local, job.step), job.files

    def copies_done(self) -> None:
        """One directory has no peers."""

    def restore_from_peers(self, durable: Iterable[int]) -> list[Job]:
        """One directory has no peers."""
        return []

    def retire_peers(self, newest: int, keep: int, needed: Callable[[int], bool]) -> None:
        """One directory keeps no peer copies."""

    def reads_locally(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Its copies are whole (:meth:`local_steps`): every load reads them."""
        return True
