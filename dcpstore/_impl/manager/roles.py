"""The directories of the managers open in this process, and their roles.

A tiered manager's local tier shares its directory with nothing: not its
own durable root, nor another open manager's root or local tier
(:func:`~dcpstore._impl.storage.overlap.check_roles` says why and decides what
counts as one directory). :class:`OpenRoles` registers each manager's roles
when it is made and refuses one that would share a local tier; managers are
held weakly (one dropped without ``close()`` is forgotten with it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from dcpstore._impl.storage.overlap import Role, check_roles


class OpenRoles:
    """The roles of the configurations open in this process (weakly held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: weakref.WeakKeyDictionary[object, tuple[str, tuple[Role, ...]]] = weakref.WeakKeyDictionary()

    def claim(self, owner: object, what: str, roles: Sequence[Role]) -> None:
        """:func:`check_roles` against every open configuration, then
        register ``owner``'s (until :meth:`release` or until it is dropped)."""
        with self._lock:
            check_roles(roles, [v for k, v in list(self._open.items()) if k is not owner])
            self._open[owner] = (what, tuple(roles))

    def release(self, owner: object) -> None:
        with self._lock:
            self._open.pop(owner, None)


#: The managers open in this process.
OPEN = OpenRoles()
