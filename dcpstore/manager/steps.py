"""Step-numbered checkpoints under one root, on any :class:`Storage`.

Layout::

    root/step_00000100/.metadata + data files + manifest (format.layout's names)
    root/step_00000200/...
    root/latest                 "200\\n": a hint, written after the commit

**The listing is the truth.** A step exists once ``step_<8+ digits>/.metadata``
is listed (``.metadata`` is the commit, written last by the DCP writer);
:func:`committed_steps` reads the listing and ignores the ``latest``
pointer, so a crash between the commit and the pointer update (or a pointer
left by another job) can never send a resume to a missing or partial step.
The pointer exists for humans and tools that want one read. Directories
that do not parse as ``step_NNNNNNNN`` (exactly the canonical, zero-padded
spelling) are ignored.

Each function takes the root's :class:`Storage`, so the same naming,
listing and deletion serve any root a manager keeps steps under.

Layer: manager. Imports :mod:`dcpstore.format`, :mod:`dcpstore.storage` and
:mod:`dcpstore.errors`.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable

from ..errors import CheckpointError, InvalidArgument
from ..format.layout import METADATA
from ..format.manifest import SMALL_FILE_LIMIT, read_capped
from ..storage import Storage

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
STEP_DIGITS = 8
LATEST = "latest"
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{{STEP_DIGITS},}})$")


def check_step(step: object) -> int:
    """A step is a non-negative int (bools are refused)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgument(f"step must be a non-negative int, got {step!r}")
    return step


def step_dir(step: int) -> str:
    """The directory name of ``step``: ``step_00000100``."""
    return f"{STEP_PREFIX}{check_step(step):0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name denotes, or ``None`` for foreign names.

    Only the canonical spelling counts (``step_00000100``, not ``step_100`` or
    ``step_000000100``), so every step has exactly one directory.
    """
    match = _STEP_RE.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step_dir(step) == name else None


def committed_steps(root: Storage, parse: Callable[[str], int | None] = parse_step_dir) -> list[int]:
    """The committed steps under ``root``, ascending (one listing)."""
    return sorted(commit_times(root, parse))


def commit_times(root: Storage, parse: Callable[[str], int | None] = parse_step_dir) -> dict[int, float | None]:
    """The committed steps under ``root`` with the modification time of their
    ``.metadata`` (None where the backend gives none), one listing.
    ``parse``: a directory name's step, or None for foreign names (another
    framework's layout, e.g. torchtitan's ``step-N``)."""
    steps: dict[int, float | None] = {}
    for obj in root.list():
        directory, name = posixpath.split(obj["path"])
        if name == METADATA and "/" not in directory:
            step = parse(directory)
            if step is not None:
                steps[step] = obj.get("mtime")
    return steps


def is_committed(root: Storage, step: int) -> bool:
    return root.exists(f"{step_dir(step)}/{METADATA}")


def read_pointer(root: Storage) -> int | None:
    """The step in ``root/latest`` (a hint), or None."""
    try:
        text = read_capped(root, LATEST, SMALL_FILE_LIMIT).decode("ascii", "replace").strip()
    except CheckpointError:  # missing, unreadable, or too large to be a step number
        return None
    return int(text) if text.isdigit() else None


def write_pointer(root: Storage, step: int) -> None:
    """Point ``root/latest`` at ``step``. Best effort: the step is committed
    already and the pointer is only a hint."""
    try:
        root.put(LATEST, f"{step}\n".encode())
    except CheckpointError as e:
        log.warning("could not update %s: %s", root.describe(LATEST), e)


def delete_step(root: Storage, step: int) -> None:
    """Delete ``step``: see :func:`delete_checkpoint`."""
    delete_checkpoint(root, step_dir(step))


def delete_checkpoint(root: Storage, name: str = "") -> None:
    """Delete the checkpoint directory ``name`` under ``root`` (``""``: the
    checkpoint ``root`` is): ``.metadata`` first, so a crash mid-delete
    leaves an uncommitted directory (never listed, removable by gc), never
    a committed-looking partial one."""
    root.delete([f"{name}/{METADATA}" if name else METADATA])
    rest = [o["path"] for o in root.list(f"{name}/" if name else "")]
    if rest:
        root.delete(rest)


def retire(root: Storage, committed: int, keep: int) -> None:
    """Retention after ``committed`` is committed: keep it and the ``keep - 1``
    newest committed steps below it, delete the other committed steps below
    it. Steps newer than ``committed`` and uncommitted directories are never
    touched. Best effort: failures are logged, never raised (the save is
    committed)."""
    candidates = [s for s in committed_steps(root) if s <= committed]
    for step in candidates[:-keep]:
        try:
            delete_step(root, step)
        except CheckpointError as e:
            log.warning("retention could not delete step %d under %s: %s", step, root.uri, e)
        else:
            log.info("retention deleted step %d under %s (keep=%d)", step, root.uri, keep)
