"""Step-numbered checkpoints under one root: :class:`CheckpointManager`.

Steps are named, listed, pointed at and deleted by :mod:`.steps` (on any
backend: only the :class:`~dcpstore.storage.Storage` interface is used, so
local paths, ``s3://`` and ``msc://`` roots behave the same); the listing,
never the ``latest`` pointer, decides which steps exist. Each save is a
:func:`dcpstore.save` with the manager's one
:class:`~dcpstore._impl.values.options.SaveOptions`.

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

Where the steps live is a :class:`~.roots.Roots`: one root
(:class:`~.roots.OneRoot`), or with ``local_dir=`` a local tier that saves
commit to and a durable tier that steps are replicated to in the background
(:class:`~.tiers.TieredRoots`; retention per tier, loads from the nearest
whole copy). The manager only delegates to it.

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

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

from dcpstore._impl.api import load_with, save_with
from dcpstore._impl.engines import exit as exit_hook
from dcpstore._impl.engines.saver import default_saver
from dcpstore._impl.engines.selection import engine_problem
from dcpstore._impl.manager.roles import OPEN
from dcpstore._impl.manager.roots import REPLICATE_TIMEOUT_S, OneRoot, Roots
from dcpstore._impl.manager.steps import StepLayout, check_layout, check_step
from dcpstore._impl.storage import Storage, join_uri, open_storage
from dcpstore._impl.storage.overlap import Role
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointExists, InvalidArgument, InvalidURI, SaveError
from dcpstore._impl.util.keyword_hints import hint_keywords, hint_keywords_with
from dcpstore._impl.values.keywords import pass_whole, resolve_options
from dcpstore._impl.values.options import SaveOptions
from dcpstore._impl.values.results import CheckpointInfo, SaveHandle

log = logging.getLogger(__name__)


#: A manager's options when none is given.
_DEFAULTS = SaveOptions(async_=True)


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
        async_: save in the background (default ``True``; with
            ``options``, ``options.async_``).
        options: how every save runs (and, its I/O part, every load): one
            :class:`~dcpstore.SaveOptions`, used as it is (default:
            ``SaveOptions(async_=True)``). Its ``save_id`` must be ``None``.
        local_dir: make the manager tiered: saves commit to
            ``local_dir/step_N`` (the handle completes there) and are
            replicated to ``root_uri/step_N`` in the background; loads read
            the nearest whole copy (:mod:`dcpstore._impl.manager.tiers`). A local
            path the whole job shares.
        local_keep: the local tier's retention (``keep`` is then the durable
            tier's; ``None``: keep all). Needs ``local_dir``.
        local_storage_options: how the local tier is written and read, a
            :class:`~dcpstore.StorageOptions` (``options.storage_options``
            are the durable root's): ``StorageOptions(direct_io=True)``
            sends the local tier's large tensors past the page cache, for a
            node's NVMe (see ``direct_io``). Default: plain local I/O. Its
            ``enable_msc`` must stay False. Needs ``local_dir``.
        replicate_every: replicate only steps divisible by this (default 1:
            every step). Needs ``local_dir``.
        replicate_timeout_s: bounds one step's replication and ``close()``'s
            wait for them.
        local_replicas: with one ``local_dir`` per node, how many nodes hold
            each node's share of a step: its own and ``local_replicas - 1``
            peers', so a job that lost a node resumes from its peers
            (:mod:`dcpstore._impl.manager.tiers.peers`; default 1: no copies).
        replica_jump: node ``i``'s copies go to nodes ``i + k * replica_jump``
            (mod the node count), ``k = 1 .. local_replicas - 1``: a jump
            of a rack's node count puts them in other racks (default 1).
        layout: how steps and the pointer are named: ``"dcpstore"``
            (``step_00000100/``, ``latest``) or ``"bridge"``
            (Megatron-Bridge's ``iter_0000100/`` and its tracker
            ``latest_checkpointed_iteration.txt``, so Bridge resumes from
            this manager's steps and this manager from Bridge's); a
            :class:`~dcpstore._impl.manager.steps.StepLayout`. Not with ``local_dir``.

    Raises:
        InvalidArgument: a bad option, a keyword that disagrees with
            ``options``, an engine that cannot write ``root_uri``, or a
            ``local_dir`` that is not a local path.
        TypeError: a keyword it does not take (naming the likely fix: a
            save option goes in ``options``).
        CheckpointError: (tiered) ``root_uri`` cannot be reached.
        InvalidURI, BackendUnavailable: as for :func:`dcpstore.save`.
    """

    @hint_keywords_with(pass_whole(_DEFAULTS))
    def __init__(
        self,
        root_uri: str | os.PathLike[str],
        *,
        keep: int | None = None,
        async_: bool | None = None,
        options: SaveOptions | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        local_keep: int | None = None,
        local_storage_options: StorageOptions | None = None,
        replicate_every: int = 1,
        replicate_timeout_s: float = REPLICATE_TIMEOUT_S,
        layout: str | StepLayout = "dcpstore",
        local_replicas: int = 1,
        replica_jump: int = 1,
    ) -> None:
        given = {} if async_ is None else {"async_": async_}
        self.options = resolve_options(CheckpointManager, options, base=_DEFAULTS, given=given)
        if self.options.save_id is not None:
            raise InvalidArgument(
                f"options.save_id={self.options.save_id!r}: a manager's saves each get their own id; leave it None"
            )
        self.layout = check_layout(layout)
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise InvalidArgument(f"keep must be None (keep all) or an int >= 1, got {keep!r}")
        if not isinstance(root_uri, (str, os.PathLike)):
            raise InvalidURI(f"root_uri must be a str or os.PathLike, got {type(root_uri).__name__}")
        self.root_uri = os.fspath(root_uri)
        self.keep = keep
        #: The local tier's storage options (the durable root's are ``options``'s).
        self._local_storage_options = local_storage_options
        self._roots = self._open_roots(
            local_dir, local_keep, replicate_every, replicate_timeout_s, (local_replicas, replica_jump)
        )
        #: What each save runs with: a tiered manager's saves go to its local tier.
        self._save_options = (
            self.options if not self.tiered else replace(self.options, storage_options=local_storage_options)
        )
        saves_to = self._roots.save_storage
        problem = engine_problem(self.options.engine, saves_to.backend, saves_to.uri)
        if problem:
            OPEN.release(self)
            self._roots.close()
            raise InvalidArgument(problem)
        self._pending: _Pending | None = None
        self._closed = False
        #: Saves this manager finished, oldest first (committed ones only).
        self.history: list[SavedStep] = []
        exit_hook.watch(self, exit_hook.Stage.MANAGERS)

    def _open_roots(
        self,
        local_dir: str | os.PathLike[str] | None,
        local_keep: int | None,
        every: int,
        timeout_s: float,
        replicas: tuple[int, int],
    ) -> Roots:
        o = self.options
        durable = open_storage(self.root_uri, storage_options=o.storage_options)
        roles = [Role("root_uri", durable, given=self.root_uri)]
        what = f"the open CheckpointManager for {durable.uri}"
        local_options = self._local_storage_options
        if local_dir is None:
            try:
                if local_keep is not None or every != 1 or replicas != (1, 1) or local_options is not None:
                    raise InvalidArgument(
                        "local_keep, local_storage_options, replicate_every, local_replicas and replica_jump "
                        "need local_dir= (a tiered manager)"
                    )
                OPEN.claim(self, what, roles)
            except BaseException:
                durable.close()
                raise
            return OneRoot(durable, self.root_uri, self.keep, self.layout)
        # The tiers (threads, a gloo group, node discovery) are imported only by a manager that has them.
        from dcpstore._impl.manager.tiers import TieredRoots, check_tier_options

        local: Storage | None = None
        try:
            if self.layout.name != "dcpstore":
                raise InvalidArgument(
                    f"layout={self.layout.name!r} is not supported with local_dir= (a tiered manager names its "
                    "steps step_NNNNNNNN in both tiers); leave local_dir out, or layout='dcpstore'"
                )
            check_tier_options(local_keep, every, timeout_s, *replicas)
            if local_options is not None and not isinstance(local_options, StorageOptions):
                raise InvalidArgument(
                    f"local_storage_options must be a dcpstore.StorageOptions or None, got {type(local_options).__name__}"
                )
            if local_options is not None and local_options.enable_msc:
                raise InvalidArgument(
                    "local_storage_options has enable_msc=True: the local tier is written by the local backend, "
                    "not through MSC; leave enable_msc out of local_storage_options"
                )
            local_uri = os.fspath(local_dir)
            local = open_storage(local_uri, storage_options=local_options)
            if local.backend != "local":
                raise InvalidArgument(f"local_dir must be a local path, got {local.uri!r} ({local.backend})")
            # One directory, one role (before anything is written: the tiers' set-up writes and replicates).
            OPEN.claim(self, what, [Role("local_dir", local, exclusive=True, given=local_uri), *roles])
            self.local_dir = local_uri
            return TieredRoots(
                durable,
                self.root_uri,
                local,
                local_uri,
                keep=self.keep,
                local_keep=local_keep,
                replicate_every=every,
                workers=o.workers or 8,
                group=o.process_group,
                timeout_s=timeout_s,
                local_replicas=replicas[0],
                replica_jump=replicas[1],
            )
        except BaseException:
            OPEN.release(self)
            if local is not None:
                local.close()
            durable.close()
            raise

    # -- naming and listing -------------------------------------------------
    @property
    def uri(self) -> str:
        """The root, safe to print."""
        return self._roots.uri

    @property
    def tiered(self) -> bool:
        return not isinstance(self._roots, OneRoot)

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
        if not is_distributed():
            return True
        return dist.get_rank(self.options.process_group) == 0

    def step_uri(self, step: int) -> str:
        """The URI of ``step``'s checkpoint under the root (committed or not)."""
        return join_uri(self.root_uri, self.layout.step_dir(step))

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (in either tier when tiered). Reads the
        listings (never the pointer)."""
        return self._roots.all_steps()

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def read_pointer(self) -> int | None:
        """The step the root's pointer names (``latest``, or Bridge's tracker;
        a hint, see the module docstring)."""
        return self._roots.read_pointer()

    # -- saving -------------------------------------------------------------
    @hint_keywords
    def save(
        self,
        state_dict: dict[str, Any],
        step: int,
        *,
        overwrite: bool = False,
        commit_files: Mapping[str, bytes] | None = None,
    ) -> SaveHandle:
        """Save ``state_dict`` as ``step`` (every rank, with the same step).

        The state comes first, as in :func:`dcpstore.save` and :meth:`load`.

        Args:
            state_dict: this rank's state (a dict, as for :func:`dcpstore.save`).
            step: the step number, an int >= 0; the checkpoint goes to
                ``root/step_{step:08d}`` (``root/iter_{step:07d}`` in Bridge's layout).
            overwrite: replace a step that is already committed (saving a
                step twice is usually a bug). A replaced step loads as the
                old save until the new one is committed, and as the new one
                after; a failed or killed save leaves the old one.
            commit_files: small files of the caller's (name -> bytes: a
                framework's train state, a config) that the step's commit
                carries, as :class:`~dcpstore.StorageWriter`'s do: written
                under their names in the step before ``.metadata``, each
                recorded with its size and CRC32C, read back checked by
                :func:`dcpstore.tools.commit_file`. The coordinator's count.

        Returns:
            The save's handle (already done for a sync manager).

        Raises:
            SaveError: the previous save (finished first) or this one failed,
                or an earlier async save on the same saver failed unobserved.
            CheckpointExists: the step is already committed and
                ``overwrite`` is False (a ``SaveError`` and a ``FileExistsError``).
            InvalidArgument: a bad step, or a closed manager.
        """
        if not isinstance(state_dict, dict):
            raise InvalidArgument(
                f"CheckpointManager.save(state_dict, step): state_dict must be a dict, got {type(state_dict).__name__}"
            )
        self._check_open()
        step = check_step(step)
        self._finish_pending()
        if not overwrite and self._roots.is_committed(step):
            raise CheckpointExists(
                f"Checkpoint already exists: step {step} is committed under {self.uri}; pass overwrite=True to replace it"
            )
        save_id = self._roots.before_save(step, overwrite)
        # The save itself refuses too, should the step be committed meanwhile.
        options = self._save_options
        if overwrite != options.overwrite or save_id is not None:
            options = replace(options, overwrite=overwrite, save_id=save_id)
        handle = save_with(state_dict, self._roots.save_uri(step), options, commit_files)
        self._roots.saved(step, handle)
        self._pending = _Pending(step, handle)
        exit_hook.hold(self, exit_hook.Stage.MANAGERS)
        if handle.done():
            self._finish_pending()
        return handle

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until the save in flight (if any) is committed and finished
        (pointer written, retention applied), and (tiered) every committed
        step is replicated.

        Args:
            timeout: seconds to wait at most (``None``: until it finishes, or
                until the saver presumes it hung).

        Returns:
            The save's info, or ``None`` if no save was in flight.

        Raises:
            SaveError: the save failed, or is presumed hung; (tiered) a
                replication failed.
            TimeoutError: still running after ``timeout`` seconds (it stays
                in flight).
        """
        info = self._finish_pending(timeout)
        self._roots.wait(timeout)
        return info

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
            self._roots.committed(pending.step)
        return info

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
        return self._roots.locate(step, self.options.process_group)[0]

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
        resolved, uri = self._roots.locate(step, self.options.process_group, state_dict)
        options = self.options.for_load(safe_globals=safe_globals or (), trusted=trusted)
        if uri != self.step_uri(resolved):  # the local tier
            options = replace(options, storage_options=self._local_storage_options)
        load_with(state_dict, uri, options)
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
            OPEN.release(self)
            self._roots.close()
            default_saver().leftovers.finish("at close()")  # the clean-ups its failed saves could not do

    def finish_at_exit(self) -> None:
        """Interpreter exit: :meth:`close`, saying loudly what was lost if it
        fails (the exit status is left alone: see docs/usage.md, "Async saves")."""
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
        return f"CheckpointManager({self.uri!r}, keep={self.keep}, async_={self.async_}, layout={self.layout.name!r})"
