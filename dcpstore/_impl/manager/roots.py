"""Where a :class:`~dcpstore._impl.manager.CheckpointManager` keeps its steps.

The manager decides *when* (one save in flight, retention after a commit);
a :class:`Roots` decides *where*: which URI a save writes, which steps
exist, which copy a load reads, what happens once a save is committed.
:class:`OneRoot` is the plain manager's single root;
:class:`~dcpstore._impl.manager.tiers.TieredRoots` is a local tier plus a durable
tier with background replication. The manager calls, in this order::

    every rank    roots.before_save(step, overwrite)    before the save starts;
                      returns the save id the save must use, or None
    every rank    roots.save_uri(step)                  where it writes
    every rank    roots.saved(step, handle)             the save's handle
    coordinator   roots.committed(step)                 after it committed
    every rank    roots.locate(step)                    (collective) what to load
    every rank    roots.wait(timeout) / roots.close()
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager.steps import (
    DCPSTORE,
    StepLayout,
    check_step,
    committed_steps,
    is_committed,
    read_pointer,
    retire,
    write_pointer,
)
from dcpstore._impl.storage import Storage, join_uri
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointNotFound
from dcpstore._impl.values.results import SaveHandle

#: A tiered manager's default bound on one step's replication and on
#: ``close()``'s wait (here, so that a plain manager need not import the tiers).
REPLICATE_TIMEOUT_S = 1800.0


class Roots(Protocol):
    @property
    def uri(self) -> str:
        """The root the user named, safe to print."""

    @property
    def save_storage(self) -> Storage:
        """The storage saves write to (the engine is checked against it)."""

    def save_uri(self, step: int) -> str: ...

    def is_committed(self, step: int) -> bool:
        """Whether ``step`` is committed anywhere this manager reads from."""

    def before_save(self, step: int, overwrite: bool) -> str | None: ...

    def saved(self, step: int, handle: SaveHandle) -> None: ...

    def committed(self, step: int) -> None:
        """Coordinator, after ``step``'s save committed: pointer, retention."""

    def all_steps(self) -> list[int]: ...

    def read_pointer(self) -> int | None: ...

    def locate(
        self, step: int | None, group: dist.ProcessGroup | None, state_dict: dict[str, Any] | None = None
    ) -> tuple[int, str]:
        """Collective: the step to load (``step``, or the newest committed)
        and the URI of the copy every rank reads (``state_dict``: what the
        load fills in, where the choice depends on it; None: the step alone)."""

    def wait(self, timeout: float | None) -> None: ...

    def close(self) -> None: ...


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def coordinator_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of the group's rank 0 (the ``src`` of a broadcast)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


def not_found(uri: str, layout: StepLayout = DCPSTORE) -> CheckpointNotFound:
    return CheckpointNotFound(f"no committed checkpoint under {uri} (no {layout.prefix}*/{METADATA})")


class OneRoot:
    """Every step under one root, named by ``layout``: the plain manager."""

    def __init__(self, storage: Storage, root_uri: str, keep: int | None, layout: StepLayout = DCPSTORE) -> None:
        self._storage = storage
        self._root_uri = root_uri
        self._keep = keep
        self._layout = layout

    @property
    def uri(self) -> str:
        return self._storage.uri

    @property
    def save_storage(self) -> Storage:
        return self._storage

    def save_uri(self, step: int) -> str:
        return join_uri(self._root_uri, self._layout.step_dir(step))

    def is_committed(self, step: int) -> bool:
        return is_committed(self._storage, step, self._layout)

    def before_save(self, step: int, overwrite: bool) -> str | None:
        return None

    def saved(self, step: int, handle: SaveHandle) -> None:
        pass

    def committed(self, step: int) -> None:
        write_pointer(self._storage, step, self._layout)
        if self._keep is not None:
            retire(self._storage, step, self._keep, self._layout)

    def all_steps(self) -> list[int]:
        return committed_steps(self._storage, self._layout)

    def read_pointer(self) -> int | None:
        return read_pointer(self._storage, self._layout)

    def locate(
        self, step: int | None, group: dist.ProcessGroup | None, state_dict: dict[str, Any] | None = None
    ) -> tuple[int, str]:
        """Rank 0 lists and broadcasts its answer, so every rank loads the
        same step even if a commit lands between their listings."""
        if step is None:
            steps = self.all_steps() if group_rank(group) == 0 else []
            found = steps[-1] if steps else None
            if is_distributed():
                box: list[int | None] = [found]
                dist.broadcast_object_list(box, src=coordinator_rank(group), group=group)
                found = box[0]
            if found is None:
                raise not_found(self.uri, self._layout)
            step = found
        step = check_step(step)
        return step, self.save_uri(step)

    def wait(self, timeout: float | None) -> None:
        pass

    def close(self) -> None:
        self._storage.close()
