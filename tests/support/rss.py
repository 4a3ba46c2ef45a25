"""RSS as a measure of live memory, for the suites' leak checks.

glibc keeps freed memory for reuse, and by default it raises its mmap
threshold to the largest block freed so far: once a 2 MiB buffer has been
freed, later ones come from the heap, and the heap may keep them -- a
one-off step in RSS that no leak made. The leak checks therefore fix the
threshold at glibc's default (128 KiB), so that blocks that large are
mapped and unmapped, and trim the heap before each sample.

glibc has no way back to the dynamic threshold, so a check that fixes it
runs in a process of its own (:func:`in_own_process`): the test process's
allocator stays as it was, and no test measures memory in an allocator that
depends on which tests ran before it.
"""

from __future__ import annotations

import ctypes
import gc
import os
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from tests.support.crashkit import forkserver

_LIBC = ctypes.CDLL("libc.so.6")
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_MMAP_THRESHOLD = 128 * 1024

T = TypeVar("T")

#: Source that defines ``peak_mib()`` in a child interpreter (``python -c``):
#: its peak RSS, from VmHWM. Not ``ru_maxrss``: Linux keeps that across
#: ``execve``, so a child started from a test process that has grown reports
#: the parent's size, not its own.
PEAK_MIB_SOURCE = """
def peak_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
"""

#: True in a process that :func:`in_own_process` started.
_OWN_PROCESS = False


def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold for the rest of this process, which must
    be one :func:`in_own_process` started (glibc has no way back to the
    dynamic threshold)."""
    if not _OWN_PROCESS:
        raise RuntimeError("fix_mmap_threshold() changes the allocator for good: call it under rss.in_own_process")
    if _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def live_rss(proc: psutil.Process) -> int:
    """RSS after a garbage collection and a heap trim: live memory, not
    what the allocator keeps for reuse."""
    gc.collect()
    _LIBC.malloc_trim(0)
    return int(proc.memory_info().rss)


def _child(env: dict[str, str], queue: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _OWN_PROCESS
    _OWN_PROCESS = True
    os.environ.clear()
    os.environ.update(env)
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:
        queue.put(("failed", traceback.format_exc()))


def in_own_process(fn: Callable[..., T], *args: Any, timeout: float = 280.0) -> T:
    """``fn(*args)`` in a process of its own (forked from the session's
    forkserver, in the caller's environment), so that what it does to the
    allocator stays there; its result, or an AssertionError carrying its
    traceback. ``fn`` must live at module level."""
    ctx = forkserver()
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(dict(os.environ), queue, fn, args))
    proc.start()
    try:
        status, value = queue.get(timeout=timeout)
    except Exception as e:
        raise AssertionError(f"{fn.__name__} gave no result within {timeout}s (exit code {proc.exitcode})") from e
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise AssertionError(f"{fn.__name__} failed in its own process:\n{value}")
    return value  # type: ignore[no-any-return]
