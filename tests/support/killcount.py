"""How many kill points a crash test ran, and how many of them really killed.

A kill point at an event index is a no-op when the run it kills has fewer
events than the probe that counted them (the tiered tests' spread points
may be): every crash test reports its counts through :func:`record`, which
fails the test when fewer than ``minimum`` points killed.

With ``DCPSTORE_KILL_COUNTS=<file>`` set, :func:`record` also writes the
counts under the test's node id into that JSON file (merged with what it
holds); RELIABILITY.md's "Kill points" table is generated from the
committed ``tests/support/kill_counts.json`` (``python tests/support/reliability.py
--write``), and tests/docs/test_docs.py checks the table against it.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
from typing import Any

#: The environment variable that names the file the counts go to.
ENV = "DCPSTORE_KILL_COUNTS"


def current_node_id() -> str:
    """The node id of the running test (pytest sets ``PYTEST_CURRENT_TEST``
    to ``"<node id> (<phase>)"``)."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    return current.rsplit(" (", 1)[0]


def record(points: int, killed: int, minimum: int) -> None:
    """The running test had ``points`` kill points, of which ``killed``
    SIGKILLed the child; at least ``minimum`` must have."""
    assert killed >= minimum, f"only {killed} of {points} kill points killed the save; at least {minimum} must"
    path = os.environ.get(ENV)
    if path:
        counts = {"points": points, "killed": killed, "minimum": minimum, "commit": _head()}
        write(path, current_node_id(), counts)


@functools.lru_cache(maxsize=1)
def _head() -> str | None:
    """The checkout's commit (short hash; ``+`` when files differ from it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        )
    except OSError:
        return None
    return (head.stdout.strip() + ("+" if dirty.stdout.strip() else "")) or None


def write(path: str, node_id: str, counts: dict[str, Any]) -> None:
    """Merge ``{node_id: counts}`` into the JSON file at ``path`` (created if
    missing; locked, so concurrent tests do not lose each other's counts)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        data: dict[str, Any] = json.loads(text) if text.strip() else {}
        data[node_id] = counts
        f.seek(0)
        f.truncate()
        json.dump(dict(sorted(data.items())), f, indent=1)
        f.write("\n")
