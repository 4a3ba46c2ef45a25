"""Local filesystems: what a file read under a root may resolve to
(:class:`LocalRoot`), POSIX durability of a directory's entries
(:func:`fsync_dir`), and writeback started while a file is still being
written (:func:`start_writeback`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Callable

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


#: Direct I/O (``O_DIRECT``) in whole pages: file offsets, lengths and memory
#: addresses at multiples of this, which every Linux filesystem and block
#: device accepts (most need only their logical block, some less).
DIRECT_ALIGN = 4096


def open_direct(path: str, access: int = os.O_WRONLY) -> int:
    """A descriptor with ``O_DIRECT`` on the existing file ``path``, opened
    for ``access`` (``os.O_WRONLY`` or ``os.O_RDONLY``); -1 where the
    platform or the filesystem has no direct I/O. A read opens with
    ``O_NONBLOCK``: were ``path`` swapped for a FIFO, the open must not
    wait for its writer."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return -1
    try:
        nonblock = os.O_NONBLOCK if access == os.O_RDONLY else 0
        return os.open(path, access | os.O_CLOEXEC | nonblock | flag)
    except OSError:  # EINVAL: this filesystem does no direct I/O
        return -1


def fsync_dir(path: str) -> None:
    """Make a rename or unlink in ``path`` durable (POSIX needs the directory fsynced)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: ``SYNC_FILE_RANGE_WRITE`` (linux/fs.h): start writeback of the range's
#: dirty pages, wait for nothing.
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux only; Python's ``os`` lacks it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` to the disk now,
    without waiting: a file written whole and then fsynced otherwise leaves
    all its writeback to the fsync, after the last write, where it adds to
    the save's time instead of overlapping the writes. Durability still
    comes from the fsync; where the call is missing or fails this does
    nothing."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # releases the GIL (ctypes); errors: the fsync reports them
