"""Step-numbered checkpoints under one root: :class:`CheckpointManager`.

Steps are named, listed, pointed at and deleted by :mod:`.steps` (on any
backend: only the :class:`~dcpstore.storage.Storage` interface is used, so
local paths, ``s3://`` and ``msc://`` roots behave the same); the listing,
never the ``latest`` pointer, decides which steps exist. Each save is a
:func:`dcpstore.save` with the manager's one
:class:`~dcpstore.options.SaveOptions`.

Call order of one save (every rank calls ``save`` with the same step)::

    save(sd, step)
      1. finish the previous save: wait for it, then (rank 0) write the
         pointer and apply retention; its error, if any, is raised here
      2. refuse to overwrite a committed step unless overwrite=True
         (CheckpointExists; the save refuses too, should one land meanwhile)
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

Layer: manager. Imports the front door :mod:`dcpstore.api`, the engines'
exit hook and engine check, the value objects, :mod:`dcpstore.storage` and
the foundation.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, overload

from typing_extensions import deprecated

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

from ..api import load_with, save_with
from ..engines import exit as exit_hook
from ..engines.choice import engine_problem
from ..errors import CheckpointExists, CheckpointNotFound, InvalidArgument, SaveError
from ..format.layout import METADATA
from ..handle import CheckpointInfo, SaveHandle
from ..keywords import hint_keywords
from ..options import SaveOptions
from ..quiet import user_stacklevel
from ..storage import Storage, StorageOptions, join_uri, open_storage
from .steps import STEP_PREFIX, check_step, committed_steps, is_committed, read_pointer, retire, step_dir, write_pointer

log = logging.getLogger(__name__)


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
    ``load`` together (SPMD, like :func:`dcpstore.save`)::

        mgr = dcpstore.CheckpointManager("s3://bucket/run1", keep=3)
        mgr.save(state, step)          # async by default
        step = mgr.load(state)         # the newest committed step
        mgr.close()

    At most one save is in flight: ``save`` first finishes the previous one
    (and raises its error). ``close()`` (also run at interpreter exit, and by
    ``with``) finishes the last one, so no save is lost silently.

    Args:
        root_uri: the root the steps live under (any URI :func:`dcpstore.save`
            takes).
        keep: keep the newest ``keep`` committed steps, deleting older ones
            after each commit (rank 0; ``None``: keep all).
        async_: save in the background (default ``True``).
        workers, enable_msc, engine, process_group, planner,
            storage_options, progress: :func:`dcpstore.save`'s, validated
            here, once, into one :class:`~dcpstore.options.SaveOptions` used
            for every save (and, its I/O part, every load).
        options: a :class:`~dcpstore.options.SaveOptions` instead of those
            keywords (for a layer that already holds one); the keywords must
            then be left at their defaults.

    Raises:
        InvalidArgument: a bad option, both ``options=`` and option
            keywords, or an engine that cannot write ``root_uri``.
        InvalidURI, BackendUnavailable: as for :func:`dcpstore.save`.
    """

    @hint_keywords
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
        progress: bool = False,
        options: SaveOptions | None = None,
    ) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidArgument(f"keep must be None (keep all) or an int >= 1, got {keep!r}")
        from_keywords = SaveOptions(
            async_=async_,
            engine=engine,
            workers=workers,
            enable_msc=enable_msc,
            storage_options=storage_options,
            process_group=process_group,
            planner=planner,
            progress=progress,
        )
        if options is not None and from_keywords != _DEFAULTS:
            raise InvalidArgument("pass the save options either as options= or as keywords, not both")
        self.options = options if options is not None else from_keywords
        self.root_uri = os.fspath(root_uri)
        self.keep = keep
        self._storage: Storage = open_storage(
            self.root_uri, enable_msc=self.options.enable_msc, storage_options=self.options.storage_options
        )
        problem = engine_problem(self.options.engine, self._storage.backend, self._storage.uri)
        if problem:
            self._storage.close()
            raise InvalidArgument(problem)
        self._pending: _Pending | None = None
        self._closed = False
        #: Saves this manager finished, oldest first (committed ones only).
        self.history: list[SavedStep] = []
        exit_hook.watch(self, exit_hook.Stage.MANAGERS)

    # -- naming and listing -------------------------------------------------
    @property
    def uri(self) -> str:
        """The root, safe to print."""
        return self._storage.uri

    @property
    def async_(self) -> bool:
        return self.options.async_

    @property
    def engine(self) -> str:
        return self.options.engine

    @property
    def planner(self) -> SavePlanner | None:
        return self.options.planner

    @property
    def io_kwargs(self) -> dict[str, Any]:
        """The keyword arguments this manager passes to save and load."""
        o = self.options
        return {
            "workers": o.workers,
            "enable_msc": o.enable_msc,
            "process_group": o.process_group,
            "storage_options": o.storage_options,
        }

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 of the process group (or the only process): the one that
        writes the pointer and deletes retired steps."""
        if not (dist.is_available() and dist.is_initialized()):
            return True
        return dist.get_rank(self.options.process_group) == 0

    def step_uri(self, step: int) -> str:
        """The URI of ``step``'s checkpoint (committed or not)."""
        return join_uri(self.root_uri, step_dir(step))

    def all_steps(self) -> list[int]:
        """Committed steps, ascending. Reads the listing (never the pointer)."""
        return committed_steps(self._storage)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def read_pointer(self) -> int | None:
        """The step in ``root/latest`` (a hint; see the module docstring)."""
        return read_pointer(self._storage)

    # -- saving -------------------------------------------------------------
    @overload
    def save(self, state_dict: dict[str, Any], step: int, *, overwrite: bool = False) -> SaveHandle: ...

    @overload
    @deprecated("CheckpointManager.save(step, state_dict) is deprecated: pass the state first, save(state_dict, step)")
    def save(self, state_dict: int, step: dict[str, Any], *, overwrite: bool = False) -> SaveHandle: ...

    @hint_keywords
    def save(
        self, state_dict: dict[str, Any] | int, step: int | dict[str, Any], *, overwrite: bool = False
    ) -> SaveHandle:
        """Save ``state_dict`` as ``step`` (every rank, with the same step).

        The state comes first, as in :func:`dcpstore.save` and :meth:`load`.
        The older order ``save(step, state_dict)`` still works and warns
        (:class:`DeprecationWarning`); the two are told apart by type (an int
        step, a dict state).

        Args:
            state_dict: this rank's state (a dict, as for :func:`dcpstore.save`).
            step: the step number, an int >= 0; the checkpoint goes to
                ``root/step_{step:08d}``.
            overwrite: replace a step that is already committed (saving a
                step twice is usually a bug). A replaced step loads as the
                old save until the new one is committed, and as the new one
                after; a failed or killed save leaves the old one.

        Returns:
            The save's handle (already done for a sync manager).

        Raises:
            SaveError: the previous save (finished first) or this one failed,
                or an earlier async save on the same saver failed unobserved.
            CheckpointExists: the step is already committed and
                ``overwrite`` is False (a ``SaveError`` and a ``FileExistsError``).
            InvalidArgument: a bad step, or a closed manager.
        """
        if _is_step(state_dict) and isinstance(step, dict):
            warnings.warn(
                "CheckpointManager.save(step, state_dict) is deprecated: pass the state first, "
                "save(state_dict, step), as dcpstore.save(state_dict, uri) and load(state_dict, step) do",
                DeprecationWarning,
                stacklevel=user_stacklevel(),
            )
            state_dict, step = step, state_dict
        if not isinstance(state_dict, dict):
            raise InvalidArgument(
                f"CheckpointManager.save(state_dict, step): state_dict must be a dict, got {type(state_dict).__name__}"
            )
        self._check_open()
        step = check_step(step)
        self._finish_pending()
        if not overwrite and is_committed(self._storage, step):
            raise CheckpointExists(
                f"Checkpoint already exists: step {step} is committed at {self._storage.describe(step_dir(step))}; "
                "pass overwrite=True to replace it"
            )
        # The save itself refuses too, should the step be committed meanwhile.
        options = self.options if overwrite == self.options.overwrite else replace(self.options, overwrite=overwrite)
        handle = save_with(state_dict, self.step_uri(step), options)
        self._pending = _Pending(step, handle)
        exit_hook.hold(self, exit_hook.Stage.MANAGERS)
        if handle.done():
            self._finish_pending()
        return handle

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed and finished
        (pointer written, retention applied).

        Args:
            timeout: seconds to wait at most (``None``: until it finishes, or
                until the saver presumes it hung).

        Returns:
            Its info, or ``None`` if no save was in flight.

        Raises:
            SaveError: the save failed, or is presumed hung.
            TimeoutError: still running after ``timeout`` seconds (it stays
                in flight).
        """
        return self._finish_pending(timeout)

    def _finish_pending(self, timeout: float | None = None) -> CheckpointInfo | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if timeout is None and not pending.handle.wait_bounded():
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
                exit_hook.release(self)
        self.history.append(SavedStep(pending.step, info))
        if self.is_coordinator:
            self._write_pointer(pending.step)
            if self.keep is not None:
                retire(self._storage, pending.step, self.keep)
        return info

    def _write_pointer(self, step: int) -> None:
        write_pointer(self._storage, step)

    # -- loading ------------------------------------------------------------
    def resolve_step(self, step: int | None = None) -> int:
        """``step`` itself, or the newest committed step if ``None``.

        With torch.distributed initialised, rank 0 lists and broadcasts its
        answer (every rank calls this), so every rank loads the same step even
        if a commit lands between their listings.

        Returns:
            The step, the same on every rank.

        Raises:
            CheckpointNotFound: ``step`` is ``None`` and no step is committed.
            InvalidArgument: ``step`` is not an int >= 0.
        """
        if step is not None:
            return check_step(step)
        found = self.latest_step() if self.is_coordinator else None
        if dist.is_available() and dist.is_initialized():
            group = self.options.process_group
            box: list[int | None] = [found]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
            found = box[0]
        if found is None:
            raise CheckpointNotFound(f"no committed checkpoint under {self.uri} (no {STEP_PREFIX}*/{METADATA})")
        return found

    @hint_keywords
    def load(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        *,
        safe_globals: Sequence[Any] | None = None,
        trusted: bool = False,
    ) -> int:
        """Load ``step`` into ``state_dict`` in place, resharding as
        :func:`dcpstore.load` does (every rank calls it). The save in flight,
        if any, is finished first.

        Args:
            state_dict: the state to fill, as for :func:`dcpstore.load`.
            step: the step to load (default: the newest committed one).
            safe_globals: as for :func:`dcpstore.load` (classes a non-tensor
                item may hold beyond the allowlist).
            trusted: as for :func:`dcpstore.load`.

        Returns:
            The step loaded.

        Raises:
            CheckpointNotFound: no such committed step (or none at all).
            SaveError: the save in flight, finished first, failed.
            CheckpointCorrupt, UnsafeCheckpoint, LoadError, StorageError: as
                for :func:`dcpstore.load`.
        """
        self._check_open()
        self._finish_pending()
        resolved = self.resolve_step(step)
        options = self.options.for_load(safe_globals=safe_globals or (), trusted=trusted)
        load_with(state_dict, self.step_uri(resolved), options)
        return resolved

    # -- lifetime -----------------------------------------------------------
    def close(self) -> None:
        """Finish the save in flight, then release the storage. Idempotent.

        Raises:
            SaveError: the save in flight failed (the storage is released
                anyway).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_pending()
        finally:
            exit_hook.forget(self)
            self._storage.close()

    def finish_at_exit(self) -> None:
        """Interpreter exit: :meth:`close`, saying loudly what was lost if it
        fails (the exit status is left alone: see the README's "Async saves")."""
        try:
            self.close()
        except Exception as e:  # nobody is left to catch it
            log.error(
                "dcpstore: at interpreter exit: the last save under %s FAILED; it is not committed, and the "
                "newest committed step is untouched. %s",
                self.uri,
                e,
                exc_info=e,
            )

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


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: A manager's options when none of the option keywords is given.
_DEFAULTS = SaveOptions(async_=True)
