"""Megatron-Bridge's checkpoint manager, with dcpstore beneath it: one config line.

Bridge 0.6.2 builds its checkpoint manager from
``checkpoint.custom_manager_class`` (``create_checkpoint_manager``, which
checks the class path against Bridge's allowlist before importing it)::

    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    register_allowed_target_prefix("dcpstore")   # Bridge's allowlist: megatron., torch., nvidia., ...
    cfg.checkpoint.custom_manager_class = "dcpstore.adapters.megatron.BridgeCheckpointManager"
    cfg.checkpoint.save = cfg.checkpoint.load = "s3://bucket/run"

:class:`BridgeCheckpointManager` speaks Bridge's ``CheckpointManager``
protocol (``save(ctx, callback_manager)``, ``load(ctx)``,
``finalize_async_saves(state, blocking, terminate)``). Bridge decides what
is saved; this manager decides where and how the bytes go:

save      the state dict Bridge's ``save_checkpoint`` builds for
          ``fsdp_dtensor`` (its own functions, in its order: RNG and rerun
          state, ``generate_state_dict``, ``preprocess_fsdp_dtensor_state_dict``),
          saved as step ``train_state.step`` by a dcpstore
          :class:`~dcpstore.CheckpointManager` in Bridge's layout
          (``iter_NNNNNNN/``), sync or async (``async_save``) on dcpstore's
          own saver and engines, with Bridge's ``train_state.pt`` and
          ``run_config.yaml`` inside the step's commit; after the commit,
          Bridge's tracker and ``most_recent_k``.
load      the step to resume (``ckpt_step``, or the newest committed under
          ``load``; else ``pretrained_checkpoint`` as a fine-tune, as Bridge
          falls back), then Bridge's own ``_load_checkpoint_from_path`` on a
          local mirror of the step's small files (``.metadata``,
          ``train_state.pt``, ``run_config.yaml``: Bridge reads them with
          ``open()``), with Bridge's reader name pointing at dcpstore's
          reader of the step for the call: every tensor comes from storage
          through dcpstore, checksums verified; RNG, optimizer, scheduler,
          train state and the rest are restored by Bridge's code.
finalize  a non-blocking finalize finishes a save that has committed
          (tracker, retention) and never waits; ``blocking=True`` waits;
          ``terminate=True`` then closes.

Bridge's ``setup()`` calls ``load()`` only when ``_should_load_checkpoint``
says so, which looks at ``checkpoint.load`` with ``os.path`` (and sees
nothing on ``s3://``) or asks ``checkpointing_context["local_checkpoint_manager"]
.find_latest()``: :attr:`BridgeCheckpointManager.checkpointing_context`
holds an object that answers with the newest committed step, so a run on
``s3://`` resumes instead of silently restarting from iteration 0.

Refused, naming the field: ``ckpt_format`` other than ``fsdp_dtensor``
(megatron-core's ``torch_dist`` strategy builds its own writer), Bridge's
non-persistent checkpoints, ``also_save_hf_checkpoint``. Not covered:
PEFT adapter filtering, GLU-interleaved models, an Energon dataloader's
state, and the W&B / MLflow / Comet artifact hooks of Bridge's save
(``save()`` refuses the first two when the run has them).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist

from dcpstore._impl.adapters.megatron_bridge import BridgeRoots
from dcpstore._impl.adapters.megatron_config import CheckpointConfig
from dcpstore._impl.dcp.commit.reading import read_checkpoint_metadata, read_commit_file
from dcpstore._impl.dropin import StorageReader
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager import BRIDGE, CheckpointManager, SavedStep
from dcpstore._impl.manager.roots import group_rank
from dcpstore._impl.manager.steps import committed_steps
from dcpstore._impl.storage import StorageOptions, join_uri, open_storage
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointError, CheckpointNotFound, InvalidArgument
from dcpstore._impl.values.options import LoadOptions, SaveOptions

log = logging.getLogger(__name__)

#: Bridge's module whose functions build and restore the state.
BRIDGE_MODULE = "megatron.bridge.training.checkpointing"
#: What this manager calls of it (Bridge 0.6.2); a module lacking one is refused.
BRIDGE_FUNCTIONS = (
    "unwrap_model",
    "get_pg_collection",
    "get_rng_state",
    "get_rerun_state_machine",
    "generate_state_dict",
    "preprocess_fsdp_dtensor_state_dict",
    "_build_sharded_state_dict_metadata",
    "_get_model_glu_interleave_sizes",
    "_load_checkpoint_from_path",
    "_get_filesystem_reader",
)
#: Bridge's files in a step, which this manager puts into the step's commit.
TRAIN_STATE = "train_state.pt"
RUN_CONFIG = "run_config.yaml"


def _refuse(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"checkpoint.{field}: {message} (dcpstore.adapters.megatron.BridgeCheckpointManager)")


def check_covered(checkpoint_config: Any) -> None:
    """Refuse a Bridge configuration this manager does not save as Bridge would.

    Raises:
        InvalidArgument: naming the field (``checkpoint.<field>``) and why.
    """
    fmt = getattr(checkpoint_config, "ckpt_format", None)
    if fmt != "fsdp_dtensor":
        raise _refuse(
            "ckpt_format",
            f"is {fmt!r}; this manager saves 'fsdp_dtensor' only (megatron-core's torch_dist strategy builds its "
            "own writer): set ckpt_format='fsdp_dtensor', or leave custom_manager_class unset",
        )
    if getattr(checkpoint_config, "non_persistent_save_interval", None) is not None:
        kind = getattr(checkpoint_config, "non_persistent_ckpt_type", None)
        raise _refuse(
            "non_persistent_save_interval",
            f"is set (non_persistent_ckpt_type={kind!r}): Bridge's non-persistent checkpoints are not covered; "
            "a tiered dcpstore.CheckpointManager(local_dir=...) is dcpstore's fast local tier",
        )
    if getattr(checkpoint_config, "also_save_hf_checkpoint", False):
        raise _refuse("also_save_hf_checkpoint", "the Hugging Face sidecar export is not covered")


class _NewestCommitted:
    """What Bridge's ``setup()`` asks of ``checkpointing_context["local_checkpoint_manager"]``
    before it calls ``load()``: the newest step this manager would resume
    (-1: none), where Bridge's own check (``os.path`` on ``checkpoint.load``)
    cannot see an object store."""

    def __init__(self, manager: BridgeCheckpointManager) -> None:
        self._manager = manager

    def find_latest(self) -> int:
        found = self._manager.resume_point()
        return -1 if found is None else found[1]


class BridgeCheckpointManager:
    """Megatron-Bridge 0.6.2's ``CheckpointManager`` over dcpstore; see the
    module docstring for what each call does and how to enable it.

    Args:
        checkpoint_config: Bridge's ``ConfigContainer.checkpoint`` (Bridge
            passes it). Its ``save``, ``load`` and ``pretrained_checkpoint``
            may be local paths, ``s3://`` or ``msc://`` URIs; MSC follows
            Megatron's ``--enable-msc``.

    Raises:
        InvalidArgument: a field this manager cannot honour, named as
            ``checkpoint.<field>`` with the reason.

    Bridge builds the manager from its config alone, so dcpstore's own
    options (the engine, the storage's tuning) come from the class: a
    subclass that sets :attr:`options`, named in ``custom_manager_class``
    instead, saves with them::

        class ProcessEngineManager(BridgeCheckpointManager):
            options = dcpstore.SaveOptions(engine="process")
    """

    #: dcpstore's options for every save and load (``None``: the defaults,
    #: ``engine="auto"``); Bridge's fields (``async_save``,
    #: ``dist_ckpt_workers``, ``--enable-msc``) apply on top.
    options: ClassVar[SaveOptions | None] = None

    def __init__(self, checkpoint_config: Any) -> None:
        check_covered(checkpoint_config)
        self.checkpoint_config = checkpoint_config
        #: The dcpstore side of the same fields (validated; Bridge's layout).
        self.config = CheckpointConfig.from_bridge(checkpoint_config, options=type(self).options)
        self.roots = BridgeRoots.of(checkpoint_config)
        self._saves: CheckpointManager | None = None
        #: The saves this manager finished, oldest first (committed ones only).
        self.history: list[SavedStep] = []
        self._after_commit: list[Callable[[], None]] = []
        self._context: dict[str, Any] = {"local_checkpoint_manager": _NewestCommitted(self)}

    @property
    def checkpointing_context(self) -> dict[str, Any]:
        """Bridge's per-manager context (``setup()`` reads it)."""
        return self._context

    # -- save ---------------------------------------------------------------
    def save(self, ctx: Any, callback_manager: Any = None) -> None:
        """Save ``ctx`` (Bridge's ``CheckpointSaveContext``) as step
        ``ctx.state.train_state.step``; every rank calls it.

        Raises:
            InvalidArgument: a non-persistent save, or a run this manager
                does not cover (see the module docstring).
            SaveError, CheckpointExists: as :meth:`dcpstore.CheckpointManager.save`.
        """
        if ctx.non_persistent_ckpt:
            raise _refuse("non_persistent_save_interval", "a non-persistent save was asked for; not covered")
        bridge = _bridge_module()
        cfg = ctx.state.cfg
        if getattr(cfg, "peft", None) is not None:
            raise InvalidArgument("peft: PEFT adapter checkpoints are not covered by BridgeCheckpointManager")
        model = bridge.unwrap_model(ctx.model)
        if any(size is not None for size in bridge._get_model_glu_interleave_sizes(model, cfg)):
            raise InvalidArgument("GLU-interleaved models are not covered by BridgeCheckpointManager")
        step = int(ctx.state.train_state.step)  # Bridge's loop moves it on after save() returns
        state_dict = _bridge_state_dict(bridge, ctx, model, step)
        files = {TRAIN_STATE: _train_state_bytes(ctx), RUN_CONFIG: _run_config_bytes(cfg)}
        self.finalize_async_saves(ctx.state, blocking=True)  # the previous save, callbacks and all
        # Bridge saves over a step that exists (a run resumed at ckpt_step saves its later steps again);
        # the old step stays whole until the new one commits.
        self.saves.save(state_dict, step, overwrite=True, commit_files=files)
        self._after_commit.append(lambda: _fire_checkpoint_saved(callback_manager, ctx))
        if not self.config.async_save:
            self.finalize_async_saves(ctx.state, blocking=True)

    @property
    def saves(self) -> CheckpointManager:
        """The dcpstore manager under ``checkpoint.save`` (made at the first
        save: torch.distributed is up by then)."""
        if self._saves is None:
            self._saves = self.config.manager()
            self._saves.history = self.history  # one record across the managers a terminate ends
        return self._saves

    def finalize_async_saves(self, state: Any, blocking: bool = False, terminate: bool = False) -> None:
        """Finish the save in flight once it has committed (tracker,
        retention, Bridge's ``on_checkpoint_save`` callbacks): waiting for
        it if ``blocking``, else only if it already has. ``terminate``:
        then close.

        Raises:
            SaveError: the save failed (on every rank).
        """
        if self._saves is None:
            return
        try:
            self._saves.wait(None if blocking else 0)
        except TimeoutError:
            return  # still writing: the next call (Bridge's loop makes one each step) finishes it
        self._fire_after_commit()
        if terminate:
            self._saves.close()
            self._saves = None

    def _fire_after_commit(self) -> None:
        callbacks, self._after_commit = self._after_commit, []
        for callback in callbacks:
            callback()

    # -- load ---------------------------------------------------------------
    def resume_point(self) -> tuple[str, int, bool] | None:
        """(step URI, step, fine-tune) of what :meth:`load` loads, as Bridge
        resolves it: ``ckpt_step`` or the newest committed step under
        ``load`` (or ``load`` itself, one step's directory); else the same
        under ``pretrained_checkpoint``, as a fine-tune; ``None``: nothing.
        Every rank calls it: rank 0 lists and broadcasts its answer (or its
        error), so one listing serves the job and every rank agrees.

        Raises:
            CheckpointNotFound: ``ckpt_step`` is set and not committed under ``load``.
        """
        return cast("tuple[str, int, bool] | None", _on_rank_0(self._find_resume_point))

    def _find_resume_point(self) -> tuple[str, int, bool] | None:
        cfg = self.checkpoint_config
        wanted = getattr(cfg, "ckpt_step", None)
        sources = (
            (cfg.load, "load", bool(getattr(cfg, "finetune", False))),
            (getattr(cfg, "pretrained_checkpoint", None), "pretrained_checkpoint", True),
        )
        for root, field, finetune in sources:
            if root is None:
                continue
            storage = open_storage(root, storage_options=self._where)
            try:
                direct = BRIDGE.parse_step_dir(os.path.basename(storage.url.path.rstrip("/")))
                if direct is not None and storage.exists(METADATA):
                    return root, direct, finetune  # a step's own directory, as Bridge accepts
                committed = committed_steps(storage, BRIDGE)
            finally:
                storage.close()
            if wanted is not None and field == "load":
                if wanted not in committed:
                    raise CheckpointNotFound(
                        f"checkpoint.ckpt_step={wanted} is not a committed step under checkpoint.load={root!r} "
                        f"(the newest committed: {committed[-5:] or 'none'})"
                    )
                return join_uri(root, BRIDGE.step_dir(wanted)), wanted, finetune
            if committed:
                return join_uri(root, BRIDGE.step_dir(committed[-1])), committed[-1], finetune
        return None

    @property
    def _where(self) -> StorageOptions | None:
        return self.config.save_options().storage_options

    def load(self, ctx: Any) -> tuple[int, int]:
        """Resume ``ctx`` (Bridge's ``CheckpointLoadContext``) from the
        step :meth:`resume_point` names, through Bridge's own restore.

        Returns:
            ``(iteration, floating_point_operations_so_far)``; ``(0, 0)``
            when there is nothing to load.

        Raises:
            CheckpointNotFound: ``ckpt_step`` is not committed.
            CheckpointCorrupt, UnsafeCheckpoint, LoadError: as :func:`dcpstore.load`.
        """
        found = self.resume_point()
        if found is None:
            return 0, 0
        uri, step, finetune = found
        if finetune:
            ctx.state.cfg.checkpoint.finetune = True  # as Bridge's load_checkpoint does for a pretrained checkpoint
        bridge = _bridge_module()
        where = self._where
        with tempfile.TemporaryDirectory(prefix="dcpstore-bridge-") as mirror:
            local = os.path.join(mirror, BRIDGE.step_dir(step))
            os.makedirs(local)
            # Every rank needs the mirror (Bridge checks its files on each); one rank reads them.
            for name, blob in cast("dict[str, bytes]", _on_rank_0(lambda: _small_files(uri, where))).items():
                with open(os.path.join(local, name), "wb") as f:
                    f.write(blob)

            def reader(
                path: str | os.PathLike[str], cache_metadata: bool = False, async_strategy: str = "mcore"
            ) -> StorageReader:
                name = os.fspath(path)
                target = uri if os.path.normpath(name) == local else self.roots.restore(name)
                return StorageReader(target, options=LoadOptions(storage_options=where))

            with _bridge_name(bridge, "_get_filesystem_reader", reader):
                iteration, flops = bridge._load_checkpoint_from_path(
                    local,
                    ctx.state,
                    ctx.model,
                    ctx.optimizer,
                    ctx.opt_param_scheduler,
                    strict=ctx.strict,
                    checkpointing_context=self._context,
                    skip_load_to_model_and_opt=ctx.skip_load_to_model_and_opt,
                    pg_collection=ctx.pg_collection,
                    module_name=ctx.module_name,
                )
        # Where setup() restores an Energon dataloader's state from, as Bridge records it: beside the steps.
        self._context["dataloader_state_dir"] = join_uri(uri.rsplit("/", 1)[0], "energon")
        log.info("resumed iteration %d from %s", iteration, uri)
        return int(iteration), int(flops)


# -- Bridge's side, called by name ---------------------------------------------


def _bridge_module() -> ModuleType:
    """Bridge's checkpointing module (imported by Bridge's own setup already)."""
    module = importlib.import_module(BRIDGE_MODULE)
    missing = [name for name in BRIDGE_FUNCTIONS if not hasattr(module, name)]
    if missing:
        raise InvalidArgument(
            f"{BRIDGE_MODULE} has no {', '.join(missing)}: not the Megatron-Bridge release "
            "BridgeCheckpointManager knows (0.6.2)"
        )
    return module


@contextlib.contextmanager
def _bridge_name(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` for the ``with`` block only."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _bridge_state_dict(bridge: ModuleType, ctx: Any, model: list[Any], step: int) -> dict[str, Any]:
    """The state dict Bridge 0.6.2's ``save_checkpoint`` builds for
    ``fsdp_dtensor``, with Bridge's functions in Bridge's order."""
    cfg = ctx.state.cfg
    ckpt = cfg.checkpoint
    pg_collection = ctx.pg_collection if ctx.pg_collection is not None else bridge.get_pg_collection(model)
    rng_state = bridge.get_rng_state(
        data_parallel_random_init=cfg.rng.data_parallel_random_init,
        ckpt_format=ckpt.ckpt_format,
        pg_collection=pg_collection,
        module_name=ctx.module_name,
    )
    rerun_state = bridge.get_rerun_state_machine().state_dict(
        data_iterator=ctx.train_data_iterator, ckpt_format=ckpt.ckpt_format
    )
    metadata = bridge._build_sharded_state_dict_metadata(cfg.optimizer.use_distributed_optimizer, ckpt)
    metadata["dp_cp_group"] = pg_collection.dp_cp
    state_dict: dict[str, Any] = bridge.generate_state_dict(
        ckpt,
        model,
        ctx.optimizer,
        ctx.opt_param_scheduler,
        rng_state,
        iteration=step,
        optim_sd_kwargs=dict(metadata=metadata),
        model_sd_kwargs=dict(metadata=metadata),
        rerun_state=rerun_state,
        pg_collection=pg_collection,
    )
    return dict(bridge.preprocess_fsdp_dtensor_state_dict(cfg, state_dict, model[0]))


def _train_state_bytes(ctx: Any) -> bytes:
    """Bridge's ``train_state.pt`` of this save (its ``train_state_finalize_fn``)."""
    train_state = ctx.state.train_state.state_dict()
    train_state["floating_point_operations_so_far"] = torch.tensor(
        ctx.num_floating_point_operations_so_far, dtype=torch.float32
    )
    buf = io.BytesIO()
    torch.save(train_state, buf)
    return buf.getvalue()


def _run_config_bytes(cfg: Any) -> bytes:
    """Bridge's ``run_config.yaml`` (``ConfigContainer.to_yaml`` writes to a path)."""
    with tempfile.TemporaryDirectory(prefix="dcpstore-bridge-") as tmp:
        path = os.path.join(tmp, RUN_CONFIG)
        cfg.to_yaml(path)
        with open(path, "rb") as f:
            return f.read()


def _fire_checkpoint_saved(callback_manager: Any, ctx: Any) -> None:
    """Bridge's ``on_checkpoint_save`` callbacks, once the step is committed."""
    if callback_manager is None:
        return
    callbacks = importlib.import_module("megatron.bridge.training.callbacks")
    if callbacks.should_fire(callback_manager, "on_checkpoint_save"):
        context = callbacks.CallbackContext(
            state=ctx.state, model=ctx.model, user_state=callback_manager.user_state, optimizer=ctx.optimizer
        )
        callback_manager.fire("on_checkpoint_save", context)


def _small_files(uri: str, where: StorageOptions | None) -> dict[str, bytes]:
    """The step's ``.metadata`` and Bridge's two files, for Bridge's
    ``open()``-based reads (the tensors stay where they are): each as the
    step's commit records it, checksums verified (a step Bridge or stock DCP
    wrote has no manifest: its files as they lie)."""
    storage = open_storage(uri, storage_options=where)
    try:
        _, manifest = read_checkpoint_metadata(storage)  # a step that is not committed fails here
        blobs = {METADATA: storage.read(METADATA)}
        for name in (TRAIN_STATE, RUN_CONFIG):
            with contextlib.suppress(CheckpointNotFound):  # absent: Bridge's own fallbacks apply
                blobs[name] = read_commit_file(storage, manifest, name)
    finally:
        storage.close()
    return blobs


def _on_rank_0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0, its answer (or its :class:`CheckpointError`) on
    every rank: one read of storage serves the job, and every rank agrees or
    every rank raises."""
    answer: list[Any] = [None]
    if group_rank(None) == 0:
        try:
            answer = [(True, fn())]
        except CheckpointError as e:
            answer = [(False, e)]
    if is_distributed():
        dist.broadcast_object_list(answer, src=0)
    ok, value = answer[0]
    if not ok:
        raise value
    return value
