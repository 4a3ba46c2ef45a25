"""Process groups of dcpstore's own: the collectives of a background save,
and a load's exchange of shared reads, run on a gloo group of their own.

Why a save needs a group of its own: :mod:`.saver`, "Background collectives";
why a load does: :mod:`dcpstore._impl.dcp.shared_reads`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.torch_compat import default_group


class BackgroundGroups:
    """One dedicated gloo group per process group, created on its first use.

    ``get`` is a collective over the process group's ranks (``dist.new_group``):
    call it on the caller's thread, where every rank calls ``save`` in step.
    Groups of an earlier default group (after ``destroy_process_group`` and a
    new ``init_process_group``) are dead and are dropped.
    """

    def __init__(self, timeout: timedelta | None, desc: str) -> None:
        self.timeout = timeout
        self.desc = desc
        # key -> (default group it belongs to, the user's group, our group)
        self._groups: dict[int, tuple[Any, Any, dist.ProcessGroup]] = {}

    def get(self, process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        if not is_distributed():
            return None
        default = default_group()
        # After destroy_process_group() + a new init, the old groups are dead.
        self._groups = {k: v for k, v in self._groups.items() if v[0] is default}
        key = id(process_group) if process_group is not None else 0
        entry = self._groups.get(key)
        if entry is None or entry[1] is not process_group:
            ranks = dist.get_process_group_ranks(process_group or default)
            group = dist.new_group(
                ranks=ranks,
                backend="gloo",
                timeout=self.timeout,
                use_local_synchronization=True,
                group_desc=self.desc,
            )
            entry = (default, process_group, group)
            self._groups[key] = entry
        return entry[2]

    def destroy(self) -> None:
        groups, self._groups = self._groups, {}
        if not is_distributed():
            return
        default = default_group()
        for owner, _, group in groups.values():
            if owner is default:
                dist.destroy_process_group(group)
