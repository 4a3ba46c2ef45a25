"""Megatron-Bridge 0.6.2's async ``fsdp_dtensor`` save, replayed call for
call on CPU ranks, through NVRx's own planner, finalize, ``AsyncRequest``
and ``AsyncCallsQueue``.

Bridge's ``save_checkpoint`` (``megatron/bridge/training/checkpointing.py``,
``ckpt_format="fsdp_dtensor"``, ``async_save=True``, NVRx installed) does,
on every rank::

    rank 0: ensure_directory_exists(checkpoint_name)          (os.makedirs)
    planner = DefaultSavePlanner()
    writer = FileSystemWriterAsync(checkpoint_name, thread_count=dist_ckpt_workers,
                                   use_msc=MultiStorageClientFeature.is_enabled())
    ret = save_state_dict_async_plan(state_dict, writer, None, 0, planner=planner,
                                     enable_cache=ckpt_assume_constant_structure)
    request = get_save_and_finalize_callbacks(writer, ret):
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*ret)],
                     async_fn_kwargs={}, preload_fn=preload_fn)
    rank 0: request.add_finalize_fn(train_state_finalize_fn)  (the tracker file)
    request.add_finalize_fn(barrier)
    async_calls_queue.schedule_async_request(request)
    barrier

and ``maybe_finalize_async_save`` -> ``queue.maybe_finalize_async_calls(blocking)``
each step (blocking at the end). :func:`bridge_save` is that sequence with
the writer class as a parameter. The queue is :func:`new_queue`: Bridge's
``GlobalState.initialize_async_checkpoint_worker`` -- NVRx's real
``AsyncCallsQueue(persistent=True)`` (Bridge requires the persistent worker
for async saves), whose worker is a spawned process that each request is
pickled to, then, on releases that have them (0.6+; Bridge's ``nvrx``
strategy cannot import 0.4.1 for want of them),
``warmup_persistent_caller(rank, cpu_priority=10, io_priority=3)`` (Bridge's
defaults), which spawns that worker before the first save, and
``get_write_results_queue("fork")``.

What needs CUDA, and its replay (:func:`cuda_device_is_cpu`), on every
release: NVRx's ``AsyncCaller.sync_all_async_calls`` and
``AsyncRequest.execute_finalize_fns`` (and, from 0.6,
``save_state_dict_async_finalize``'s failure broadcast) build their one-int
tensors on ``torch.cuda.current_device()``: that names the CPU inside a
rank, so the same collectives run on gloo. From 0.6 the persistent worker
binds a GPU when it starts (``torch.cuda.set_device(rank %
torch.cuda.device_count())`` and a one-element CUDA tensor), which a
CPU-only machine cannot: the replay starts it through NVRx's own
``async_process_target`` with ``cpu_shm_mode=True``, the release's branch
that skips exactly that binding (its only use of the flag in the worker).
Every other line of NVRx runs as it is. (0.4.1's worker makes no CUDA
call; NVRx's non-persistent ``TemporalAsyncCaller`` calls
``torch.cuda.synchronize()`` and is not usable on CPU-only torch.)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcpstore
from dcpstore._impl.manager import BRIDGE
from dcpstore._impl.storage import join_uri, open_storage
from dcpstore.adapters.megatron import install_in_bridge

TRACKER = BRIDGE.pointer


def iter_dir(step: int) -> str:
    """Bridge's ``get_checkpoint_name``: ``iter_{:07d}``."""
    return f"iter_{step:07d}"


#: The persistent worker's entry points that _start_worker (0.6+) picks from.
_WORKER_LOOPS = ("async_loop", "async_loop_for_daemon_worker")


@contextlib.contextmanager
def cuda_device_is_cpu() -> Iterator[None]:
    """``torch.cuda.current_device()`` names the CPU, and a persistent
    worker started meanwhile binds no GPU (see the module docstring)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    loops = {
        name: PersistentAsyncCaller.__dict__[name] for name in _WORKER_LOOPS if name in PersistentAsyncCaller.__dict__
    }
    target = getattr(PersistentAsyncCaller, "async_process_target", None)  # 0.6+
    binds_gpu = target is not None and "cpu_shm_mode" in inspect.signature(target).parameters
    if binds_gpu:
        for name in loops:  # the spawned worker unpickles this partial and runs the named loop there
            setattr(PersistentAsyncCaller, name, staticmethod(functools.partial(_worker_binding_no_gpu, name)))
    try:
        yield
    finally:
        torch.cuda.current_device = real  # type: ignore[assignment]
        for name, loop in loops.items():
            setattr(PersistentAsyncCaller, name, loop)


def _worker_binding_no_gpu(loop: str, *args: Any) -> None:
    """In the spawned worker: NVRx's own loop ``loop`` with its last argument,
    ``cpu_shm_mode``, True (the branch without the GPU binding)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import PersistentAsyncCaller

    getattr(PersistentAsyncCaller, loop)(*args[:-1], True)


def full_state(step: int, grow: int = 0) -> dict[str, Any]:
    """The global (unsharded) state of ``step``: model weights in fp32 and
    bf16, an optimizer with per-parameter tensors and param groups, and
    Bridge's plain items. ``grow``: rows added to one weight (a changed
    structure)."""
    g = torch.Generator().manual_seed(step)
    model = {
        f"decoder.layers.{i}.mlp.weight": torch.randn(12 + 5 * i + (grow if i == 1 else 0), 8, generator=g)
        for i in range(4)
    }
    model["embedding.word_embeddings.weight"] = torch.randn(29, 8, generator=g).bfloat16()
    optim = {
        "state": {
            k: {"exp_avg": torch.randn(v.shape, generator=g), "exp_avg_sq": torch.rand(v.shape, generator=g)}
            for k, v in model.items()
        },
        "param_groups": [{"lr": 1e-3 * step, "betas": (0.9, 0.95), "params": sorted(model)}],
    }
    return {"model": model, "optimizer": optim, "iteration": step, "checkpoint_version": 3.0}


def sharded(full: dict[str, Any], mesh: Any) -> dict[str, Any]:
    """``full`` as FSDP2 holds it: every tensor a DTensor sharded on dim 0."""
    out: dict[str, Any] = {}
    for key, value in full.items():
        if isinstance(value, dict):
            out[key] = sharded(value, mesh)
        elif isinstance(value, torch.Tensor):
            out[key] = distribute_tensor(value, mesh, [Shard(0)])
        else:
            out[key] = value
    return out


def mutate(state: dict[str, Any]) -> None:
    """Training changes every tensor in place right after the save returns."""
    for value in state.values():
        if isinstance(value, dict):
            mutate(value)
        elif isinstance(value, DTensor):
            value.to_local().add_(1000)


def zeros(full: Any) -> Any:
    """A load destination of ``full``'s structure (as DCP flattens it: into
    dicts, and into lists holding dicts) with none of its values."""
    if isinstance(full, dict):
        return {key: zeros(value) for key, value in full.items()}
    if isinstance(full, torch.Tensor):
        return torch.zeros_like(full)
    if isinstance(full, list) and any(isinstance(v, (dict, list)) for v in full):
        return [zeros(v) for v in full]
    return None


def assert_equal(want: Any, got: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys(), where
        for key in want:
            assert_equal(want[key], got[key], f"{where}.{key}")
    elif isinstance(want, list) and isinstance(got, list):
        assert len(want) == len(got), where
        for i, (w, g) in enumerate(zip(want, got)):
            assert_equal(w, g, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"values differ at {where}"
    else:
        assert got == want, where


def bridge_save(
    checkpointing: ModuleType,
    queue: Any,
    state: dict[str, Any],
    checkpoint_name: str,
    *,
    save_root: str | None = None,
    step: int = 0,
    workers: int = 1,
    use_msc: bool = False,
    constant_structure: bool = False,
    wrap_save_fn: Callable[[Any], Any] | None = None,
) -> Any:
    """One Bridge save (see the module docstring) with the writer class
    ``checkpointing`` binds (:func:`bridge_module`); returns the writer.
    ``save_root``: where rank 0's tracker finalize writes
    ``latest_checkpointed_iteration.txt`` (Bridge writes it with ``open()``,
    so local roots only; None: no tracker). ``wrap_save_fn``: wraps the
    save function before scheduling (a fault in the worker)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from torch.distributed.checkpoint import DefaultSavePlanner

    rank = dist.get_rank()
    if rank == 0 and "://" not in checkpoint_name:
        os.makedirs(checkpoint_name, exist_ok=True)
    planner = DefaultSavePlanner()
    writer = checkpointing.FileSystemWriterAsync(checkpoint_name, thread_count=workers, use_msc=use_msc)
    ret = save_state_dict_async_plan(state, writer, None, 0, planner=planner, enable_cache=constant_structure)
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    if wrap_save_fn is not None:
        save_fn = wrap_save_fn(save_fn)
    request = AsyncRequest(
        save_fn, save_args, [lambda: save_state_dict_async_finalize(*ret)], async_fn_kwargs={}, preload_fn=preload_fn
    )
    if rank == 0 and save_root is not None:

        def train_state_finalize_fn() -> None:
            with open(os.path.join(save_root, TRACKER), "w") as f:
                f.write(str(step))

        request.add_finalize_fn(train_state_finalize_fn)
    request.add_finalize_fn(dist.barrier)
    queue.schedule_async_request(request)
    dist.barrier()
    return writer


def bridge_module(**io: Any) -> ModuleType:
    """Bridge 0.6.2's ``megatron.bridge.training.checkpointing`` as far as
    storage goes (Bridge itself needs CUDA to import): its three names for
    the writers and the reader, bound as Bridge binds them (NVRx's async
    writer, stock DCP's sync writer and reader), then
    ``install_in_bridge(module, **io)`` -- the user's one change
    (``checkpoint_config=`` among ``io``: Bridge's checkpoint config)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync as NvrxWriter

    module = ModuleType("megatron.bridge.training.checkpointing")
    module.FileSystemWriterAsync = NvrxWriter  # type: ignore[attr-defined]
    module._create_fsdp_dtensor_storage_writer = lambda path: dcp.FileSystemWriter(path)  # type: ignore[attr-defined]
    module._get_filesystem_reader = lambda path, cache_metadata=False, async_strategy="mcore": dcp.FileSystemReader(
        path
    )  # type: ignore[attr-defined]
    install_in_bridge(module, **io)
    return module


def new_queue(cpu_shm: bool = False) -> Any:
    """Bridge's async set-up on this rank (see the module docstring): the
    persistent queue, warmed up where the release can. ``cpu_shm``:
    megatron-core's ``--async-ckpt-use-cpu-shm`` set-up instead
    (``init_persistent_async_worker``): ``cpu_shm_mode=True`` for the queue
    and its warm-up where the release takes it (0.6+), a worker that binds
    no GPU and gets every tensor through CPU shared memory."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    shm: dict[str, Any] = {}
    if cpu_shm and "cpu_shm_mode" in inspect.signature(AsyncCallsQueue.__init__).parameters:
        shm["cpu_shm_mode"] = True
    queue = AsyncCallsQueue(persistent=True, **shm)
    if hasattr(queue, "warmup_persistent_caller"):
        queue.warmup_persistent_caller(dist.get_rank(), cpu_priority=10, io_priority=3, **shm)
    if hasattr(filesystem_async, "get_write_results_queue"):
        results = filesystem_async.get_write_results_queue("fork")
        # NVRx drops the Manager and keeps only this proxy; the Manager's server
        # would outlive a rank that ends in os._exit (run_ranks_codes).
        _results_managers.append(getattr(results, "_manager", None))
    return queue


_results_managers: list[Any] = []


def stop_results_managers() -> None:
    """Shut the Managers :func:`new_queue` made on this rank down (a rank
    that exits through os._exit or dies by SIGKILL would orphan them)."""
    while _results_managers:
        manager = _results_managers.pop()
        if manager is not None:
            manager.shutdown()


def mesh_of(world: int) -> Any:
    return init_device_mesh("cpu", (world,))


# -- checking what landed, with stock DCP as the oracle ----------------------


def local_copy(uri: str, io: dict[str, Any], dest: Path) -> Path:
    """Every object under ``uri``, copied into ``dest`` (for stock
    ``FileSystemReader``: stock DCP reads only local paths)."""
    if "://" not in uri:
        return Path(uri)
    storage = open_storage(uri, **io)
    try:
        for obj in storage.list():
            target = dest / obj["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(storage.read(obj["path"]))
    finally:
        storage.close()
    return dest


def stock_load(path: Path, full: dict[str, Any]) -> dict[str, Any]:
    """``dcp.load`` with stock ``FileSystemReader`` into plain tensors of
    the global shapes (a resharded load: saved on N ranks, read on one)."""
    out = zeros(full)
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return out


def check_step(root: str, step: int, io: dict[str, Any], scratch: Path) -> None:
    """``root/iter_{step}`` holds exactly step ``step``'s state: by stock
    ``dcp.load`` (the oracle) and by ``dcpstore.load`` (every checksum
    verified against the manifest the commit wrote)."""
    uri = join_uri(root, iter_dir(step))
    full = full_state(step)
    assert_equal(full, stock_load(local_copy(uri, io, scratch / f"copy{step}"), full))
    ours = zeros(full)
    dcpstore.load(ours, uri, **io)
    assert_equal(full, ours)
    storage = open_storage(uri, **io)
    names = {o["path"] for o in storage.list()}
    storage.close()
    assert ".metadata" in names and any(n.startswith(".dcpstore") and n.endswith(".json") for n in names), names


# -- ranks whose exit codes are the test's business ---------------------------


def _rank_entry(
    rank: int, world: int, port: int, env: dict[str, str], fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    os.environ.clear()
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    fn(rank, world, *args)
    stop_results_managers()
    os._exit(0)  # no teardown collective: a peer may be dead (see run_ranks_codes)


def run_ranks_codes(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> list[int | None]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; their exit codes
    (``-9``: SIGKILLed), for jobs in which a rank dies on purpose."""
    from tests.support.dist_utils import PRELOAD, free_port

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    port, env = free_port(), dict(os.environ)
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, env, fn, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"{fn.__name__} rank {procs.index(p)} hung")
    return [p.exitcode for p in procs]


def die_mid_write(save_fn: Any, *args: Any) -> None:
    """A save function that runs ``save_fn`` in the worker and, at the first
    chunk it writes into a data file, SIGKILLs the trainer (its parent) and
    itself: the whole rank dies mid-save. Scheduled instead of
    ``save_fn`` on the rank that dies (pickled to the worker by name)."""
    import dcpstore._impl.adapters.megatron_worker as writer_module
    from tests.support.faults import EventStorage

    real = writer_module.open_storage

    def hook(event: str) -> None:
        if event.startswith("wrote:") and event.endswith(".distcp"):
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    writer_module.open_storage = lambda uri, **kw: EventStorage(real(uri, **kw), hook)  # type: ignore[assignment]
    save_fn(*args)


def dying(save_fn: Any) -> Any:
    return functools.partial(die_mid_write, save_fn)
