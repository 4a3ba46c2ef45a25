"""Ignore one known warning for as long as dcpstore's own call runs; point
our own warnings at the user's line.

Foundation layer: imports nothing of dcpstore's.

torch raises two warnings from inside dcpstore's calls that tell a dcpstore
user nothing: DCP's "torch.distributed is disabled, unavailable or
uninitialized" on every save and load without a process group (a
single-process save is a supported use here), and ``torch.frombuffer``'s "The
given buffer is not writable" (an item view is only ever read). They are
ignored exactly while the call that raises them runs, never by changing the
filters at import.

Why not ``warnings.catch_warnings``: it swaps the process-wide filter list and
restores its saved copy on exit, so two threads using it at once -- the async
saver's background thread, the reader's threads, the training thread, a test
runner -- restore each other's stale copies and leak or lose filters.
:func:`ignoring` inserts one filter entry while any call needs it
(reference-counted, under a lock) and then removes exactly that entry, by
identity, from every filter list it went into, leaving every other change
alone. An ``ignore`` entry never records anything in a warning registry, so
adding and removing it needs no cache invalidation.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast


class _Entry:
    """One ignored message: its filter entry, how many calls need it, and the
    filter lists it was inserted into."""

    def __init__(self, message: str) -> None:
        self.filter: tuple[Any, ...] = ("ignore", re.compile(message, re.I), Warning, None, 0)
        self.users = 0
        self.lists: list[list[Any]] = []


_lock = threading.Lock()
_entries: dict[str, _Entry] = {}


@contextmanager
def ignoring(message: str) -> Iterator[None]:
    """Ignore warnings whose text starts with the regular expression
    ``message`` (as ``warnings.filterwarnings`` matches it) while the block
    runs, on every thread."""
    with _lock:
        entry = _entries.setdefault(message, _Entry(message))
        entry.users += 1
        # Typed as a Sequence in typeshed; it is the module's list.
        current = cast(list[Any], warnings.filters)
        # Another thread's catch_warnings may have swapped the list since
        # the entry went in: make sure the current list has it too.
        if not any(f is entry.filter for f in current):
            current.insert(0, entry.filter)
            entry.lists.append(current)
    try:
        yield
    finally:
        with _lock:
            entry.users -= 1
            if entry.users == 0:
                for filters in [*entry.lists, cast(list[Any], warnings.filters)]:
                    for i, f in enumerate(filters):
                        if f is entry.filter:
                            del filters[i]
                            break
                entry.lists.clear()


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # all of dcpstore, _impl or not


def _ours(frame: Any) -> bool:
    """Whether ``frame`` runs dcpstore's code: a module of the package, or
    the ``__init__`` that ``dataclasses`` generates for one of its classes
    (compiled from a string, so it has no file of ours; ``__post_init__``
    warns through it), or ``dataclasses.replace`` rebuilding one."""
    code = frame.f_code
    if code.co_filename.startswith(_PACKAGE) or code.co_filename == dataclasses.__file__:
        return True
    if code.co_filename != "<string>" or code.co_name != "__init__":
        return False
    owner = frame.f_locals.get("self")
    return type(owner).__module__.split(".")[0] == __name__.split(".")[0]


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes the caller's ``warnings.warn`` name the
    first frame outside the dcpstore package: the user's line, however many
    of our layers and wrappers (:func:`dcpstore._impl.util.keyword_hints.hint_keywords`, a
    dataclass's generated ``__init__``) lie between (what Python 3.12's
    ``skip_file_prefixes`` does)."""
    frame = sys._getframe(1)  # the function that is about to warn
    level = 1
    while frame.f_back is not None and _ours(frame):
        frame = frame.f_back
        level += 1
    return level
