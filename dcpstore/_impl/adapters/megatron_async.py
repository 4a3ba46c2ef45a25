"""A drop-in for NVRx's ``FileSystemWriterAsync``: Megatron's async saves
under dcpstore's commit, on any backend.

Megatron-Bridge (``ckpt_format="fsdp_dtensor"``, ``async_save=True``) builds
NVRx's writer inline and drives it through NVRx's planner and an
``AsyncRequest`` for its async worker. :class:`FileSystemWriterAsync` takes
the same constructor and speaks the same protocol, so that line changes only
its import. Call order of one save, per rank, and where each step runs::

    trainer   save_state_dict_async_plan(state, writer, ...)      NVRx's
                set_up_storage_writer, prepare_local_plan (the local plan is
                kept: see "Constant structure"), prepare_global_plan or
                prepare_decentralized_global_plan (rank prefixes only: the
                plan carries nothing per save, so NVRx may cache it)
                prepare_write_data: the coordinator claims the URI
                (SaveSession.claim) and broadcasts the session's token on
                ``process_group`` (a collective of ours); then the
                items are resolved into size-balanced buckets, one data
                file each (no copy yet)
    trainer   get_save_function_and_args() -> (save_fn, preload_fn, args)
    worker    preload_fn(): a consistent snapshot (CPU tensors cloned,
                device tensors copied to host); the trainer waits for it
                (NVRx's persistent caller) or runs it itself
    worker    save_fn(job, staged): reopens the storage from the job's
                description, writes each bucket on its own thread, publishes
                no file unless the URI is still this save's, and leaves its
                write results (or its error) in a private results file
                (:mod:`.megatron_worker`)
    trainer   save_state_dict_async_finalize(writer, metadata, wrapper)  NVRx's
                retrieve_write_results: the results file; then every
                rank's outcome, all-gathered (our second collective): if
                any rank failed, every rank raises the same SaveError
                before NVRx's gather, and nothing is committed
                finish (coordinator, after NVRx gathered every rank's
                results): SaveSession.publish -- the ownership check, the
                manifest, then ``.metadata`` last, the commit point

The worker is a separate process (NVRx's persistent caller: spawned once,
the request pickled to it), so the save function is self-contained: see
:mod:`.megatron_worker`.

NVRx releases. Tested with 0.4.1 (Python 3.11) and with 0.6.0 and 0.7.0
(Python 3.12; ``scripts/setup-nvrx312.sh``): ``tests/frameworks/test_megatron_bridge.py``
replays Bridge 0.6.2's async set-up and saves on each, including, where the
release has it (0.6+), ``AsyncCallsQueue.warmup_persistent_caller``, after
which the saves run in the warmed-up worker. The constructor takes every
release's keywords as explicit parameters (0.6 added ``is_multiproc_io``,
``use_cached_data_structure``, ``use_cpu_shm_for_gpu_tensors``; Megatron
looks for them in this signature); the protocol NVRx's planner, finalize and
queue speak to a writer is the same in the three. What 0.6 changed in the
persistent worker (spawned at warm-up, a daemon by default, GPU-bound at
start unless ``cpu_shm_mode``, a cache of tensor hand-overs keyed by plan,
cleared by a restart callback) serves NVRx's own writer: this writer's
requests carry their tensors each time, the worker keeps nothing between
saves, and it writes with threads, which a daemon may start.

Constant structure. ``enable_cache=True`` (Bridge's
``ckpt_assume_constant_structure``) lets NVRx replay the plans of an earlier
save once two in a row were equal; nothing of this writer's is in those
plans. A replayed plan written against a changed state dict would be
silently wrong (a grown tensor saved at its old size, a new key left out),
so every save compares the local plan NVRx hands over with the state dict
the planner holds (DCP's default local plan of it) and each resolved tensor
with its plan item; a difference fails that save (:class:`SaveError`
naming the keys, on every rank), and the committed checkpoints stay as they are.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcpstore._impl.adapters.megatron_worker import Bucket, Preload, WorkerJob, read_results, write_buckets
from dcpstore._impl.dcp.failures import describe_failure
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.dropin import check_writer_args
from dcpstore._impl.storage import Storage, StorageOptions, open_storage, with_msc
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import InvalidArgument, SaveError
from dcpstore._impl.util.torch_compat import DistWrapper, StreamTransformExtension
from dcpstore._impl.values.keywords import resolve_options
from dcpstore._impl.values.options import SaveOptions
from dcpstore._impl.values.results import SaveStats

log = logging.getLogger(__name__)


class FileSystemWriterAsync(DcpStorageWriter):
    """NVRx's ``FileSystemWriterAsync``, on every backend dcpstore serves;
    see the module docstring for the protocol and where each part runs.

    Args:
        path: a local path or a URI (``s3://``, ``msc://``, ``file://``, an
            fsspec scheme), where NVRx's takes a POSIX path or an MSC URL.
        single_file_per_rank, sync_files, thread_count,
            per_thread_copy_ahead, cache_staged_state_dict, overwrite,
            _extensions, serialization_format: ``FileSystemWriter``'s, as
            NVRx takes them. ``thread_count``: data files (and threads)
            per rank. ``single_file_per_rank=False``: one file per item
            (NVRx refuses it). ``sync_files=False`` is accepted; every data
            file is durable before the commit anyway. ``overwrite=False``
            refuses a URI holding a committed checkpoint. Only
            ``SerializationFormat.TORCH_SAVE``.
        separation_hint: NVRx's; refused unless ``None`` (its extra file
            names are not DCP's).
        use_msc: NVRx's: Megatron's ``--enable-msc``; routes plain paths and
            ``s3://`` through NVIDIA Multi-Storage-Client (``msc://`` URLs
            always go there).
        is_multiproc_io: NVRx 0.6+'s: write the data files from child
            processes of the worker instead of threads. Accepted: this
            writer's worker writes each data file on its own thread either
            way (file writes release the GIL), so the files,
            their bytes and their durability are the same; unlike NVRx's,
            it also works in NVRx's default daemon worker.
        use_cached_data_structure: NVRx 0.6+'s: let the worker keep the CUDA
            IPC handles of a plan's tensors across saves. Accepted: an
            optimisation of the hand-over only; this writer hands every
            save's tensors over afresh, so a replaced allocation can never
            be written from a stale handle.
        use_cpu_shm_for_gpu_tensors: NVRx 0.6+'s: snapshot every tensor into
            CPU shared memory on the trainer, at planning, so that the
            worker never imports CUDA IPC handles nor reads training's
            tensors (what ``AsyncCallsQueue(cpu_shm_mode=True)``, whose
            worker binds no GPU, needs). Honoured: the worker then writes
            those snapshots as they are.
        open_file: NVRx 0.6+'s test hook replacing ``open``; refused unless
            it is ``open`` (this writer writes through dcpstore's storage).
        storage_options: dcpstore's backend tuning.
        process_group: the group NVRx plans on (``save_state_dict_async_plan``'s;
            Bridge's: the default group). Its rank 0 is the coordinator.

    Raises:
        InvalidArgument: an argument it cannot honour, naming it.
    """

    #: NVRx's planner may prepare the global plan on each rank.
    can_run_decentralized_global_plan: bool = True
    claims_before_planning = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        separation_hint: str | None = None,
        use_msc: bool = False,
        is_multiproc_io: bool = False,
        use_cached_data_structure: bool = False,
        use_cpu_shm_for_gpu_tensors: bool = False,
        open_file: Callable[..., Any] = open,
        storage_options: StorageOptions | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        # Every NVRx release's keywords are explicit parameters: Megatron
        # detects a writer feature by its name in this signature
        # (``inspect.signature(FileSystemWriterAsync.__init__)``).
        check_writer_args(
            per_thread_copy_ahead=per_thread_copy_ahead,
            serialization_format=serialization_format,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            use_msc=use_msc,
            is_multiproc_io=is_multiproc_io,
            use_cached_data_structure=use_cached_data_structure,
            use_cpu_shm_for_gpu_tensors=use_cpu_shm_for_gpu_tensors,
        )
        if separation_hint is not None:
            raise InvalidArgument(
                f"separation_hint={separation_hint!r} is not supported: its files are not named as DCP names "
                "data files; leave it None (Megatron-Bridge does)"
            )
        if open_file is not open:
            raise InvalidArgument(
                f"open_file={open_file!r} is not supported: this writer writes through dcpstore's storage, "
                "not a file opener; leave it out (NVRx's test hook; Megatron never passes it)"
            )
        self.use_msc = use_msc
        self.storage_options = storage_options
        #: Where the bytes go: ``storage_options`` with NVRx's ``use_msc`` folded in.
        self.where = with_msc(storage_options, use_msc)
        self.process_group = process_group
        super().__init__(
            self._open(path),
            workers=_workers(thread_count),
            reopen=self._open,
            single_file_per_rank=single_file_per_rank,
            overwrite=overwrite,
            extensions=_extensions or (),
        )
        self.extensions = tuple(_extensions or ())
        self.sync_files = sync_files
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.separation_hint = separation_hint
        self.is_multi_proc_io = is_multiproc_io  # NVRx's attribute name
        self.use_cached_data_structure = use_cached_data_structure
        self.use_cpu_shm_for_gpu_tensors = use_cpu_shm_for_gpu_tensors
        self.error: BaseException | None = None
        self.write_buckets: list[Bucket] | None = None
        self._local_plan: SavePlan | None = None
        self._results_path: str | None = None
        #: How the current save's finalize ended (None: not finalized yet).
        self._finalized: str | None = None

    @staticmethod
    def _save_slots() -> types.SimpleNamespace:
        """NVRx's protocol runs one save at a time through a writer, its
        calls on whichever thread Megatron's queue finalizes on: the current
        save is the writer's, not a thread's."""
        return types.SimpleNamespace()

    def _open(self, uri: str | os.PathLike[str]) -> Storage:
        self.checkpoint_dir = os.fspath(uri)
        return open_storage(uri, storage_options=self.where)

    @property
    def thread_count(self) -> int:
        return self.workers

    # -- planning (NVRx's save_state_dict_async_plan) ------------------------
    def storage_meta(self) -> StorageMeta | None:
        return None  # the commit records the session's own

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        save = self._begin(self.storage)  # releases a previous save through this writer that never finished
        save.running = True
        save.stats = SaveStats(started=time.perf_counter())
        self.is_coordinator = is_coordinator
        self.error, self.write_buckets, self._local_plan = None, None, None
        self._finalized = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._local_plan = plan  # fresh, or NVRx's cached one: checked in prepare_write_data
        return plan

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Claim (coordinator) and share the session (collective on
        ``process_group``), then resolve this rank's items into buckets.

        Raises:
            CheckpointExists, SaveError: the claim failed (on every rank).
        A failure of this rank's own (a changed structure) is kept and
        raised by :meth:`retrieve_write_results` on every rank together
        (raised here, it would leave the other ranks in NVRx's next
        collective)."""
        wrapper = DistWrapper(self.process_group, is_distributed(), 0)
        # Raises on every rank alike (the coordinator's outcome is broadcast):
        # a refused URI (CheckpointExists) fails the save at once.
        self.claim_shared(wrapper)
        try:
            if wrapper.is_coordinator != bool(self.is_coordinator):
                raise InvalidArgument(
                    "FileSystemWriterAsync commits on rank 0 of its process_group: plan with coordinator_rank=0 "
                    "(as Megatron-Bridge does) and the same process group"
                )
            _check_structure(self._local_plan, plan, planner)
            self.write_buckets = self._buckets(plan, planner)
        except BaseException as e:
            self.error, self.write_buckets = e, []
        self.stats.plan_s = time.perf_counter() - self.stats.started

    def _buckets(self, plan: SavePlan, planner: SavePlanner) -> list[Bucket]:
        """This rank's items resolved into one bucket per data file; with
        ``use_cpu_shm_for_gpu_tensors`` every tensor already copied into a
        private CPU shared-memory snapshot (then the preload has nothing
        left to stage)."""
        buckets: list[Bucket] = []
        snapshot = self.use_cpu_shm_for_gpu_tensors
        for name, items in self.named_buckets(plan):
            blobs, tensors = [], []
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    blobs.append((item, data))
                else:
                    tensor = _checked_tensor(item, data)
                    tensors.append((item, _shm_snapshot(tensor) if snapshot else tensor))
            buckets.append((self.storage.describe(name), name, (blobs, tensors)))
        return buckets

    # -- the async part ------------------------------------------------------
    def get_save_function_and_args(self) -> tuple[Callable[..., None], Callable[[], list[Bucket]], list[Any]]:
        """(save function, preload function, arguments): the worker calls
        ``save_fn(*args)`` with ``args[1]`` replaced by ``preload_fn()``.
        Always a function, even with nothing to write (or a failed
        preparation): every rank's worker then reports, so NVRx's caller
        sees every rank finish."""
        buckets = self.write_buckets or []
        session = self._save().session
        token = session.token if session is not None else ("", False)
        self._results_path = os.path.join(
            tempfile.gettempdir(), f"dcpstore-megatron-{os.getpid()}-{token[0]}-{secrets.token_hex(6)}.json"
        )
        job = WorkerJob(self.storage.url.uri, self.where, *token, self.extensions, self._results_path)
        if self.error is not None:
            buckets = []
        return write_buckets, Preload(buckets, staged=self.use_cpu_shm_for_gpu_tensors), [job, buckets]

    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results, once every rank's are known to be
        there (collective on ``process_group``: one all-gather of each
        rank's outcome).

        Raises:
            SaveError: on *every* rank when any rank's preparation or
                worker failed, naming the ranks and causes. (NVRx's finalize
                would raise on the coordinator only and leave the others to
                wait for it in Bridge's next barrier; raised here, before its
                gather, every rank stops together.)
        """
        if self._finalized is not None:
            # Every rank finalized this save once (the outcome of that was
            # all-gathered), so every rank refuses here alike, with no
            # collective. NVRx's own writer raises too ("results_queue should
            # not be empty"), naming no cause.
            raise InvalidArgument(
                f"save_state_dict_async_finalize called again for the save to {self.storage.uri}, already "
                f"finalized: {self._finalized}. It runs once per save; this second call changed nothing"
            )
        results: list[WriteResult] = []
        write_s = 0.0
        error: BaseException | None = None
        try:
            results, write_s = self._read_results()  # always: it removes the file
        except BaseException as e:
            error = e
        error = self.error or error  # a failed preparation: its error, not the worker's
        wrapper = DistWrapper(self.process_group, is_distributed(), 0)
        outcomes = wrapper.all_gather_object(None if error is None else describe_failure(error))
        if any(what is not None for what in outcomes):
            self.release()  # the coordinator: gc may collect what the save left
            why = f"save to {self.storage.uri} failed, nothing was committed: {_by_rank(outcomes)}"
            self._finalized = f"it failed, nothing was committed ({_by_rank(outcomes)})"
            raise SaveError(why) from error
        self._finalized = "this rank's results went to the commit on the coordinator (rank 0 of the process group)"
        self.stats.write_s = write_s
        self.stats.bytes_written = sum(r.storage_data.file_size for r in results if r.storage_data.offset == 0)
        self.stats.files = sorted({r.storage_data.relative_path for r in results})
        log.info(
            "wrote %d bytes in %d file(s) to %s in %.2f s (Megatron async worker)",
            self.stats.bytes_written,
            len(self.stats.files),
            self.storage.uri,
            self.stats.write_s,
        )
        return results

    def _read_results(self) -> tuple[list[WriteResult], float]:
        uri = self.storage.uri
        if self._results_path is None:
            raise SaveError(
                f"save to {uri}: retrieve_write_results before get_save_function_and_args"
            )  # a caller's bug
        try:
            found = read_results(self._results_path)
        except FileNotFoundError:
            raise SaveError("the async save worker left no results (it did not run, or died)") from None
        except ValueError as e:
            raise SaveError(f"unreadable results from the async save worker ({e})") from e
        if isinstance(found, str):
            raise SaveError(f"in the async save worker: {found}")
        return found

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            super().finish(metadata, results)
        except BaseException as e:
            self._finalized = f"its commit failed ({e})"
            raise
        self._finalized = "committed"
        files = {r.storage_data.relative_path for rs in results for r in rs}
        log.info(
            "committed %s: %d data file(s) from %d rank(s), %.2f s to commit",
            self.storage.uri,
            len(files),
            len(results),
            self.stats.commit_s,
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        raise NotImplementedError(
            "FileSystemWriterAsync writes through save_state_dict_async_plan and its save function; "
            "under dcp.save use dcpstore.StorageWriter"
        )


def _workers(thread_count: int | None) -> int | None:
    """NVRx's ``thread_count``, the options' ``workers``, resolved as the
    drop-ins resolve it: a bad one is refused under the name it was given."""
    resolved = resolve_options(FileSystemWriterAsync, None, base=SaveOptions(), given={"workers": thread_count})
    return resolved.workers


def _by_rank(outcomes: Sequence[str | None], shown: int = 4) -> str:
    """``rank 1: why; ranks 0, 2: why`` for the failed ranks (the same
    failure on several ranks said once)."""
    ranks: dict[str, list[int]] = {}
    for rank, what in enumerate(outcomes):
        if what is not None:
            ranks.setdefault(what, []).append(rank)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {what}" for what, rs in ranks.items()]
    return "; ".join(parts[:shown]) + (f"; and {len(parts) - shown} more" if len(parts) > shown else "")


def _shm_snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s current value in CPU shared memory, owned by
    the save: pickled to NVRx's worker it travels as a shared-memory handle
    (no CUDA IPC), and training may change ``tensor`` once this returns. A
    blocking copy: a device tensor's bytes have landed when it returns."""
    snapshot = torch.empty(tensor.shape, dtype=tensor.dtype)
    snapshot.share_memory_()  # type: ignore[no-untyped-call]  # in place: moves the new storage to shared memory
    snapshot.copy_(tensor)
    return snapshot


def _checked_tensor(item: WriteItem, data: Any) -> torch.Tensor:
    """The resolved tensor of ``item``, if it is what the plan says it is."""
    td = item.tensor_data
    if not isinstance(data, torch.Tensor) or td is None:
        raise SaveError(f"{_STALE}: {item.index.fqn!r} is a {type(data).__name__}, the plan has a tensor{_REPLAN}")
    want = (tuple(td.chunk.sizes), td.properties.dtype)
    if (tuple(data.shape), data.dtype) != want:
        raise SaveError(
            f"{_STALE}: {item.index.fqn!r} is {list(data.shape)} {data.dtype}, "
            f"the plan has {list(want[0])} {want[1]}{_REPLAN}"
        )
    return data.detach()


_STALE = "the state dict no longer matches the save plan"
_REPLAN = (
    " (a plan replayed from an earlier save: ckpt_assume_constant_structure=True; save with it False after "
    "changing the model or optimizer)"
)


def _shape_of(item: WriteItem) -> tuple[Any, ...]:
    """What of a write item a replayed plan must still match."""
    td = item.tensor_data
    if td is None:
        return (item.type,)
    return (item.type, tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.properties.dtype, tuple(td.size))


def _check_structure(local_plan: SavePlan | None, plan: SavePlan, planner: SavePlanner) -> None:
    """The plans NVRx handed over -- the local one (NVRx 0.4.1 replays the
    cached one) and this rank's central one (replayed by every release that
    caches) -- against DCP's default local plan of the state dict the
    planner holds now: the same items, each with the same chunk, dtype and
    global size, and no central item the state dict no longer has. Only for
    a planner that plans as DCP's default one (another's plan cannot be
    recomputed here; each resolved tensor is still checked against its item)."""
    state = getattr(planner, "state_dict", None)
    default = (
        isinstance(planner, DefaultSavePlanner)
        and type(planner).create_local_plan is DefaultSavePlanner.create_local_plan
    )
    if not default or not isinstance(state, dict):
        return
    coordinator = bool(getattr(planner, "is_coordinator", False))
    now = _by_fqn(create_default_local_save_plan(state, coordinator).items)
    planned = _by_fqn(local_plan.items) if local_plan is not None else now
    central = _by_fqn(plan.items)
    stale = {k for k in central if k not in now or not set(central[k]) <= set(now[k])}
    if now == planned and not stale:
        return
    added = sorted(now.keys() - planned.keys())
    gone = sorted((planned.keys() - now.keys()) | (central.keys() - now.keys()))
    changed = sorted({k for k in now.keys() & planned.keys() if now[k] != planned[k]} | (stale & now.keys()))
    parts = [
        f"{what}: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
        for what, names in (("new", added), ("gone", gone), ("changed", changed))
        if names
    ]
    raise SaveError(f"{_STALE} ({'; '.join(parts)}){_REPLAN}")


def _by_fqn(items: Sequence[WriteItem]) -> dict[str, list[tuple[Any, ...]]]:
    """Each key's write items (its chunks), by what must match."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for item in items:
        out.setdefault(item.index.fqn, []).append(_shape_of(item))
    return {fqn: sorted(shapes, key=repr) for fqn, shapes in out.items()}
