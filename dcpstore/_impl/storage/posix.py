"""Local filesystems: what a file read under a root may resolve to
(:class:`LocalRoot`) and POSIX durability of a directory's entries
(:func:`fsync_dir`)."""

from __future__ import annotations

import os

from dcpstore._impl.util.errors import UnsafeCheckpoint


class LocalRoot:
    """A storage root on a local filesystem, and the rule for what is read
    under it: a file read must resolve (every symbolic link followed) to a
    path inside the root, else :class:`UnsafeCheckpoint` naming it. A link
    to elsewhere inside the checkpoint is fine; one out of it (to another
    checkpoint, ``/etc``, a device) is never followed. The root itself may
    be reached through links: it is resolved once it exists (a save creates
    it). The local, MSC POSIX and fsspec local backends all check here."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._real: str | None = None

    def real(self) -> str:
        """The root, its links resolved."""
        if self._real is not None:
            return self._real
        real = os.path.realpath(self.root)
        if os.path.isdir(real):
            self._real = real
        return real

    def check(self, resolved: str, where: str) -> None:
        """``resolved`` (a file's path, links resolved) lies inside the root;
        ``where`` names the file in the error."""
        real_root = self.real()
        if resolved != real_root and not resolved.startswith(real_root.rstrip(os.sep) + os.sep):
            raise UnsafeCheckpoint(
                f"{where} resolves to {resolved}, outside the checkpoint directory {real_root} "
                "(a symbolic link out of it): dcpstore reads nothing outside a checkpoint"
            )

    def check_path(self, full: str, where: str) -> None:
        """:meth:`check` for the file at ``full``, resolved now (for backends
        that open by path: the resolution and their open are two steps)."""
        self.check(os.path.realpath(full), where)


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in ``path`` durable (POSIX needs the directory fsynced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
