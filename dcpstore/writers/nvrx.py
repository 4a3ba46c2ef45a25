"""The NVRx engine: NVRx's ``FileSystemWriterAsync`` under dcpstore's protocol.

Runs on the background thread of :class:`~dcpstore.writers.async_engine.AsyncSaver`
with a state dict that is already staged (host memory, owned by the save).
Release differences are handled in :mod:`dcpstore.adapters.nvrx`.

Call order of one save, per rank::

    claim       coordinator: retract .metadata/manifest, write the in-flight
                marker with a fresh save id; then broadcast the id (the sync
                point: no rank writes before the old commit is gone)
    plan        NVRx save_state_dict_async_plan (reduce_scatter of plans, or
                NVRx's metadata cache when every rank's structure is unchanged)
                -> prepare_write_data: size-balanced buckets, one file each
    write       one thread per bucket: check the URI is still ours, NVRx's
                per-bucket writer (torch.save per item, fsync), read the file
                back once to compute its CRC32Cs for the manifest (NVRx has no
                checksum hook), check again
    finalize    NVRx save_state_dict_async_finalize: gather write results on the
                coordinator; if every rank succeeded, finish(): ownership
                check, manifest, .metadata last (dcpstore's Storage: atomic,
                durable), marker removed
    outcome     the coordinator broadcasts success or the failure, so every
                rank's handle raises when any rank failed

Durability on POSIX: NVRx fsyncs each data file in place (no rename); the
manifest's atomic put then fsyncs the checkpoint directory, which makes the
data files' directory entries durable before ``.metadata`` is renamed into
place.

Two saves to one URI: as with the native writer the later one wins and the
earlier fails before committing; but NVRx writes data files in place (no
rename), so the earlier save checks before and after each file rather than at
the moment the file is published.

A failed save: every rank removes the data files it wrote (NVRx writes them
in place, under their final names, so they would otherwise hold the space the
next save needs), and a write error inside torch.save -- a full disk -- is
raised as a StorageError naming the file and its errno rather than torch's
"unexpected pos" (see ``adapters.nvrx.bucket_writer``).

Integrity: the same manifest (file sizes and CRC32C, item CRC32C,
``.metadata`` CRC) as the native writer, computed from a read-back of what
NVRx wrote rather than while streaming; on an MSC object store that read-back
is one extra GET of each data file.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, cast

import torch

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from ..adapters import nvrx as adapter
from ..errors import CheckpointError, SaveError
from ..storage import Storage, redact
from ..storage.kit import map_os_error
from .dcp import SaveStats, _cpu_tensor, check_still_ours, checksum_written_file, claim, commit_checkpoint
from .layout import METADATA
from .threads import run_parallel

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def writer_class() -> type:
    """``FileSystemWriterAsync`` with dcpstore's commit protocol (built lazily:
    NVRx is optional)."""
    base = adapter.writer_base()

    class NvrxWriter(base):  # type: ignore[misc,valid-type]
        """NVRx's writer; planning, bucketing and file writing are NVRx's,
        the retraction, the checksums and the commit are dcpstore's."""

        def __init__(self, storage: Storage, target: adapter.NvrxTarget, workers: int) -> None:
            super().__init__(target.path, thread_count=workers, use_msc=target.use_msc)
            self.storage = storage
            self.stats = SaveStats(_t0=time.perf_counter())
            self.save_id = ""  # set by nvrx_save once the coordinator claimed the URI
            self.old_data: frozenset[str] | None = None  # what the claim found (coordinator)
            self.error: BaseException | None = None
            self.results: list[WriteResult] = []
            self.write_buckets: list[Any] = []

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            self.storage.makedirs()  # the claim already retracted any old commit
            return plan

        def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
            # NVRx's version also starts its spawn-context Manager; build the
            # same buckets without it. A failure here is local to this rank:
            # keep it and report it through finalize, so no rank is left
            # waiting in the gather.
            try:
                self.write_buckets = self._buckets(plan, planner)
            except BaseException as e:
                self.error = e

        def _buckets(self, plan: SavePlan, planner: SavePlanner) -> list[Any]:
            prefix: _StoragePrefix = plan.storage_data
            buckets: list[Any] = []
            for items in adapter.split_items(self.thread_count, list(plan.items)):
                if not items:
                    continue
                name = f"{prefix.prefix}{len(buckets)}{DEFAULT_SUFFIX}"
                blobs = [(it, planner.resolve_data(it)) for it in items if it.type == WriteItemType.BYTE_IO]
                # _cpu_tensor: a view of a larger storage is written compactly
                # (torch.save would write the whole storage), as NVRx does too.
                tensors = [
                    (it, _cpu_tensor(cast(torch.Tensor, planner.resolve_data(it))))
                    for it in items
                    if it.type != WriteItemType.BYTE_IO
                ]
                buckets.append((os.path.join(self.checkpoint_dir, name), name, (blobs, tensors)))
            return buckets

        def write_all(self) -> None:
            """Write every bucket, one thread each; keep results or the error."""
            if self.error is not None or not self.write_buckets:
                return
            t0 = time.perf_counter()
            write = adapter.bucket_writer(self)

            def one(bucket: Any) -> list[WriteResult]:
                check_still_ours(self.storage, self.save_id)
                try:
                    written = write(bucket)
                except OSError as e:  # NVRx writes with open(): name the file and the cause
                    raise map_os_error(e, f"cannot write {self.storage.describe(bucket[1])}") from e
                results = checksum_written_file(self.storage, bucket[1], written)
                check_still_ours(self.storage, self.save_id)
                return results

            try:
                per_file = run_parallel(one, self.write_buckets, len(self.write_buckets), "dcpstore-nvrx")
            except BaseException as e:
                self.error = e
                return
            self.results = [r for rs in per_file for r in rs]
            self.stats.write_s = time.perf_counter() - t0
            self.stats.bytes_written = sum(r.storage_data.file_size for r in self.results if r.storage_data.offset == 0)
            self.stats.files = sorted({r.storage_data.relative_path for r in self.results})

        def discard(self) -> None:
            """After a failed save: remove the data files this rank wrote.
            NVRx writes them in place under their final names, so without
            this a failed save (say, a full disk) leaves them taking the
            space the next save needs. Left alone when another save to the
            URI has taken over (they are its files now) or when this save's
            ``.metadata`` exists after all (a failure after the commit)."""
            names = [bucket[1] for bucket in self.write_buckets]
            if not names or not self.save_id:
                return
            try:
                check_still_ours(self.storage, self.save_id)
                if not self.storage.exists(METADATA):
                    self.storage.delete(names)
            except CheckpointError as e:
                log.warning("failed save to %s: left its data files in place (%s)", self.storage.uri, e)

        def retrieve_write_results(self) -> Any:
            # Returned, not raised: finalize gathers it and the coordinator
            # turns it into a CheckpointException naming this rank.
            return _wrap_exception(self.error) if self.error is not None else self.results

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            t0 = time.perf_counter()
            meta = StorageMeta(self.storage.uri, self.save_id)
            commit_checkpoint(self.storage, metadata, results, meta, self.save_id, self.old_data)
            self.stats.commit_s = time.perf_counter() - t0

        @property
        def checkpoint_id(self) -> str:
            return self.storage.url.uri

    return NvrxWriter


def nvrx_save(
    state_dict: dict[str, Any],
    storage: Storage,
    *,
    workers: int,
    process_group: dist.ProcessGroup | None,
    planner: SavePlanner | None,
    cache: Any | None,
    target: adapter.NvrxTarget | None = None,
) -> SaveStats:
    """One NVRx save of an already staged ``state_dict`` (see the module doc).

    ``process_group`` is the dedicated background group (``None``: a single
    process without torch.distributed). ``cache`` is the private NVRx
    metadata cache to use, or ``None``. ``target`` overrides where NVRx
    writes (default: derived from ``storage``). Raises on every rank if any
    rank failed.
    """
    target = target or adapter.check_target(storage)
    writer = writer_class()(storage, target, workers)
    if process_group is None:
        writer.save_id = os.urandom(8).hex()
        storage.makedirs()
        writer.old_data = claim(storage, writer.save_id)
        local_metadata = _plan_single_process(state_dict, writer, planner)
        writer.stats.plan_s = time.perf_counter() - writer.stats._t0
        writer.write_all()
        if writer.error is not None:
            writer.discard()
            raise writer.error
        writer.finish(local_metadata, [writer.results])
        single: SaveStats = writer.stats
        return single

    wrapper = _DistWrapper(process_group, True, 0)
    writer.save_id, writer.old_data = _claim_and_share(storage, wrapper)
    metadata: Metadata | None = None
    try:
        writer, metadata, wrapper = adapter.plan(state_dict, writer, process_group, planner, cache)
    except CheckpointException:
        raise  # raised by NVRx's plan exchange: every rank raises it together
    except BaseException as e:  # local to this rank: report it through the gather
        writer.error = e
    writer.stats.plan_s = time.perf_counter() - writer.stats._t0
    writer.write_all()
    failure: BaseException | None = None
    try:
        adapter.finalize(writer, metadata, wrapper)
    except BaseException as e:
        failure = e
    summary = wrapper.broadcast_object(None if failure is None else _summary(failure))
    if failure is not None or writer.error is not None or summary is not None:
        writer.discard()
    if failure is not None:
        raise failure
    if writer.error is not None:
        raise writer.error
    if summary is not None:
        raise SaveError(f"save to {storage.uri} failed on another rank: {summary}")
    stats: SaveStats = writer.stats
    return stats


def _claim_and_share(storage: Storage, wrapper: _DistWrapper) -> tuple[str, frozenset[str] | None]:
    """The coordinator claims the URI; every rank gets the save id (or the
    coordinator's failure) by broadcast, so no rank writes before the old
    commit is retracted. Also returns what the claim found (coordinator;
    None elsewhere)."""
    outcome: tuple[bool, str] = (True, "")
    error: Exception | None = None
    old_data: frozenset[str] | None = None
    if wrapper.is_coordinator:
        try:
            save_id = os.urandom(8).hex()
            storage.makedirs()
            old_data = claim(storage, save_id)
            outcome = (True, save_id)
        except Exception as e:
            outcome, error = (False, _summary(e)), e
    ok, value = wrapper.broadcast_object(outcome)
    if not ok:
        raise SaveError(f"save to {storage.uri} failed: could not start it on rank 0: {value}") from error
    return value, old_data


def _plan_single_process(state_dict: dict[str, Any], writer: Any, planner: SavePlanner | None) -> Metadata:
    """NVRx's planning needs torch.distributed; this is the same sequence for
    one process without it (no collectives, so nothing to cache)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = planner or DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    central = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    writer.prepare_write_data(central, planner)
    return metadata


def _summary(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if failures:
        parts = []
        for rank, exc in sorted(failures.items()):
            cause = exc[0] if isinstance(exc, tuple) else exc
            parts.append(f"rank {rank}: {type(cause).__name__}: {redact(str(cause))}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {redact(str(e))}"
