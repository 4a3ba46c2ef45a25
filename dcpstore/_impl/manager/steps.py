"""Step-numbered checkpoints under one root, on any :class:`Storage`.

Layout (:data:`DCPSTORE`, the default)::

    root/step_00000100/.metadata + data files + manifest (format.layout's names)
    root/step_00000200/...
    root/latest                 "200\\n": a hint, written after the commit

or Megatron-Bridge's (:data:`BRIDGE`; what Bridge and Megatron-LM write and
resume from)::

    root/iter_0000100/...       the same checkpoint inside
    root/latest_checkpointed_iteration.txt   "200": the tracker, after the commit

A :class:`StepLayout` is the one place those names live; every function
here takes one (default :data:`DCPSTORE`).

**The listing is the truth.** A step exists once ``<prefix><digits>/.metadata``
is listed (``.metadata`` is the commit, written last by the DCP writer);
:func:`committed_steps` reads the listing and ignores the pointer, so a
crash between the commit and the pointer update (or a pointer left by
another job) can never send a resume to a missing or partial step. The
pointer exists for humans and for tools that read one file (Bridge's resume
reads its tracker). Directories that do not parse as the layout's step
directories (exactly the canonical, zero-padded spelling) are ignored, and
so are the files beside the checkpoint that other tools keep in a step
directory (Bridge's ``train_state.pt``, ``run_config.yaml``).

Each function takes the root's :class:`Storage`, so the same naming,
listing and deletion serve any root a manager keeps steps under. A step is
deleted as the commit protocol deletes any committed checkpoint
(:func:`~dcpstore._impl.dcp.commit.uncommit.delete_checkpoint`).
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass

from dcpstore._impl.dcp.commit import delete_checkpoint
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.format.manifest import SMALL_FILE_LIMIT, read_capped
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import CheckpointError, InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLayout:
    """How a root names its step directories and its pointer file.

    ``shadows``: pointer files another tool reads *before* :attr:`pointer`
    (Bridge's resume prefers ``latest_train_state.pt`` to its tracker);
    updating the pointer removes them, so that they never send a resume to
    an older step than the one just committed.
    """

    name: str
    prefix: str
    digits: int
    pointer: str
    shadows: tuple[str, ...] = ()
    #: The pointer's text ends with a newline (Bridge's tracker does not).
    newline: bool = True

    def step_dir(self, step: int) -> str:
        """The directory name of ``step``: ``step_00000100`` / ``iter_0000100``."""
        return f"{self.prefix}{check_step(step):0{self.digits}d}"

    def parse_step_dir(self, name: str) -> int | None:
        """The step a directory name denotes, or ``None`` for foreign names.

        Only the canonical spelling counts (``step_00000100``, not
        ``step_100`` or ``step_000000100``), so every step has exactly one
        directory.
        """
        prefix, digits = self.prefix, name[len(self.prefix) :]
        if not name.startswith(prefix) or len(digits) < self.digits or not (digits.isascii() and digits.isdigit()):
            return None
        step = int(digits)
        return step if self.step_dir(step) == name else None

    def pointer_text(self, step: int) -> bytes:
        return (f"{step}\n" if self.newline else str(step)).encode()


#: dcpstore's own layout: ``step_00000100/`` and ``latest``.
DCPSTORE = StepLayout("dcpstore", "step_", 8, "latest")
#: Megatron-Bridge's (and Megatron-LM's): ``iter_0000100/`` and the tracker
#: ``latest_checkpointed_iteration.txt`` (``get_checkpoint_name`` and
#: ``get_checkpoint_tracker_filename`` in Bridge's ``checkpoint_utils``).
BRIDGE = StepLayout(
    "bridge", "iter_", 7, "latest_checkpointed_iteration.txt", shadows=("latest_train_state.pt",), newline=False
)
#: The layouts by name (``CheckpointManager(layout=...)``).
LAYOUTS = {layout.name: layout for layout in (DCPSTORE, BRIDGE)}

STEP_PREFIX = DCPSTORE.prefix
STEP_DIGITS = DCPSTORE.digits
LATEST = DCPSTORE.pointer


def check_layout(layout: object) -> StepLayout:
    """A :class:`StepLayout`, or the name of one in :data:`LAYOUTS`."""
    if isinstance(layout, StepLayout):
        return layout
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    raise InvalidArgument(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")


def check_step(step: object) -> int:
    """A step is a non-negative int (bools are refused)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidArgument(f"step must be a non-negative int, got {step!r}")
    return step


def step_dir(step: int) -> str:
    """The directory name of ``step`` in the default layout: ``step_00000100``."""
    return DCPSTORE.step_dir(step)


def parse_step_dir(name: str) -> int | None:
    """The step a default-layout directory name denotes, or ``None``."""
    return DCPSTORE.parse_step_dir(name)


def committed_steps(root: Storage, layout: StepLayout = DCPSTORE) -> list[int]:
    """The committed steps under ``root``, ascending (one listing)."""
    return sorted(commit_times(root, layout))


def commit_times(root: Storage, layout: StepLayout = DCPSTORE) -> dict[int, float | None]:
    """The committed steps under ``root`` with the modification time of their
    ``.metadata`` (None where the backend gives none), one listing."""
    steps: dict[int, float | None] = {}
    for obj in root.list():
        directory, name = posixpath.split(obj["path"])
        if name == METADATA and "/" not in directory:
            step = layout.parse_step_dir(directory)
            if step is not None:
                steps[step] = obj.get("mtime")
    return steps


def is_committed(root: Storage, step: int, layout: StepLayout = DCPSTORE) -> bool:
    return root.exists(f"{layout.step_dir(step)}/{METADATA}")


def read_pointer(root: Storage, layout: StepLayout = DCPSTORE) -> int | None:
    """The step the layout's pointer names (a hint), or None."""
    try:
        text = read_capped(root, layout.pointer, SMALL_FILE_LIMIT).decode("ascii", "replace").strip()
    except CheckpointError:  # missing, unreadable, or too large to be a step number
        return None
    return int(text) if text.isdigit() else None


def write_pointer(root: Storage, step: int, layout: StepLayout = DCPSTORE) -> None:
    """Point the layout's pointer at ``step`` and remove the pointers that
    would shadow it (:attr:`StepLayout.shadows`). Best effort: the step is
    committed already and the pointer is only a hint."""
    try:
        root.put(layout.pointer, layout.pointer_text(step))
        stale = [name for name in layout.shadows if root.exists(name)]
        if stale:
            root.delete(stale)
            log.info("removed %s under %s: it would send a resume past step %d", ", ".join(stale), root.uri, step)
    except CheckpointError as e:
        log.warning("could not update %s: %s", root.describe(layout.pointer), e)


def delete_step(root: Storage, step: int, layout: StepLayout = DCPSTORE) -> None:
    """Delete ``step``, ``.metadata`` first (:mod:`dcpstore._impl.dcp.commit.uncommit`)."""
    delete_checkpoint(root, layout.step_dir(step))


def retire(root: Storage, committed: int, keep: int, layout: StepLayout = DCPSTORE) -> None:
    """Retention after ``committed`` is committed: keep it and the ``keep - 1``
    newest committed steps below it, delete the other committed steps below
    it. Steps newer than ``committed`` and uncommitted directories are never
    touched. Best effort: failures are logged, never raised (the save is
    committed)."""
    candidates = [s for s in committed_steps(root, layout) if s <= committed]
    for step in candidates[:-keep]:
        try:
            delete_step(root, step, layout)
        except CheckpointError as e:
            log.warning("retention could not delete step %d under %s: %s", step, root.uri, e)
        else:
            log.info("retention deleted step %d under %s (keep=%d)", step, root.uri, keep)
