"""RSS as a measure of live memory, for the suites' leak checks.

glibc keeps freed memory for reuse, and by default it raises its mmap
threshold to the largest block freed so far: once a 2 MiB buffer has been
freed, later ones come from the heap, and the heap may keep them -- a
one-off step in RSS that no leak made. The leak checks therefore fix the
threshold at glibc's default (128 KiB), so that blocks that large are
mapped and unmapped, and trim the heap before each sample.
"""

from __future__ import annotations

import ctypes
import gc

import psutil

_LIBC = ctypes.CDLL("libc.so.6")
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_MMAP_THRESHOLD = 128 * 1024


def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold for the rest of the process (glibc has no
    way back to the dynamic one; the test process only gets allocator
    behaviour that tracks live memory more closely)."""
    if _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def live_rss(proc: psutil.Process) -> int:
    """RSS after a garbage collection and a heap trim: live memory, not
    what the allocator keeps for reuse."""
    gc.collect()
    _LIBC.malloc_trim(0)
    return int(proc.memory_info().rss)
