"""The implementation of :mod:`dcpstore.adapters.torchtitan`, whose docstring says how to use it."""

from __future__ import annotations

import os
import posixpath
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.base import MODEL, purge_thread
from torchtitan.components.checkpointer.dcp import AsyncMode
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from dcpstore._impl.adapters.dropins import DropinOptions
from dcpstore._impl.adapters.shadow import shadow, uninstall_previous, unshadow
from dcpstore._impl.dcp.commit import delete_checkpoint
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager.steps import StepLayout, committed_steps
from dcpstore._impl.safetensors import (
    SafetensorsReader,
    SafetensorsWriter,
    consolidate_safetensors,
    is_dcpstore_safetensors,
)
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointNotFound, InvalidArgument, SaveError
from dcpstore._impl.values.options import SaveOptions

_T = TypeVar("_T")

#: Where a sharded HF export's ranks write inside the step before it is
#: consolidated (torchtitan's own name for it).
HF_SHARDED = "sharded"

#: The methods :func:`install` shadows on the instance.
PATCHED = ("dcp_save", "dcp_load", "_find_load_step", "_load", "_purge_stale_checkpoints", "_wait_for_saving", "_close")


#: torchtitan's step directories (``CheckpointManager._create_checkpoint_id``):
#: ``step-100``, no padding, only that spelling.
#: torchtitan keeps no pointer file, so the layout's pointer is never written.
TORCHTITAN = StepLayout("torchtitan", "step-", 1, pointer="")


def parse_step(name: str) -> int | None:
    """The step of a torchtitan step directory (``step-100``), or None for
    any other name (only torchtitan's own spelling: ``step-0100`` is not it)."""
    return TORCHTITAN.parse_step_dir(name)


class Installed:
    """dcpstore beneath one torchtitan ``CheckpointManager`` (from
    :func:`install`). ``uninstall()`` (or leaving a ``with`` block) gives the
    manager back its own methods and purge thread."""

    def __init__(self, manager: Any, options: DropinOptions) -> None:
        # Weak: the manager holds this object (its patched methods, its
        # ``_dcpstore``), and a strong reference back would make the pair a
        # cycle that only the cyclic GC frees -- keeping the dropped manager,
        # its purge thread and its gloo process group alive past
        # destroy_process_group() until some collection near exit (stock
        # torchtitan's manager is freed, and closed, when dropped).
        self._manager = weakref.ref(manager)
        self.options = options
        self.folder = os.fspath(manager.folder)
        #: The folder's storage: listings, existence checks, purges.
        self.root: Storage = options.open(self.folder)
        try:
            #: One writer and one reader for the run; each save's and load's
            #: ``checkpoint_id`` re-points them.
            self.writer = options.writer(self.folder)
            self.reader = options.reader(self.folder)
        except BaseException:
            self.root.close()
            raise
        cls = type(manager)
        #: The manager's own methods, bound, for what dcpstore leaves to torchtitan.
        self.own = _OwnMethods(cls, self._manager)
        shadow(manager, self, {name: getattr(type(self), f"_{name.lstrip('_')}") for name in PATCHED})
        self._swap_purge_thread(self._remove)
        self.installed = True

    @property
    def manager(self) -> Any:
        """The torchtitan ``CheckpointManager`` this is installed on."""
        manager = self._manager()
        if manager is None:
            raise InvalidArgument("the torchtitan CheckpointManager dcpstore was installed on is gone")
        return manager

    # -- what the manager calls ----------------------------------------------
    def _dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        m = self.manager
        if to_hf:  # torchtitan saves the last step in HF only synchronously (_save_last_step)
            self._save_hf(state_dict, checkpoint_id)
            if enable_garbage_collection:
                GarbageCollection.collect("GC collection invoked by checkpointer.")
            return None
        ret: Any
        if async_mode == AsyncMode.ASYNC:
            ret = dcp_async_save(
                state_dict, storage_writer=self.writer, checkpoint_id=checkpoint_id, process_group=m.pg
            )
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp_async_save(
                state_dict,
                storage_writer=self.writer,
                checkpoint_id=checkpoint_id,
                process_group=m.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=m.stager,
            )
        else:
            ret = dcp_save(state_dict, storage_writer=self.writer, checkpoint_id=checkpoint_id)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _save_hf(self, state_dict: dict[str, Any], checkpoint_id: str) -> None:
        """``last_save_in_hf``: the model's HF state dict as safetensors
        through dcpstore's commit. Where ranks hold parts of a tensor (FSDP),
        as torchtitan does: the ranks' shards go to ``sharded/`` inside the
        step, then rank 0 consolidates them into the model's own files (its
        ``fqn_to_index_mapping``) at the step, on the same storage, and
        removes ``sharded/``; every rank waits for it (raising what it raised)."""
        adapter = self.manager.sd_adapter
        if adapter is None:
            raise InvalidArgument("checkpoint.last_save_in_hf needs the model's state dict adapter (sd_adapter)")
        mapping = getattr(adapter, "fqn_to_index_mapping", None) or None
        hf_state = adapter.to_hf(state_dict)
        sharded = any(isinstance(v, DTensor) and any(p.is_shard() for p in v.placements) for v in hf_state.values())
        target = f"{checkpoint_id.rstrip('/')}/{HF_SHARDED}" if sharded else checkpoint_id
        writer = SafetensorsWriter(
            target, fqn_to_index_mapping=mapping, options=SaveOptions(storage_options=self.options.where)
        )
        dcp_save(hf_state, storage_writer=writer, process_group=self.manager.pg)
        if not sharded:
            return
        failed = ""
        if _rank() == 0:
            try:
                consolidate_safetensors(
                    target, checkpoint_id, fqn_to_index_mapping=mapping, storage_options=self.options.where
                )
                delete_checkpoint(self.root, f"{posixpath.basename(checkpoint_id.rstrip('/'))}/{HF_SHARDED}")
            except Exception as e:  # every rank waits below: each must hear of it
                if not is_distributed():
                    raise
                failed = f"{type(e).__name__}: {e}"
        said = _broadcast(failed)
        if said:
            raise SaveError(f"consolidating the HF export at {checkpoint_id} failed on rank 0: {said}")

    def _dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if from_hf and not from_quantized and is_dcpstore_safetensors(checkpoint_id, self.options.where):
            adapter = self.manager.sd_adapter
            if adapter is None:
                raise InvalidArgument("loading an HF checkpoint needs the model's state dict adapter (sd_adapter)")
            hf_state = adapter.to_hf(state_dict)
            dcp_load(hf_state, storage_reader=SafetensorsReader(checkpoint_id, storage_options=self.options.where))
            self.manager.states[MODEL].load_state_dict(adapter.from_hf(hf_state))
            return
        if from_hf:  # weights from elsewhere (a hub download): torchtitan's own HF reader
            self.own["dcp_load"](state_dict, checkpoint_id, from_hf, from_quantized)
            return
        dcp_load(state_dict, storage_reader=self.reader, checkpoint_id=checkpoint_id)
        # torchtitan flattens the model's entries into the state it loads: hand them back (as it does).
        if MODEL in self.manager.states:
            self.manager.states[MODEL].load_state_dict(state_dict)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest committed step under ``folder`` (default: the
        manager's), or -1; one listing."""
        if not folder or os.fspath(folder) == self.folder:
            steps = committed_steps(self.root, TORCHTITAN)
        else:
            other = self.options.open(folder)
            try:
                steps = committed_steps(other, TORCHTITAN)
            finally:
                other.close()
        return steps[-1] if steps else -1

    def _load(self, step: int = -1) -> bool:
        m = self.manager
        if step == -1:
            found = self.manager._find_load_step() if _rank() == 0 else -1
            load_step = int(_broadcast(found))
            if load_step == -1:  # nothing committed: torchtitan's initial load or fresh start
                return bool(self.own["_load"](step))
        else:
            load_step = step
        checkpoint_id = m._create_checkpoint_id(load_step)
        if not self.root.exists(f"step-{load_step}/{METADATA}"):
            steps = committed_steps(self.root, TORCHTITAN)
            raise CheckpointNotFound(
                f"--checkpoint.load_step={load_step} not found at {self.root.describe(f'step-{load_step}')}: "
                f"no committed checkpoint there (committed steps: {steps or 'none'})"
            )
        with torch.no_grad():
            states = m._states_to_load(load_step == 0)  # step 0 is torchtitan's model-only seed checkpoint
            self.manager.dcp_load(states, checkpoint_id=checkpoint_id, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _purge_stale_checkpoints(self) -> None:
        m = self.manager
        if m.keep_latest_k <= 0 or _rank() != 0:
            return
        for step in committed_steps(self.root, TORCHTITAN)[: -m.keep_latest_k]:
            m.purge_queue.put(m._create_checkpoint_id(step))

    def _wait_for_saving(self) -> None:
        self.own["_wait_for_saving"]()
        self.manager._purge_stale_checkpoints()  # the save just committed: retention counts it now

    def _close(self) -> None:
        try:
            self.own["_close"]()
        finally:
            self.writer.close()
            self.root.close()

    # -- purging -----------------------------------------------------------
    def _remove(self, path: str) -> None:
        """Delete the step directory ``path`` (a checkpoint id the purge
        queue holds) through the folder's storage, ``.metadata`` first."""
        delete_checkpoint(self.root, posixpath.basename(os.fspath(path).rstrip("/")))

    def _swap_purge_thread(self, remove: Callable[[str], None]) -> None:
        """Stop the manager's purge thread and start torchtitan's purge loop
        again with ``remove`` as its deleter (same queue, same thread attribute)."""
        m = self.manager
        thread = getattr(m, "purge_thread", None)
        if thread is None:
            return
        if thread.is_alive():
            m.purge_queue.put(None)  # torchtitan's stop sentinel
            thread.join()
        m.purge_thread = threading.Thread(target=purge_thread, args=(m.purge_queue, remove), daemon=True)
        m.purge_thread.start()

    # -- undo --------------------------------------------------------------
    def uninstall(self) -> None:
        """Give the manager back its own methods and torchtitan's purge
        thread; close what :func:`install` opened. Idempotent."""
        if not self.installed:
            return
        self.installed = False
        manager = self._manager()
        if manager is not None:  # (gone: it took its methods and purge thread with it)
            unshadow(manager, PATCHED)
            self._swap_purge_thread(filesystem.rmtree)
        self.writer.close()
        self.root.close()

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()


class _OwnMethods:
    """The manager's own methods by name, bound on each use (a bound method
    kept here would hold the manager: see :class:`Installed`)."""

    def __init__(self, cls: type, manager: weakref.ref[Any]) -> None:
        self._cls, self._manager = cls, manager

    def __getitem__(self, name: str) -> Callable[..., Any]:
        method: Callable[..., Any] = getattr(self._cls, name).__get__(self._manager())
        return method


def install(manager: Any, **options: Any) -> Installed | None:
    """Put dcpstore beneath torchtitan's ``CheckpointManager`` ``manager``
    (see the module docstring). Call it on every rank, after the manager is
    built and before its first ``load`` or ``save``.

    Args:
        manager: a ``torchtitan.components.checkpoint.CheckpointManager``
            (or a subclass). A disabled one (``checkpoint.enable=False``)
            has nothing to put beneath: None is returned.
        options: :class:`~dcpstore._impl.adapters.dropins.DropinOptions`'
            keywords (``storage_options``, ``enable_msc``, ``thread_count``,
            ``verify``, ``safe_globals``, ``trusted``); the folder's URI
            picks the backend (a local path, ``s3://``, ...).

    Returns:
        The :class:`Installed` handle (``uninstall()`` undoes it), or None
        for a disabled manager. Installing again replaces the previous
        installation (its options) with this one.

    Raises:
        InvalidArgument: not a torchtitan ``CheckpointManager``, or a bad option.
        InvalidURI, BackendUnavailable: the folder's URI, as for :func:`dcpstore.save`.
    """
    if not all(callable(getattr(type(manager), name, None)) for name in PATCHED) or not hasattr(manager, "enable"):
        raise InvalidArgument(
            f"install() takes torchtitan's CheckpointManager (torchtitan.components.checkpoint), got {type(manager).__name__}"
        )
    checked = DropinOptions(**options)
    if not manager.enable:
        return None
    uninstall_previous(manager)
    return Installed(manager, checked)


def _rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _broadcast(value: _T) -> _T:
    """Rank 0's ``value`` on every rank (itself without torch.distributed)."""
    if not is_distributed():
        return value
    box: list[_T] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
