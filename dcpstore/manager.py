"""Step-numbered checkpoints under one root: :class:`CheckpointManager`.

Layout, on any backend (only the :class:`~dcpstore.storage.Storage`
interface is used, so local paths, ``s3://`` and ``msc://`` roots behave the
same)::

    root/step_00000100/.metadata + __*_*.distcp + .dcpstore.json
    root/step_00000200/...
    root/latest                 "200\\n": a hint, written after the commit

**The listing is the truth.** A step exists once ``step_<8+ digits>/.metadata``
is listed (``.metadata`` is the commit, written last by the DCP writer);
:meth:`CheckpointManager.all_steps`, :meth:`~CheckpointManager.latest_step`
and :meth:`~CheckpointManager.load` read the listing and ignore the
``latest`` pointer, so a crash between the commit and the pointer update (or
a pointer left by another job) can never send a resume to a missing or
partial step. The pointer exists for humans and tools that want one read;
it names the step this job committed last. Directories that do not parse as
``step_NNNNNNNN`` (exactly the canonical, zero-padded spelling) are ignored.

Call order of one save (every rank calls ``save`` with the same step)::

    save(step, sd)
      1. finish the previous save: wait for it, then (rank 0) write the
         pointer and apply retention; its error, if any, is raised here
      2. refuse to overwrite a committed step unless overwrite=True
      3. dcpstore.save(sd, root/step_..., async_=...)  -> SaveHandle
      4. sync saves: finish now (same as 1). Async saves finish at the next
         save(), wait(), load() or close() -- at the latest at interpreter
         exit, even if the manager was dropped without close().

Retention (``keep=K``) runs on rank 0 only, only after a save is committed,
and only over *committed* steps no newer than the one just committed: it
keeps that step and the K-1 newest committed steps below it and deletes the
rest. Steps newer than the one just committed (another timeline, or a save
still in flight) and uncommitted directories are never touched (``dcpstore
gc`` removes the leftovers of interrupted saves). Megatron-Bridge PR #4678
is the bug this ordering rules out: retention that ran when an async save
was *scheduled* deleted the only complete checkpoint. A step is deleted
``.metadata`` first, so a crash mid-delete leaves an uncommitted directory,
never a committed-looking partial one.
"""

from __future__ import annotations

import atexit
import logging
import os
import posixpath
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

from .api import CheckpointInfo, SaveHandle, load, save
from .errors import CheckpointError, CheckpointNotFound, InvalidArgument, SaveError
from .options import check_save_options, engine_problem
from .storage import Storage, StorageOptions, join_uri, open_storage
from .format.manifest import SMALL_FILE_LIMIT, read_capped
from .writers.layout import METADATA

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


# -- interpreter exit ------------------------------------------------------------
# Managers still open at exit are closed, finishing the save in flight. The
# hook must run *before* concurrent.futures refuses new work (its
# _python_exit runs among threading's exit callbacks, before atexit's), or a
# background save that still has files to submit dies with "cannot schedule
# new futures after interpreter shutdown". Hence threading's exit callbacks
# where this Python has them (3.9+), atexit otherwise.
_OPEN: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
_IN_FLIGHT: set[CheckpointManager] = set()  # strong refs: a dropped manager still finishes
_hook_lock = threading.Lock()
_hook_installed = False


def _close_all_at_exit() -> None:
    for mgr in [*_IN_FLIGHT, *_OPEN]:
        mgr._close_at_exit()


def _install_exit_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading exit callbacks")
            register(_close_all_at_exit)
        except RuntimeError:  # older Python, or already shutting down
            atexit.register(_close_all_at_exit)
        _hook_installed = True


@dataclass(frozen=True)
class SavedStep:
    """One save this manager finished: the step and what the save reported."""

    step: int
    info: CheckpointInfo


@dataclass
class _Pending:
    step: int
    handle: SaveHandle


class CheckpointManager:
    """Step-numbered checkpoints under ``root_uri``; see the module docstring.

    Every rank constructs it with the same arguments and calls ``save`` /
    ``load`` together (SPMD, like :func:`dcpstore.save`). ``async_``,
    ``workers``, ``enable_msc``, ``engine``, ``process_group``, ``planner``
    and ``storage_options`` are passed through to :func:`dcpstore.save` /
    :func:`dcpstore.load`; they are validated here, once, against the same
    table ``save`` uses (:mod:`dcpstore.options`).

    At most one save is in flight: ``save`` first finishes the previous one.
    ``close()`` (also run at interpreter exit, and by ``with``) finishes the
    last one, so no save is lost.
    """

    def __init__(
        self,
        root_uri: str | os.PathLike[str],
        *,
        keep: int | None = None,
        async_: bool = True,
        workers: int | None = None,
        enable_msc: bool = False,
        engine: str = "auto",
        process_group: dist.ProcessGroup | None = None,
        planner: SavePlanner | None = None,
        storage_options: StorageOptions | None = None,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidArgument(f"keep must be None (keep all) or an int >= 1, got {keep!r}")
        check_save_options(async_=async_, engine=engine, workers=workers, planner=planner)
        if process_group is not None and not dist.is_initialized():
            raise InvalidArgument("process_group was given but torch.distributed is not initialised")
        self.root_uri = os.fspath(root_uri)
        self.keep = keep
        self.async_ = async_
        self.engine = engine
        self.planner = planner
        self._io: dict[str, Any] = {
            "workers": workers,
            "enable_msc": enable_msc,
            "process_group": process_group,
            "storage_options": storage_options,
        }
        self._storage: Storage = open_storage(self.root_uri, enable_msc=enable_msc, storage_options=storage_options)
        problem = engine_problem(engine, self._storage)
        if problem:
            self._storage.close()
            raise InvalidArgument(problem)
        self._pending: _Pending | None = None
        self._closed = False
        #: Saves this manager finished, oldest first (committed ones only).
        self.history: list[SavedStep] = []
        _install_exit_hook()
        _OPEN.add(self)

    # -- naming and listing -------------------------------------------------
    @property
    def uri(self) -> str:
        """The root, safe to print."""
        return self._storage.uri

    @property
    def io_kwargs(self) -> dict[str, Any]:
        """The keyword arguments this manager passes to save and load."""
        return dict(self._io)

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 of the process group (or the only process): the one that
        writes the pointer and deletes retired steps."""
        if not (dist.is_available() and dist.is_initialized()):
            return True
        return dist.get_rank(self._io["process_group"]) == 0

    def step_uri(self, step: int) -> str:
        """The URI of ``step``'s checkpoint (committed or not)."""
        return join_uri(self.root_uri, step_dir(step))

    def all_steps(self) -> list[int]:
        """Committed steps, ascending. Reads the listing (never the pointer)."""
        steps = set()
        for obj in self._storage.list():
            directory, name = posixpath.split(obj["path"])
            if name == METADATA and "/" not in directory:
                step = parse_step_dir(directory)
                if step is not None:
                    steps.add(step)
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def read_pointer(self) -> int | None:
        """The step in ``root/latest`` (a hint; see the module docstring)."""
        try:
            text = read_capped(self._storage, LATEST, SMALL_FILE_LIMIT).decode("ascii", "replace").strip()
        except CheckpointError:  # missing, unreadable, or too large to be a step number
            return None
        return int(text) if text.isdigit() else None

    # -- saving -------------------------------------------------------------
    def save(self, step: int, state_dict: dict[str, Any], *, overwrite: bool = False) -> SaveHandle:
        """Save ``state_dict`` as ``step``; returns the save's handle.

        Refuses a step that is already committed unless ``overwrite=True``:
        replacing it retracts the old commit before the new data is written,
        so a crash mid-save would lose that step.
        """
        self._check_open()
        step = check_step(step)
        self._finish_pending()
        uri = self.step_uri(step)
        if not overwrite and self._storage.exists(f"{step_dir(step)}/{METADATA}"):
            raise InvalidArgument(
                f"step {step} is already committed at {self._storage.describe(step_dir(step))}; "
                "pass overwrite=True to replace it"
            )
        handle = save(state_dict, uri, async_=self.async_, engine=self.engine, planner=self.planner, **self._io)
        self._pending = _Pending(step, handle)
        _IN_FLIGHT.add(self)
        if handle.done():
            self._finish_pending()
        return handle

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed and finished;
        re-raise its error. Returns its info, or ``None`` if none was pending."""
        return self._finish_pending(timeout)

    def _finish_pending(self, timeout: float | None = None) -> CheckpointInfo | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if timeout is None and not pending.handle._wait_bounded():
            # Presumed hung: never block the next save, close() or exit on it
            # forever (Megatron-LM #2422); it stays the save in flight.
            self._pending = pending
            raise SaveError(
                f"the save of step {pending.step} to {pending.handle.uri} has been running for more than "
                f"hang_timeout={pending.handle.hang_timeout:g} s and is presumed hung (a storage call that "
                f"does not return); step {pending.step} is not committed and the newest committed step is "
                "untouched. 'dcpstore gc ROOT' removes its leftovers"
            )
        try:
            info = pending.handle.result(timeout)
        except TimeoutError:
            self._pending = pending  # still in flight; keep tracking it
            raise
        finally:
            if self._pending is None:
                _IN_FLIGHT.discard(self)
        self.history.append(SavedStep(pending.step, info))
        if self.is_coordinator:
            self._write_pointer(pending.step)
            self._apply_retention(pending.step)
        return info

    def _write_pointer(self, step: int) -> None:
        try:
            self._storage.put(LATEST, f"{step}\n".encode())
        except CheckpointError as e:  # the step is committed; the pointer is only a hint
            log.warning("could not update %s: %s", self._storage.describe(LATEST), e)

    def _apply_retention(self, committed: int) -> None:
        if self.keep is None:
            return
        candidates = [s for s in self.all_steps() if s <= committed]
        for step in candidates[: -self.keep]:
            try:
                self._delete_step(step)
            except CheckpointError as e:  # retention must never fail a committed save
                log.warning("retention could not delete step %d under %s: %s", step, self.uri, e)
            else:
                log.info("retention deleted step %d under %s (keep=%d)", step, self.uri, self.keep)

    def _delete_step(self, step: int) -> None:
        name = step_dir(step)
        # Un-commit first: a crash mid-delete then leaves an uncommitted
        # directory (never listed, removable by gc), not a partial checkpoint.
        self._storage.delete([f"{name}/{METADATA}"])
        rest = [o["path"] for o in self._storage.list(f"{name}/")]
        if rest:
            self._storage.delete(rest)

    # -- loading ------------------------------------------------------------
    def resolve_step(self, step: int | None = None) -> int:
        """``step`` itself, or the newest committed step if ``None``.

        With torch.distributed initialised, rank 0 lists and broadcasts its
        answer, so every rank loads the same step even if a commit lands
        between their listings. Raises :class:`CheckpointNotFound` if there
        is no committed step.
        """
        if step is not None:
            return check_step(step)
        found = self.latest_step() if self.is_coordinator else None
        if dist.is_available() and dist.is_initialized():
            group = self._io["process_group"]
            box: list[int | None] = [found]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            found = box[0]
        if found is None:
            raise CheckpointNotFound(f"no committed checkpoint under {self.uri} (no {STEP_PREFIX}*/{METADATA})")
        return found

    def load(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        *,
        safe_globals: Sequence[Any] | None = None,
        trusted: bool = False,
    ) -> int:
        """Load ``step`` (default: the newest committed) into ``state_dict``
        in place, resharding as :func:`dcpstore.load` does. Returns the step.
        ``safe_globals`` / ``trusted``: as :func:`dcpstore.load` (what a
        non-tensor item may hold beyond the allowlist)."""
        self._check_open()
        self._finish_pending()
        resolved = self.resolve_step(step)
        load(state_dict, self.step_uri(resolved), safe_globals=safe_globals, trusted=trusted, **self._io)
        return resolved

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        """Finish the save in flight, then release the storage. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self._finish_pending()
        finally:
            self._storage.close()

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except Exception as e:  # nobody is left to catch it; say what was lost
            log.error("dcpstore: the last save under %s failed at exit: %s", self.uri, e)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"this CheckpointManager for {self.uri} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not mask the body's exception with the close's
            self.close()
        except Exception as close_error:
            log.error("closing the CheckpointManager for %s also failed: %s", self.uri, close_error)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.uri!r}, keep={self.keep}, async_={self.async_})"
