"""The NVRx engine: NVRx's ``FileSystemWriterAsync`` under dcpstore's commit protocol.

Runs on the background thread of an :class:`~dcpstore.engines.saver.AsyncSaver`
with a state dict that is already staged (host memory, owned by the save).

Call order of one save, per rank::

    claim       coordinator: SaveSession.claim(); then broadcast the save id
                (the sync point: no rank writes before the claim)
    plan        NVRx save_state_dict_async_plan (reduce_scatter of plans, or
                NVRx's metadata cache when every rank's structure is unchanged)
                -> prepare_write_data: size-balanced buckets, one file each
    write       one thread per bucket: check the URI is still ours, NVRx's
                per-bucket writer (torch.save per item, fsync; each tensor's
                raw bytes located on the way, so loads read them in place),
                read the file back once to compute its CRC32Cs for the
                manifest (NVRx has no checksum hook), check again
    finalize    NVRx save_state_dict_async_finalize: gather write results on the
                coordinator; if every rank succeeded, finish():
                SaveSession.publish (manifest, .metadata last, clean up)
    outcome     the coordinator broadcasts success or the failure, so every
                rank's handle raises when any rank failed

Durability on POSIX: NVRx fsyncs each data file in place (no rename); the
manifest's atomic put then fsyncs the checkpoint directory, which makes the
data files' directory entries durable before ``.metadata`` is renamed into
place. Two saves to one URI: the later wins and the earlier fails before
committing, as with the native writer; NVRx writes files in place, so the
ownership check runs before and after each file. A failed save: every rank
removes the files it wrote (in place, they would hold the space the next
save needs), and a write error inside torch.save -- a full disk -- is raised
as a StorageError naming the file and errno, not torch's "unexpected pos"
(:mod:`.nvrx_stream`). Integrity: the native
writer's manifest, computed from a read-back of what NVRx wrote (on an MSC
object store, one extra GET of each data file).

NVRx releases. Everything that depends on which NVRx release is installed is
in :mod:`.nvrx_release`, decided by feature detection (``hasattr`` /
signature checks), never by version numbers. dcpstore takes NVRx's
planning with its ``CheckpointMetadataCache`` (a *private* instance per
structure; NVRx's module-global cache is never touched) and its finalize as
they are; its bucket split and per-bucket writer too, but run in dcpstore's
own threads: NVRx 0.4.1 forks one process per bucket and gathers results
through a spawn-context ``Manager`` (which re-imports ``__main__``), its
``preload_tensors`` calls ``torch.cuda.synchronize()`` and its
``AsyncCallsQueue`` all-reduces on a CUDA device -- none of which works on
CPU-only torch, and staging is dcpstore's job anyway. NVRx wraps the
per-bucket writer in ``_disable_gc`` (a process-wide ``gc.disable()`` meant
for forked children); run in a thread it would switch the training thread's
GC too, so the undecorated function is called.

Layer: engines. Imports :mod:`dcpstore.dcp`, :mod:`dcpstore.format`, the
value objects, :mod:`dcpstore.storage` and the foundation. NVRx itself is
optional: imported only when an NVRx save runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import posixpath
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper

from ..dcp.commit import ItemRecord, SaveSession
from ..dcp.failures import describe_failure
from ..dcp.owner_gate import OwnerGate, run_gated
from ..dcp.writer import rank_prefix, write_stats
from ..errors import BackendUnavailable, CheckpointCorrupt, CheckpointExists, InvalidArgument, SaveError
from ..format.checksum import file_and_span_crcs
from ..format.record import compact_cpu_tensor
from ..handle import SaveStats
from ..storage import Storage
from ..storage.kit import map_os_error
from . import nvrx_release as release
from .nvrx_release import import_error as import_error  # the engine choice asks here

INSTALL_HINT = "pip install 'dcpstore[nvrx]' (nvidia-resiliency-ext)"

# ---------------------------------------------------------------------------
# Where NVRx can write, and whether it is installed
# ---------------------------------------------------------------------------


def require() -> None:
    """Raise :class:`BackendUnavailable` with the install hint if NVRx is unusable."""
    reason = import_error()
    if reason is not None:
        raise BackendUnavailable(f"engine='nvrx' needs nvidia-resiliency-ext: {reason}; {INSTALL_HINT}")


@dataclass(frozen=True)
class NvrxTarget:
    """Where NVRx writes: a POSIX directory, or an MSC URL with ``use_msc``."""

    path: str
    use_msc: bool


def backend_problem(backend: str) -> str | None:
    """Why NVRx cannot write through dcpstore's ``backend`` (``None``: it can).

    NVRx writes with ``open()`` (POSIX) or ``msc.open()``: dcpstore's local
    backend and its MSC backend qualify; the native S3 and fsspec backends
    do not. No URI in the reason: the auto-fallback warning built from it
    stays one message per backend, which Python's warning filter shows once.
    """
    if backend in ("local", "msc"):
        return None
    return (
        f"NVRx writes only POSIX paths and MSC URLs, not the {backend} backend; "
        "pass enable_msc=True to go through MSC, or engine='native'"
    )


def target_for(storage: Storage) -> NvrxTarget | str:
    """The NVRx location for ``storage``, or the reason NVRx cannot write there."""
    problem = backend_problem(storage.backend)
    if problem is not None:
        return problem
    if storage.backend == "local":
        return NvrxTarget(storage.url.path, use_msc=False)
    # MSC resolves msc://profile/..., s3://bucket/... (implicit profile) and
    # POSIX paths itself.
    return NvrxTarget(storage.url.uri, use_msc=True)


def check_target(storage: Storage) -> NvrxTarget:
    target = target_for(storage)
    if isinstance(target, str):
        raise InvalidArgument(f"engine='nvrx' cannot save to {storage.uri}: {target}")
    return target


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def writer_class() -> type:
    """``FileSystemWriterAsync`` under dcpstore's commit protocol (built
    lazily: NVRx is optional)."""
    base = release.module(release.FS_MODULE, "FileSystemWriterAsync").FileSystemWriterAsync

    class NvrxWriter(base):  # type: ignore[misc,valid-type]
        """NVRx's writer; planning, bucketing and file writing are NVRx's,
        the claim, the checksums and the commit are the session's."""

        def __init__(self, session: SaveSession, target: NvrxTarget, workers: int) -> None:
            super().__init__(target.path, thread_count=workers, use_msc=target.use_msc)
            self.session = session
            self.storage = session.storage
            self.stats = SaveStats(started=time.perf_counter())
            self.error: BaseException | None = None
            self.results: list[WriteResult] = []
            self.write_buckets: list[Any] = []

        def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
            self.storage.makedirs()  # the claim happened before planning
            return plan

        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            # torch's ``__{i}_`` prefixes, in each rank's spread directory
            # (NVRx's metadata cache replays this plan while it is valid).
            spread = self.storage.options.spread_prefixes
            return [
                dataclasses.replace(plan, storage_data=_StoragePrefix(rank_prefix(i, spread)))
                for i, plan in enumerate(plans)
            ]

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
            for items in release.split_items(self.thread_count, list(plan.items)):
                if not items:
                    continue
                name = self.session.data_file(prefix.prefix, len(buckets))
                if "/" in name:  # a spread directory: NVRx's open() does not create it
                    self.storage.makedirs(posixpath.dirname(name))
                blobs = [(it, planner.resolve_data(it)) for it in items if it.type == WriteItemType.BYTE_IO]
                tensors = [
                    (it, compact_cpu_tensor(cast(torch.Tensor, planner.resolve_data(it))))
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
            write = release.bucket_writer(self)

            def one(bucket: Any, gate: OwnerGate) -> list[WriteResult]:
                try:
                    written, raw = write(bucket)
                except OSError as e:  # NVRx writes with open(): name the file and the cause
                    raise map_os_error(e, f"cannot write {self.storage.describe(bucket[1])}") from e
                results = _checksum_written_file(self.storage, bucket[1], written, raw)
                gate.wait()
                return results

            try:
                # NVRx writes under the final names: the URI must be this
                # save's before any file is written, and once they all are.
                self.session.check_owner()
                per_file = run_gated(self.session.check_owner, one, self.write_buckets, "dcpstore-nvrx")
            except BaseException as e:
                self.error = e
                return
            self.results = [r for rs in per_file for r in rs]
            write_stats(self.stats, self.results, t0)

        def discard(self) -> None:
            """The save failed: remove this rank's data files (NVRx wrote
            them in place; see :meth:`SaveSession.discard`)."""
            self.session.discard(bucket[1] for bucket in self.write_buckets)

        def retrieve_write_results(self) -> Any:
            # Returned, not raised: finalize gathers it and the coordinator
            # turns it into a CheckpointException naming this rank.
            return _wrap_exception(self.error) if self.error is not None else self.results

        def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
            t0 = time.perf_counter()
            self.session.publish(metadata, results)
            self.stats.commit_s = time.perf_counter() - t0

        @property
        def checkpoint_id(self) -> str:
            return self.storage.url.uri

    return NvrxWriter


def _checksum_written_file(
    storage: Storage, path: str, results: list[WriteResult], raw: Mapping[Any, tuple[int, int]]
) -> list[WriteResult]:
    """The write results of a data file NVRx wrote, with :class:`ItemRecord`
    storage data for the manifest: sizes and CRC32Cs from reading the file
    back once (``results`` carry each item's offset and length), and the
    tensor locations ``raw`` (item index -> (offset in the item, nbytes))
    seen while it was written."""
    size = storage.size(path)
    spans = [(wr.storage_data.offset, wr.storage_data.length) for wr in results]
    file_crc, crcs, read = file_and_span_crcs(lambda pos, n: storage.read_range(path, pos, n), size, spans)
    if read != size:
        raise CheckpointCorrupt(f"{storage.describe(path)}: read back {read} of {size} bytes right after writing it")
    return sorted(
        (
            WriteResult(
                index=wr.index,
                size_in_bytes=wr.size_in_bytes,
                storage_data=ItemRecord(path, offset, length, crc, size, file_crc, raw.get(wr.index)),
            )
            for wr, (offset, length), crc in zip(results, spans, crcs)
        ),
        key=lambda wr: wr.storage_data.offset,
    )


def nvrx_save(
    state_dict: dict[str, Any],
    storage: Storage,
    *,
    workers: int,
    process_group: dist.ProcessGroup | None,
    planner: SavePlanner | None,
    cache: Any | None,
    target: NvrxTarget | None = None,
    overwrite: bool = True,
    save_id: str | None = None,
) -> SaveStats:
    """One NVRx save of an already staged ``state_dict`` (see the module doc).

    ``process_group`` is the dedicated background group (``None``: a single
    process without torch.distributed). ``cache`` is the private NVRx
    metadata cache to use, or ``None``. ``target`` overrides where NVRx
    writes (default: derived from ``storage``). ``overwrite=False``: refuse
    a URI that holds a committed checkpoint; ``save_id``: the id the claim
    records (None: a fresh one). Raises on every rank if any
    rank failed; the coordinator's session is then released (``with
    session``), so that ``gc`` may collect what the save left.
    """
    target = target or check_target(storage)
    if process_group is None:
        session = SaveSession(storage, save_id)
        session.claim(overwrite)
        with session:
            writer = writer_class()(session, target, workers)
            local_metadata = _plan_single_process(state_dict, writer, planner)
            writer.stats.plan_s = time.perf_counter() - writer.stats.started
            writer.write_all()
            if writer.error is not None:
                writer.discard()
                raise writer.error
            writer.finish(local_metadata, [writer.results])
            single: SaveStats = writer.stats
            return single

    wrapper = _DistWrapper(process_group, True, 0)
    with claim_and_share(storage, wrapper, overwrite, save_id) as session:
        writer = writer_class()(session, target, workers)
        metadata: Metadata | None = None
        try:
            writer, metadata, wrapper = release.plan(state_dict, writer, process_group, planner, cache)
        except CheckpointException:
            raise  # raised by NVRx's plan exchange: every rank raises it together
        except BaseException as e:  # local to this rank: report it through the gather
            writer.error = e
        writer.stats.plan_s = time.perf_counter() - writer.stats.started
        writer.write_all()
        failure: BaseException | None = None
        try:
            release.finalize(writer, metadata, wrapper)
        except BaseException as e:
            failure = e
        summary = wrapper.broadcast_object(None if failure is None else describe_failure(failure))
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


def claim_and_share(storage: Storage, wrapper: _DistWrapper, overwrite: bool, save_id: str | None) -> SaveSession:
    """The coordinator claims the URI; every rank gets the session's token
    (or the coordinator's failure) by broadcast, so no rank writes before
    the claim. Returns this rank's session."""
    #: ("ok", token) or ("exists" / "failed", what went wrong)
    outcome: tuple[str, Any] = ("ok", None)
    error: Exception | None = None
    session: SaveSession | None = None
    if wrapper.is_coordinator:
        try:
            session = SaveSession(storage, save_id)
            session.claim(overwrite)
            outcome = ("ok", session.token)
        except Exception as e:
            outcome, error = ("exists" if isinstance(e, CheckpointExists) else "failed", describe_failure(e)), e
    try:
        kind, value = wrapper.broadcast_object(outcome)
    except BaseException:
        if session is not None:
            session.release()
        raise
    if kind == "exists":  # the same refusal on every rank
        raise CheckpointExists(f"save to {storage.uri} refused on rank 0: {value}") from error
    if kind != "ok":
        raise SaveError(f"save to {storage.uri} failed: could not start it on rank 0: {value}") from error
    return session if session is not None else SaveSession(storage, *value)


def _plan_single_process(state_dict: dict[str, Any], writer: Any, planner: SavePlanner | None) -> Metadata:
    """NVRx's planning needs torch.distributed; this is the same sequence for
    one process without it (no collectives, so nothing to cache)."""
    planner = planner or DefaultSavePlanner()
    planner.set_up_planner(state_dict, is_coordinator=True)
    writer.set_up_storage_writer(True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])
    central = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    writer.prepare_write_data(central, planner)
    return metadata


class PlanCaches(dict[int, tuple[Hashable, Any]]):
    """NVRx metadata caches by background group (``id(group)`` -> (structure
    key of the group's last save, its cache)), kept in lockstep across ranks.

    NVRx decides *locally* whether to skip the plan exchange (its cache is
    "validated" once two consecutive plans are equal); if ranks disagreed,
    some would skip a collective the others enter, and hang. So a cache is
    reused only when every rank saves the same structure as in its previous
    NVRx save on this group *and* every rank's cache is in the same state;
    otherwise every rank starts a fresh one. One 3-int all-reduce on the
    background group decides. Single-process saves plan locally and need no
    cache.
    """

    def for_save(self, key: Hashable, group: dist.ProcessGroup | None) -> Any | None:
        """The cache for a save of structure ``key`` on ``group`` (collective
        on ``group``: every rank calls it), or None."""
        if group is None:
            return None
        fresh = release.new_metadata_cache()
        if fresh is None:
            return None
        last = self.get(id(group))
        same = last is not None and last[0] == key
        validated = int(bool(getattr(last[1], "validated_cache_reuse", False))) if same and last else 0
        votes = torch.tensor([int(same), validated, -validated], dtype=torch.int32)
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
        all_same, min_validated, max_validated = int(votes[0]), int(votes[1]), -int(votes[2])
        if not all_same or min_validated != max_validated or last is None:
            last = (key, fresh)
            self[id(group)] = last
        return last[1]

    def drop(self, group: dist.ProcessGroup | None) -> None:
        """Forget ``group``'s cache (a failed save: every rank re-plans)."""
        self.pop(id(group), None)
