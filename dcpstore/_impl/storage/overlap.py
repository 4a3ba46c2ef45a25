"""Whether two storages are one directory, or one holds the other.

A tiered manager keeps a local tier and a durable root; ``dcpstore ls
--local-dir`` lists both. Where the two are one directory on this machine
(however spelt: a trailing ``/``, ``file://``, ``..``, a relative path, a
symlink, a bind mount, MSC's POSIX profile over a plain path) or one lies
inside the other, each role's retention and clean-up would delete the
other's steps. :func:`overlap` is the one test of that, on the directories
the backends name (:meth:`~dcpstore._impl.storage.base.Storage.local_path`): first
by their resolved paths (symlinks and ``..`` followed, also for parts that do
not exist yet), then, for directories that exist, by device and inode, which
also sees a bind mount or a second mount of one filesystem.

:func:`check_roles` is the rule built on it: a tiered manager's local tier
is a directory of its own. Its retention deletes the steps there that it
has replicated and its catch-up replicates every committed step it finds
there, so where that directory is also the durable root (or lies inside it,
or holds it), or another open manager's root or local tier, one role
deletes what the other promised to keep
(``CheckpointManager(r, local_dir=r, keep=3, local_keep=1)`` kept one step
of three). Roots may share directories with roots: a plain manager that
lists or loads a tiered manager's durable root is one role twice. The
manager (and ``dcpstore ls --local-dir``) refuse such a configuration with
:class:`~dcpstore._impl.util.errors.InvalidArgument` naming both, before anything is
written.

Imports only :mod:`.base`, :mod:`.uri` and :mod:`dcpstore._impl.util.errors`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dcpstore._impl.storage.base import Storage
from dcpstore._impl.storage.uri import redact
from dcpstore._impl.util.errors import InvalidArgument


def overlap(a: Storage, b: Storage) -> str | None:
    """How ``a``'s root relates to ``b``'s on this machine's filesystem:
    ``"is the same directory as"``, ``"is inside"``, ``"holds"``, or None
    (disjoint, or either is not a local directory)."""
    pa, pb = a.local_path(), b.local_path()
    if pa is None or pb is None:
        return None
    return path_overlap(pa, pb)


def path_overlap(a: str, b: str) -> str | None:
    """:func:`overlap` of two directory paths (see the module docstring)."""
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    if ra == rb or _same(a, b):
        return "is the same directory as"
    if _inside(ra, rb) or _below(a, b):
        return "is inside"
    if _inside(rb, ra) or _below(b, a):
        return "holds"
    return None


def _inside(path: str, top: str) -> bool:
    return path.startswith(top.rstrip(os.sep) + os.sep)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _same(a: str, b: str) -> bool:
    ia = _identity(a)
    return ia is not None and ia == _identity(b)


def _below(path: str, top: str) -> bool:
    """Whether an existing directory above ``path`` (its nearest existing
    ancestor and those above it) is ``top`` itself, by device and inode."""
    want = _identity(top)
    if want is None:
        return False
    current = os.path.dirname(os.path.realpath(path))
    while True:
        if _identity(current) == want:
            return True
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


@dataclass(frozen=True)
class Role:
    """A directory in the role one configuration gives it."""

    #: What the configuration calls it ("root_uri", "local_dir", "--local-dir").
    name: str
    storage: Storage
    #: A local tier: no other role may share its directory.
    exclusive: bool = False
    #: How the caller spelt it (default: the storage's URI).
    given: str | None = None

    def describe(self) -> str:
        """The name, as the caller spelt it (and where it resolves to, if that differs)."""
        given = redact(self.given) if self.given is not None else self.storage.uri
        resolved = self.storage.local_path()
        shown = f"{self.name} {given!r}"
        real = os.path.realpath(resolved) if resolved is not None else None
        return shown if real is None or real == given else f"{shown} (= {real})"


def check_roles(roles: Sequence[Role], others: Iterable[tuple[str, Sequence[Role]]] = ()) -> None:
    """Refuse ``roles`` (one configuration) if an exclusive one shares its
    directory with another of them, or any of them with an exclusive role of
    ``others`` (``(what, roles)`` of configurations already open), or an
    exclusive one with any role of ``others``."""
    for i, mine in enumerate(roles):
        for other in roles[i + 1 :]:
            if mine.exclusive or other.exclusive:
                _refuse(mine, other, "")
    for what, theirs in others:
        for mine in roles:
            for other in theirs:
                if mine.exclusive or other.exclusive:
                    _refuse(mine, other, f" of {what}")


def _refuse(mine: Role, other: Role, of: str) -> None:
    if other.exclusive and not mine.exclusive and not of:  # name the local tier first
        mine, other = other, mine
    relation = overlap(mine.storage, other.storage)
    if relation is None:
        return
    raise InvalidArgument(
        f"{mine.describe()} {relation} {other.describe()}{of}: a tiered manager's local tier must be a "
        "directory of its own (its retention deletes the steps there that the other role keeps, and its "
        "catch-up copies the other's steps); give the two separate directories. Nothing was written"
    )
