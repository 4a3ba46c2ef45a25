"""torchtitan 0.3.0's own ``CheckpointManager`` on dcpstore
(:func:`dcpstore.adapters.torchtitan.install`), on 2 gloo ranks with a tiny
FSDP2 model, on a local folder and on S3 (moto).

One run: train 4 steps checkpointing every step with ``keep_latest_k=2``
(rank 0 keeps the gathered model and optimizer state, the LR scheduler's,
the dataloader's and the train state at each step as the reference); then,
with a *new* model, optimizer, scheduler and manager -- in the same process
(where fsspec's listing cache hid dcpstore's objects from stock torchtitan)
or a fresh one -- ``load()`` (the newest step), ``load(step=3)``, one more
step saved as torchtitan's final model-only export (bfloat16), and the
retention left exactly the newest ``k`` committed steps. Every value is
compared with ``torch.equal``. Migration: stock torchtitan saves and
dcpstore resumes, and the reverse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.support.extras import skip_module_unless  # noqa: E402

skip_module_unless("torchtitan")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import default_adamw

import dcpstore
from dcpstore.adapters import torchtitan as titan
from tests.support.backends import OBJECT_STORE_OPTIONS, Target
from tests.support.dist_utils import run_ranks
from tests.support.fsdp_jobs import assert_same, build, full_state, train

MODES = ("disabled", "async", "async_with_pinned_mem")
STEPS = 4
KEEP = 2


class Counter:
    """A Stateful stand-in for torchtitan's dataloader and train state."""

    def __init__(self, **values: Any) -> None:
        self.values = dict(values)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values = dict(state)


def _parts(seed: int, folder: str, mode: str, *, model_only: bool = True) -> tuple[Any, ...]:
    model, _ = build(seed)
    optims = OptimizersContainer(
        dataclasses.replace(default_adamw(lr=1e-2), implementation="for-loop"), model_parts=[model]
    )
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optims, training_steps=10)
    loader, state = Counter(position=0, epoch=0), Counter(step=0, tokens=0)
    config = CheckpointManager.Config(
        enable=True,
        folder=folder,
        interval=1,
        async_mode=mode,  # type: ignore[arg-type]
        keep_latest_k=KEEP,
        last_save_model_only=model_only,
        export_dtype="bfloat16",
    )
    mgr = CheckpointManager(
        config,
        dataloader=loader,  # type: ignore[arg-type]
        model_parts=[model],
        optimizers=optims,
        lr_schedulers=scheds,
        states={"train_state": state},
        sd_adapter=None,
    )
    if mode == "async_with_pinned_mem" and not torch.accelerator.is_available():
        # torchtitan builds DefaultStager(pinned memory, non-blocking copies),
        # which needs an accelerator (stock torchtitan fails the same way on
        # CPU); its CPU equivalent keeps the mode's path: async staging, the
        # process executor (the writer pickled into DCP's checkpoint process).
        mgr.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
            )
        )
    return model, optims, scheds, loader, state, mgr


def _install(mgr: Any, on: bool, s3: bool) -> Any:
    if not on:
        return None
    return titan.install(mgr, storage_options=OBJECT_STORE_OPTIONS if s3 else None)


def _step(model: Any, optims: Any, scheds: Any, loader: Counter, state: Counter, mgr: Any, step: int) -> None:
    mgr.maybe_wait_for_staging()  # where torchtitan's train loop waits, before the optimizer changes anything
    train(model, optims.optimizers[0], 1, seed=step)
    scheds.step()
    loader.values = {"position": 100 * step, "epoch": step // 3}
    state.values = {"step": step, "tokens": 1000 * step}


def _snapshot(model: Any, optims: Any, scheds: Any, loader: Counter, state: Counter) -> dict[str, Any]:
    snap = full_state(model, optims.optimizers[0])
    snap.update(sched=scheds.state_dict(), loader=loader.state_dict(), state=state.state_dict())
    return snap


def _check(ref: dict[str, Any], got: dict[str, Any], where: str) -> None:
    if dist.get_rank() == 0:
        assert_same(ref, got, where)
    for key in ("sched", "loader", "state"):
        assert got[key] == ref[key], f"{where}: {key} {got[key]} != {ref[key]}"


def _committed(folder: str, s3: bool) -> list[int]:
    storage = dcpstore.open_storage(folder, storage_options=OBJECT_STORE_OPTIONS if s3 else None)
    try:
        return sorted(s for o in storage.list() if (s := _step_of(o["path"])) is not None)
    finally:
        storage.close()


def _step_of(path: str) -> int | None:
    directory, _, name = path.rpartition("/")
    return titan.parse_step(directory) if name == ".metadata" else None


def job_save(rank: int, world: int, folder: str, mode: str, ours: bool, s3: bool) -> dict[int, dict[str, Any]]:
    """Steps 1..STEPS, each checkpointed; returns the reference at each."""
    model, optims, scheds, loader, state, mgr = _parts(0, folder, mode)
    _install(mgr, ours, s3)
    refs = {}
    for step in range(1, STEPS + 1):
        _step(model, optims, scheds, loader, state, mgr, step)
        mgr.save(step)
        refs[step] = _snapshot(model, optims, scheds, loader, state)
    mgr.maybe_wait_for_saving()
    mgr.close()
    return refs


def job_resume(
    rank: int, world: int, folder: str, mode: str, ours: bool, s3: bool, refs: dict[int, Any], purged: bool = True
) -> None:
    """A new model, optimizer, scheduler and manager over the same folder.
    ``purged``: whether the run that saved kept exactly ``KEEP`` steps (stock
    torchtitan's purge counts the async save in flight only if its directory
    exists yet, and misses steps on S3: the bug dcpstore fixes)."""
    model, optims, scheds, loader, state, mgr = _parts(1, folder, mode)
    _install(mgr, ours, s3)
    assert mgr.load() is True
    _check(refs[STEPS], _snapshot(model, optims, scheds, loader, state), f"load() of step {STEPS}")
    assert mgr.load(step=STEPS - 1) is True
    _check(refs[STEPS - 1], _snapshot(model, optims, scheds, loader, state), f"load(step={STEPS - 1})")
    if ours and purged:
        with pytest.raises(dcpstore.CheckpointNotFound, match="load_step=1 not found"):
            mgr.load(step=1)  # retention deleted it
    # The final step: torchtitan's model-only export, in export_dtype.
    last = STEPS + 1
    _step(model, optims, scheds, loader, state, mgr, last)
    mgr.save(last, last_step=True)
    want = full_state(model, optims.optimizers[0])["model"]
    mgr.close()
    export, _ = build(2)
    got = {k: v.to(torch.bfloat16) for k, v in export.state_dict().items()}
    where = dcpstore.LoadOptions(storage_options=OBJECT_STORE_OPTIONS if s3 else None)
    reader = dcpstore.StorageReader(f"{folder}/step-{last}", options=where)
    dcp.load(got, storage_reader=reader)  # resharding DTensors, as torchtitan's model-only load does
    gathered = {k: v.full_tensor() for k, v in got.items()}
    if rank == 0:
        for key, value in want.items():
            assert torch.equal(gathered[key], value.to(torch.bfloat16)), f"export: {key} differs"
    dist.barrier()
    if rank == 0:  # torchtitan purges after each save but the final export (which it does not count)
        got = _committed(folder, s3)
        assert (got if purged else got[-3:]) == [STEPS - 1, STEPS, last], f"keep_latest_k kept {got}"


def job_same_process(rank: int, world: int, folder: str, mode: str, s3: bool) -> None:
    refs = job_save(rank, world, folder, mode, True, s3)
    if rank == 0:
        assert _committed(folder, s3) == [STEPS - 1, STEPS]
    job_resume(rank, world, folder, mode, True, s3, refs)


def job_save_only(rank: int, world: int, folder: str, mode: str, ours: bool, s3: bool, out: str) -> None:
    refs = job_save(rank, world, folder, mode, ours, s3)
    torch.save(refs, f"{out}.{rank}")


def job_resume_from(
    rank: int, world: int, folder: str, mode: str, ours: bool, s3: bool, out: str, purged: bool
) -> None:
    job_resume(rank, world, folder, mode, ours, s3, torch.load(f"{out}.{rank}", weights_only=False), purged)


BACKENDS = ["local", "s3"]


class _HfNames:
    """A model's Hugging Face names, as torchtitan's state dict adapters give
    them: ``0.weight`` <-> ``model.layers.0.weight``, one file per layer."""

    fqn_to_index_mapping = {f"model.layers.{i}.{p}": 1 + i // 2 for i in (0, 2) for p in ("weight", "bias")}
    hf_assets_path = None

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        return {f"model.layers.{k}": v for k, v in state.items()}

    def from_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model.layers."): v for k, v in state.items()}


def job_hf(rank: int, world: int, folder: str, s3: bool) -> None:
    """torchtitan's last save in HF, then a new model's initial load from it."""
    model, optims, _, _, _, mgr = _parts(0, folder, "disabled")
    mgr.last_save_in_hf, mgr.sd_adapter, mgr.export_dtype = True, _HfNames(), torch.float32
    _install(mgr, True, s3)
    train(model, optims.optimizers[0], 1, seed=1)
    want = full_state(model, optims.optimizers[0])["model"]
    mgr.save(curr_step=STEPS, last_step=True)
    export = f"{folder}/step-{STEPS}"

    other, other_optims, _, _, _, fresh = _parts(1, f"{folder}-fresh", "disabled")  # an empty folder
    fresh.sd_adapter, fresh.initial_load_in_hf, fresh.initial_load_model_only = _HfNames(), True, True
    fresh.initial_load_path = export
    _install(fresh, True, s3)
    assert fresh.load()
    got = full_state(other, other_optims.optimizers[0])["model"]
    mgr.close()
    fresh.close()
    if rank != 0:
        return
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    storage = dcpstore.open_storage(export, storage_options=OBJECT_STORE_OPTIONS if s3 else None)
    names = sorted(o["path"] for o in storage.list())
    storage.close()
    # The model's two files and the index; the ranks' shards (in sharded/) are gone.
    assert [n for n in names if not n.startswith(".")] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ], names


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_save_in_hf_and_initial_load_in_hf(request: pytest.FixtureRequest, backend: str) -> None:
    """The final export in Hugging Face safetensors through dcpstore
    (sharded by FSDP over 2 ranks, consolidated in place into the model's
    files), and a new model's initial load from it, on each backend."""
    run_ranks(job_hf, 2, _folder(request, backend), backend == "s3", timeout=300)


def _folder(request: pytest.FixtureRequest, backend: str) -> str:
    from tests.support.backends import make_target

    target: Target = make_target(backend, request)
    return target.uri


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m != "async" else m for m in MODES])
def test_one_process_saves_and_resumes(request: pytest.FixtureRequest, backend: str, mode: str) -> None:
    """In one process, as torchtitan's fault-tolerance path meets it: what
    dcpstore wrote is what a new manager finds, loads and purges."""
    run_ranks(job_same_process, 2, _folder(request, backend), mode, backend == "s3", timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "saver, loader",
    [("stock", "dcpstore"), pytest.param("dcpstore", "stock", marks=pytest.mark.slow)],
)
def test_migration(request: pytest.FixtureRequest, tmp_path: Any, backend: str, saver: str, loader: str) -> None:
    """Checkpoints stock torchtitan wrote resume under dcpstore, and the
    reverse (each side in its own processes, as a restarted job is)."""
    folder, out = _folder(request, backend), str(tmp_path / "refs")
    s3 = backend == "s3"
    run_ranks(job_save_only, 2, folder, "async", saver == "dcpstore", s3, out, timeout=300)
    purged = saver == "dcpstore"  # stock's purge may miss the step in flight (and on S3, steps it cannot list)
    run_ranks(job_resume_from, 2, folder, "async", loader == "dcpstore", s3, out, purged, timeout=300)


def test_install_refuses_other_objects() -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="CheckpointManager"):
        titan.install(object())


def test_a_disabled_manager_needs_nothing(tmp_path: Any) -> None:
    mgr = CheckpointManager(
        CheckpointManager.Config(enable=False, folder=str(tmp_path)),
        dataloader=None,
        model_parts=[],
        optimizers=None,  # type: ignore[arg-type]
        lr_schedulers=None,  # type: ignore[arg-type]
        states={},
        sd_adapter=None,
    )
    assert titan.install(mgr) is None


def test_parse_step() -> None:
    assert titan.parse_step("step-100") == 100 and titan.parse_step("step-0") == 0
    for name in ("step-0100", "step_00000100", "step-", "xstep-1", "step-1x"):
        assert titan.parse_step(name) is None


def test_an_installed_manager_is_freed_when_dropped(tmp_path: Any) -> None:
    """dcpstore's install makes no reference cycle of the manager: dropped,
    it is freed at once and closed by torchtitan's ``__del__`` (its purge
    thread stopped), as a stock one is. (A cycle left the manager and its
    gloo group to the cyclic GC, alive past ``destroy_process_group()``:
    issue #38's exit abort was looked for there.)"""
    import gc
    import weakref

    from torch import nn

    config = CheckpointManager.Config(
        enable=True, folder=str(tmp_path / "ckpt"), keep_latest_k=KEEP, async_mode="disabled"
    )
    mgr = CheckpointManager(
        config,
        dataloader=None,
        model_parts=[nn.Linear(2, 2)],
        optimizers=None,  # type: ignore[arg-type]
        lr_schedulers=None,
        states={},
        sd_adapter=None,
    )  # type: ignore[arg-type]
    installed = titan.install(mgr)
    assert installed is not None and installed.manager is mgr
    purge, ref = mgr.purge_thread, weakref.ref(mgr)
    assert purge is not None and purge.is_alive()  # dcpstore's purge loop
    gc.disable()  # freed by reference counting alone, or not at all
    try:
        del mgr
        assert ref() is None, "the dropped manager outlived its last reference: a reference cycle"
    finally:
        gc.enable()
    purge.join(timeout=10)
    assert not purge.is_alive()  # torchtitan's close() ran (its __del__), stopping the purge loop
    installed.uninstall()  # the manager is gone: only what install opened is closed
    with pytest.raises(dcpstore.InvalidArgument, match="CheckpointManager dcpstore was installed on is gone"):
        installed.manager
