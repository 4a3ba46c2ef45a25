"""The implementation of :mod:`dcpstore.adapters.lightning`, whose docstring says how to use it."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from dcpstore._impl.adapters.dropins import DropinOptions
from dcpstore._impl.adapters.shadow import shadow, uninstall_previous, unshadow
from dcpstore._impl.dcp.commit import delete_checkpoint
from dcpstore._impl.dcp.commit.reading import read_checkpoint_metadata, read_commit_file
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.storage import parse_uri
from dcpstore._impl.util.errors import InvalidArgument

log = logging.getLogger(__name__)

#: Lightning's name for the non-tensor state of a sharded checkpoint.
META = "meta.pt"

#: Where each flavour of ``ModelParallelStrategy`` lives (both package layouts).
FLAVOURS: Mapping[str, str] = {
    "lightning.fabric.strategies.model_parallel": "fabric",
    "lightning_fabric.strategies.model_parallel": "fabric",
    "lightning.pytorch.strategies.model_parallel": "trainer",
    "pytorch_lightning.strategies.model_parallel": "trainer",
}

#: The methods :func:`install` shadows, per flavour.
PATCHED: Mapping[str, tuple[str, ...]] = {
    "fabric": ("save_checkpoint", "load_checkpoint"),
    "trainer": ("save_checkpoint", "load_checkpoint", "remove_checkpoint"),
}


def flavour(strategy: object) -> str | None:
    """``"fabric"`` or ``"trainer"`` for (a subclass of) Lightning's
    ``ModelParallelStrategy``, else None."""
    for cls in type(strategy).__mro__:
        if cls.__name__ == "ModelParallelStrategy" and cls.__module__ in FLAVOURS:
            return FLAVOURS[cls.__module__]
    return None


class Installed:
    """dcpstore beneath one ``ModelParallelStrategy`` (from :func:`install`);
    ``uninstall()`` (or leaving a ``with`` block) gives it back its methods."""

    def __init__(self, strategy: Any, kind: str, options: DropinOptions) -> None:
        self.strategy = strategy
        self.kind = kind
        self.options = options
        cls = type(strategy)
        #: The strategy's own methods, bound, for what dcpstore leaves to Lightning.
        self.own: dict[str, Callable[..., Any]] = {n: getattr(cls, n).__get__(strategy) for n in PATCHED[kind]}
        shadow(strategy, self, {name: getattr(type(self), f"_{kind}_{name}") for name in PATCHED[kind]})
        self.installed = True

    # -- Fabric --------------------------------------------------------------
    def _fabric_save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        s = self.strategy
        if not s._save_distributed_checkpoint:  # one torch.save file: Lightning's own
            self.own["save_checkpoint"](path, state, storage_options=storage_options, filter=filter)
            return
        _refuse_storage_options(s, storage_options)
        if filter is not None:  # as Lightning: https://github.com/pytorch/pytorch/issues/105379
            raise NotImplementedError(
                f"{type(s).__name__} doesn't support loading distributed filtered checkpoints, so saving them is disabled."
            )
        uri = self._uri(path)
        module = _one_module(state, "save_checkpoint")
        options = StateDictOptions(full_state_dict=False, cpu_offload=True)
        converted: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                converted[key] = get_model_state_dict(obj, options=options)
            elif isinstance(obj, Optimizer):
                converted[key] = get_optimizer_state_dict(module, obj, options=options)
            else:  # Lightning: everything else is metadata
                metadata[key] = obj.state_dict() if _is_stateful(obj) else obj
        self._save(uri, converted, metadata)

    def _fabric_load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not state or isinstance(state, (Module, Optimizer)):  # Lightning's errors and load_raw
            return dict(self.own["load_checkpoint"](path, state, strict=strict, weights_only=weights_only))
        uri = self._uri(path)
        if not self._is_sharded(uri):
            return dict(self.own["load_checkpoint"](path, state, strict=strict, weights_only=weights_only))
        return self._load(uri, state, strict, weights_only)

    # -- Trainer -------------------------------------------------------------
    def _trainer_save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        s = self.strategy
        _refuse_storage_options(s, storage_options)
        if not s._save_distributed_checkpoint:
            self.own["save_checkpoint"](checkpoint, filepath)
            return
        uri = self._uri(filepath)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        self._save(uri, converted, checkpoint)

    def _trainer_load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        s = self.strategy
        uri = self._uri(checkpoint_path)
        if not self._is_sharded(uri):
            return dict(self.own["load_checkpoint"](checkpoint_path, weights_only))
        state = {"state_dict": s.model, **{f"optimizer_{i}": o for i, o in enumerate(s.optimizers)}}
        return self._load(uri, state, s.lightning_module.strict_loading, weights_only)

    def _trainer_remove_checkpoint(self, filepath: Any) -> None:
        s = self.strategy
        if not s.is_global_zero:
            return
        uri = os.fspath(filepath)
        local = _local_path(uri)
        if local is not None and not os.path.isdir(local):
            self.own["remove_checkpoint"](filepath)  # a full-state file (or nothing): Lightning's
            return
        # Stock Lightning removes the checkpoint whole (fsspec's
        # rm(recursive=True)); ModelCheckpoint then finds the name free again.
        storage = self.options.open(uri)
        try:
            delete_checkpoint(storage)  # .metadata first: never a committed-looking remnant
            storage.remove_incomplete(storage.incomplete_writes())  # temporary files, open multipart uploads
        finally:
            storage.close()
        if local is not None:
            # dcpstore's local storage drops the directories its deletes
            # emptied but never its own root, which here is the checkpoint
            # directory itself; left, Lightning sees its name as taken.
            try:
                os.rmdir(local)
            except FileNotFoundError:
                pass
            except OSError as e:  # what dcpstore's storage does not delete (a link it never follows): said, not fatal
                log.warning("removed checkpoint %s, but not its directory: %s", uri, e)

    # -- shared ------------------------------------------------------------
    def _uri(self, path: Any) -> str:
        """Rank 0's path on every rank (as Lightning broadcasts it), kept a
        string: ``Path("s3://b/k")`` would lose a slash."""
        return str(os.fspath(self.strategy.broadcast(os.fspath(path))))

    def _is_sharded(self, uri: str) -> bool:
        """A committed DCP checkpoint is there (Lightning: a directory with ``meta.pt``)."""
        local = _local_path(uri)
        if local is not None and not os.path.isdir(local):
            return False
        storage = self.options.open(uri)
        try:
            return storage.exists(METADATA)
        finally:
            storage.close()

    def _save(self, uri: str, converted: dict[str, Any], metadata: dict[str, Any]) -> None:
        """One DCP save whose commit carries ``meta.pt`` (rank 0's, which the
        coordinator writes; Lightning too saves rank 0's)."""
        local = _local_path(uri)
        if local is not None and os.path.isfile(local) and self.strategy.global_rank == 0:
            os.unlink(local)  # as Lightning: a full-state file where the sharded directory goes
        self.strategy.barrier()
        commit_files = None
        if self.strategy.global_rank == 0:
            buf = io.BytesIO()
            torch.save(metadata, buf)
            commit_files = {META: buf.getvalue()}
        writer = self.options.writer(uri, commit_files)
        try:
            dcp_save(converted, storage_writer=writer)
        finally:
            writer.storage.close()

    def _load(self, uri: str, state: dict[str, Any], strict: bool, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's sharded load (``_load_checkpoint``), through dcpstore."""
        module = _one_module(state, "load_checkpoint")
        module_key = next(k for k, v in state.items() if v is module)
        optimizers = {k: o for k, o in state.items() if isinstance(o, Optimizer)}
        module_state = {module_key: get_model_state_dict(module)}
        dcp_load(module_state, storage_reader=self.options.reader(uri))
        module.load_state_dict(module_state[module_key], strict=strict)
        for key, optim in optimizers.items():  # each optimizer on its own, as Lightning loads them
            optim_state = {key: get_optimizer_state_dict(module, optim)}
            dcp_load(optim_state, storage_reader=self.options.reader(uri))
            set_optimizer_state_dict(
                module, optim, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
            )
        storage = self.options.open(uri)
        try:
            _, manifest = read_checkpoint_metadata(storage)
            blob = read_commit_file(storage, manifest, META)
        finally:
            storage.close()
        metadata = torch.load(io.BytesIO(blob), weights_only=weights_only)
        requested = state.keys() - {module_key} - optimizers.keys()
        missing = [k for k in requested if k not in metadata]
        if strict and missing:  # Lightning's _validate_keys_for_strict_loading
            raise KeyError(
                f"The requested state contains a key '{missing[0]}' that does not exist in the loaded checkpoint."
                " To disable strict loading, set `strict=False`."
            )
        for key in requested:
            if key in metadata:
                state[key] = metadata.pop(key)
        return dict(metadata)

    # -- undo --------------------------------------------------------------
    def uninstall(self) -> None:
        """Give the strategy back its own methods. Idempotent."""
        if not self.installed:
            return
        self.installed = False
        unshadow(self.strategy, PATCHED[self.kind])

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()


def install(strategy: Any, **options: Any) -> Installed:
    """Put dcpstore beneath the sharded checkpoints of ``strategy`` (see the
    module docstring). Call it once per process, before the strategy's
    first save or load (every rank builds its own strategy object).

    Args:
        strategy: Lightning's ``ModelParallelStrategy`` (Fabric's or the
            Trainer's, either package layout) or a subclass.
        options: :class:`~dcpstore._impl.adapters.dropins.DropinOptions`'
            keywords (``storage_options``, ``enable_msc``, ``thread_count``,
            ``verify``, ``safe_globals``, ``trusted``); the last three govern
            the DCP items: ``meta.pt`` is read by ``torch.load`` with the
            ``weights_only`` Lightning is given, as Lightning reads it.

    Returns:
        The :class:`Installed` handle; ``uninstall()`` undoes it. Installing
        again replaces the previous installation (its options).

    Raises:
        InvalidArgument: not a ``ModelParallelStrategy``, or a bad option.
    """
    kind = flavour(strategy)
    if kind is None:
        raise InvalidArgument(
            "install() takes Lightning's ModelParallelStrategy (lightning.fabric or lightning.pytorch "
            f"strategies), got {type(strategy).__name__}"
        )
    checked = DropinOptions(**options)
    uninstall_previous(strategy)
    return Installed(strategy, kind, checked)


def _refuse_storage_options(strategy: Any, storage_options: Any) -> None:
    if storage_options is not None:  # as Lightning; dcpstore's are install()'s
        raise TypeError(
            f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported because"
            f" `{type(strategy).__name__}` does not use the `CheckpointIO`; pass dcpstore's StorageOptions to"
            " dcpstore.adapters.lightning.install()"
        )


def _local_path(uri: str) -> str | None:
    """The path of a local URI, None for any other."""
    url = parse_uri(uri)
    return url.path if url.scheme == "file" else None


def _has_dtensors(obj: object) -> bool:
    return isinstance(obj, Module) and any(isinstance(t, DTensor) for t in obj.parameters())


def _one_module(state: Mapping[str, Any], what: str) -> Module:
    """The one distributed model in ``state`` (Lightning's rule and words)."""
    modules = [m for m in state.values() if _has_dtensors(m)]
    if len(modules) != 1:
        raise ValueError(
            f"{'Could not find a' if not modules else 'Found multiple'} distributed model(s) in the given state of "
            f"{what}(): a sharded checkpoint holds exactly one model, set up through the strategy, e.g. "
            f"state={{'model': model, 'optimizer': optimizer, ...}}"
        )
    module: Module = modules[0]
    return module


def _is_stateful(obj: object) -> bool:
    """Lightning's ``_Stateful``: has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
