"""The NVRx engine: NVRx's planner and file writer under dcpstore's commit protocol.

Runs on the background thread of an :class:`~dcpstore._impl.engines.saver.AsyncSaver`
with a state dict that is already staged (host memory, owned by the save).
The writer is dcpstore's own (:class:`~dcpstore._impl.dcp.writer.DcpStorageWriter`,
:class:`NvrxWriter`) with NVRx's bucket split and per-file writer in its
two hooks; NVRx's ``save_state_dict_async_plan`` and the steps of its
``..._finalize`` drive it, as they drive NVRx's ``FileSystemWriterAsync``.

Call order of one save, per rank::

    claim       coordinator: SaveSession.claim(); then broadcast the save id
                (the sync point: no rank writes before the claim)
    plan        NVRx save_state_dict_async_plan (reduce_scatter of plans, or
                NVRx's metadata cache when every rank's structure is unchanged)
                -> prepare_write_data: NVRx's size-balanced buckets, one file each
    write       check the URI is still ours; one thread per bucket: NVRx's
                per-bucket writer (torch.save per item, fsync; each tensor's
                raw bytes located on the way, so loads read them in place),
                read the file back once to compute its CRC32Cs for the
                manifest (NVRx has no checksum hook), check again
    finalize    save_state_dict_async_finalize's steps (nvrx_release.finalize):
                gather write results on the coordinator; if every rank
                succeeded, finish():
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
signature checks), never by version numbers; tested with 0.4.1, 0.6.0 and
0.7.0. dcpstore takes NVRx's planning with its ``CheckpointMetadataCache`` (a
*private* instance per structure; NVRx's module-global cache is never
touched) as it is, and its finalize's gather and finish without the
failure broadcast on a CUDA device that 0.6 added (the outcome broadcast
below replaces it; :func:`.nvrx_release.finalize` says why); its bucket split and per-bucket writer too, but run in dcpstore's
own threads: NVRx 0.4.1 forks one process per bucket and gathers results
through a spawn-context ``Manager`` (which re-imports ``__main__``), its
``preload_tensors`` calls ``torch.cuda.synchronize()`` and its
``AsyncCallsQueue`` all-reduces on a CUDA device -- none of which works on
CPU-only torch, and staging is dcpstore's job anyway. NVRx wraps the
per-bucket writer in ``_disable_gc`` (a process-wide ``gc.disable()`` meant
for forked children); run in a thread it would switch the training thread's
GC too, so the undecorated function is called.

NVRx itself is optional: imported only when an NVRx save runs.
"""

from __future__ import annotations

import io
import os
import posixpath
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcpstore._impl.dcp.commit.session import ItemRecord, SaveSession
from dcpstore._impl.dcp.data_files import write_stats
from dcpstore._impl.dcp.failures import describe_failure
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate
from dcpstore._impl.dcp.writer import DcpStorageWriter, claim_and_share
from dcpstore._impl.engines import nvrx_release as release
from dcpstore._impl.engines.engine import SaveJob
from dcpstore._impl.engines.nvrx_release import import_error as import_error  # the engine choice asks here
from dcpstore._impl.storage import Storage
from dcpstore._impl.storage.error_mapping import map_os_error
from dcpstore._impl.util.checksum import file_and_span_crcs
from dcpstore._impl.util.errors import CheckpointCorrupt, InvalidArgument, SaveError
from dcpstore._impl.util.torch_compat import DistWrapper, StorageWriterTransforms, wrap_exception
from dcpstore._impl.values.results import SaveStats

INSTALL_HINT = "pip install 'dcpstore[nvrx]' (nvidia-resiliency-ext)"

# ---------------------------------------------------------------------------
# Where NVRx can write
# ---------------------------------------------------------------------------


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
# The writer: dcpstore's, with NVRx's bucket split and per-file writer
# ---------------------------------------------------------------------------


class NvrxWriter(DcpStorageWriter):
    """dcpstore's DCP writer driven by NVRx's planner and finalize, with
    NVRx's two pieces in its hooks: the bucket split
    (:meth:`bucket_items`) and the per-file writer (:meth:`write_file`:
    ``torch.save`` per item under the final name, fsync, then a read-back
    for the manifest's CRC32Cs). File names, spread prefixes, the claim
    (before planning, shared by broadcast), the ownership gate and the
    publish are the writer's own."""

    claims_before_planning = True
    writes_in_place = True
    #: As NVRx's own writer: its planner may prepare the global plan on each rank.
    can_run_decentralized_global_plan = True

    def __init__(
        self,
        session: SaveSession,
        target: NvrxTarget,
        workers: int,
        process_group: Any = None,
        *,
        spread_prefixes: int | str = "auto",
        commit_files: Mapping[str, bytes] | None = None,
    ) -> None:
        super().__init__(session.storage, workers=workers, spread_prefixes=spread_prefixes, commit_files=commit_files)
        self._begin(session.storage).session = session  # claimed and shared before planning
        self.target = target
        self.process_group = process_group
        self.error: BaseException | None = None
        self.results: list[WriteResult] = []
        self.named: list[tuple[str, list[WriteItem]]] = []
        self._planner: SavePlanner | None = None
        self._write = release.bucket_writer(StorageWriterTransforms([]), target.use_msc)

    # -- NVRx's planner calls these ---------------------------------------------
    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        # A failure here is local to this rank: keep it and report it
        # through finalize, so that no rank is left waiting in the gather.
        try:
            self.named, self._planner = self.named_buckets(plan), planner
        except BaseException as e:
            self.error = e

    def retrieve_write_results(self) -> Any:
        # Returned, not raised: finalize gathers it and the coordinator
        # turns it into a CheckpointException naming this rank.
        return wrap_exception(self.error) if self.error is not None else self.results

    # -- the hooks ---------------------------------------------------------------
    def bucket_items(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        return [bucket for bucket in release.split_items(self.workers, list(items)) if bucket]

    def write_file(
        self,
        storage: Storage,
        name: str,
        items: list[WriteItem],
        data_of: Callable[[WriteItem], io.BytesIO | torch.Tensor],
        gate: OwnerGate,
        batch: int,
    ) -> list[WriteResult]:
        del batch  # NVRx writes local files and MSC objects through open(): no connection budget to share
        if "/" in name:  # a spread directory: NVRx's open() does not create it
            storage.makedirs(posixpath.dirname(name))
        blobs = [(it, data_of(it)) for it in items if it.type == WriteItemType.BYTE_IO]
        tensors = [(it, data_of(it)) for it in items if it.type != WriteItemType.BYTE_IO]
        try:
            written, raw = self._write((os.path.join(self.target.path, name), name, (blobs, tensors)))
        except OSError as e:  # NVRx writes with open(): name the file and the cause
            raise map_os_error(e, f"cannot write {storage.describe(name)}") from e
        results = _checksum_written_file(storage, name, written, raw)
        gate.wait()
        return results

    # -- the engine's -----------------------------------------------------------
    def write_all(self) -> None:
        """Write every data file (:meth:`write_files`); keep the results or the error."""
        if self.error is not None or not self.named or self._planner is None:
            return
        t0 = time.perf_counter()
        try:
            self.results = self.write_files(self.named, self._planner)
        except BaseException as e:
            self.error = e
            return
        write_stats(self.stats, self.results, t0)

    def discard(self) -> None:
        """The save failed: remove this rank's data files (NVRx wrote them
        in place; see :meth:`SaveSession.discard`)."""
        self.session.discard(name for name, _ in self.named)


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
    spread_prefixes: int | str = "auto",
    commit_files: Mapping[str, bytes] | None = None,
) -> SaveStats:
    """One NVRx save of an already staged ``state_dict`` (see the module doc).

    ``process_group`` is the dedicated background group (``None``: a single
    process without torch.distributed). ``cache`` is the private NVRx
    metadata cache to use, or ``None``. ``target`` overrides where NVRx
    writes (default: derived from ``storage``). ``overwrite=False``: refuse
    a URI that holds a committed checkpoint; ``save_id``: the id the claim
    records (None: a fresh one); ``spread_prefixes`` as
    :class:`~dcpstore.SaveOptions` says; ``commit_files`` go into the
    coordinator's commit. Raises on every rank if any
    rank failed; the coordinator's session is then released (``with
    session``), so that ``gc`` may collect what the save left.
    """
    target = target or check_target(storage)
    if process_group is None:
        session = SaveSession(storage, save_id)
        session.claim(overwrite)
        with session:
            writer = NvrxWriter(session, target, workers, spread_prefixes=spread_prefixes, commit_files=commit_files)
            local_metadata = _plan_single_process(state_dict, writer, planner)
            writer.stats.plan_s = time.perf_counter() - writer.stats.started
            writer.write_all()
            if writer.error is not None:
                writer.discard()
                raise writer.error
            writer.finish(local_metadata, [writer.results])
            single: SaveStats = writer.stats
            return single

    wrapper = DistWrapper(process_group, True, 0)
    with claim_and_share(storage, wrapper, overwrite, save_id) as session:
        writer = NvrxWriter(
            session, target, workers, process_group, spread_prefixes=spread_prefixes, commit_files=commit_files
        )
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


class NvrxEngine:
    """:class:`~dcpstore._impl.engines.engine.Engine` ``"nvrx"``: :func:`nvrx_save`
    on the saver's background thread, with one :class:`PlanCaches` per saver."""

    name: ClassVar[str] = "nvrx"
    shared_staging: ClassVar[bool] = False

    def __init__(self, collective_timeout: timedelta | None) -> None:
        del collective_timeout  # its collectives run on the saver's background group
        self.caches = PlanCaches()

    @classmethod
    def unavailable(cls) -> str | None:
        reason = import_error()
        return None if reason is None else f"{reason}; {INSTALL_HINT}"

    @classmethod
    def target_problem(cls, backend: str, uri: str) -> str | None:
        return backend_problem(backend)

    def save(self, job: SaveJob) -> SaveStats:
        planner = job.options.planner
        # A user planner may plan differently per call: never cache its plans.
        cache = self.caches.for_save(job.staged.key, job.group) if planner is None else None
        try:
            stats = nvrx_save(
                job.staged.state_dict,
                job.storage,
                workers=job.workers,
                process_group=job.group,
                planner=planner,
                cache=cache,
                overwrite=job.options.overwrite,
                save_id=job.options.save_id,
                spread_prefixes=job.options.spread_prefixes,
                commit_files=job.commit_files,
            )
        except BaseException:
            self.caches.drop(job.group)  # every rank fails together: re-plan next time
            raise
        job.progress.update(stats.bytes_written)  # NVRx's writer reports its bytes only at the end
        return stats

    def close(self) -> None:
        self.caches.clear()
