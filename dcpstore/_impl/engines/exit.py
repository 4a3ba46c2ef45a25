"""The one interpreter-exit hook: pending saves finish (bounded) before exit.

Objects with work in flight register here: :class:`~dcpstore.CheckpointManager`
(its last save's commit, pointer and retention) and
:class:`~dcpstore.AsyncSaver` (its pending saves). At interpreter exit one
hook calls ``finish_at_exit()`` on each, managers first (a manager's save
runs on a saver, and finishing it is the manager's job: pointer, retention),
then savers. Each waits only as long as its ``hang_timeout`` allows, so a
hung storage call never keeps the process from exiting; an error is logged
(nobody is left to catch it) and the next object still gets its turn.

Registration is weak, so a dropped, idle object is simply forgotten;
:func:`hold` keeps a strong reference while an object has a save in flight,
so a manager dropped without ``close()`` still finishes its last save.

When the hook runs. It must run *before* ``concurrent.futures`` refuses new
work at exit (its ``_python_exit``), or a last save that still has parts to
hand to a backend's thread pool (S3 multipart uploads) dies with "cannot
schedule new futures after interpreter shutdown". Both hooks are threading's
exit callbacks, which run newest first, before ``atexit``'s; this module
imports ``concurrent.futures.thread`` (registering its callback) before it
registers its own, so ours runs first whatever else was imported when.
Pythons without threading's exit callbacks, or an import during shutdown,
fall back to ``atexit``.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its exit callback before ours: see above)
import enum
import logging
import threading
import weakref
from typing import Protocol

log = logging.getLogger(__name__)


class Stage(enum.IntEnum):
    """Who finishes when at exit, in this order."""

    MANAGERS = 0
    SAVERS = 1


class Finishes(Protocol):
    def finish_at_exit(self) -> None:
        """Finish pending work, waiting no longer than the object's own bound;
        may raise (logged)."""


_lock = threading.Lock()
_watched: dict[Stage, weakref.WeakSet[Finishes]] = {stage: weakref.WeakSet() for stage in Stage}
_held: dict[int, tuple[Stage, Finishes]] = {}


def watch(obj: Finishes, stage: Stage) -> None:
    """Call ``obj.finish_at_exit()`` at exit, in ``stage`` (weakly held)."""
    with _lock:
        _watched[stage].add(obj)


def hold(obj: Finishes, stage: Stage) -> None:
    """Keep ``obj`` alive until :func:`release` (or exit), and finish it at
    exit even if its owner dropped it."""
    with _lock:
        _held[id(obj)] = (stage, obj)


def release(obj: Finishes) -> None:
    """Undo :func:`hold`."""
    with _lock:
        _held.pop(id(obj), None)


def forget(obj: Finishes) -> None:
    """Undo :func:`watch` and :func:`hold`: nothing left to finish."""
    with _lock:
        for watched in _watched.values():
            watched.discard(obj)
        _held.pop(id(obj), None)


def finish_all() -> None:
    """Finish every registered object, stage by stage (the exit hook)."""
    for stage in Stage:
        with _lock:
            todo = {id(o): o for o in _watched[stage]}
            todo.update({key: o for key, (s, o) in _held.items() if s is stage})
        for obj in todo.values():
            try:
                obj.finish_at_exit()
            except Exception as e:  # nobody is left to catch it; say what was lost
                log.error("dcpstore: at interpreter exit, %s", e)


def _install() -> None:
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("this Python has no threading exit callbacks")
        register(finish_all)
    except RuntimeError:  # older Python, or imported while already shutting down
        atexit.register(finish_all)


_install()
