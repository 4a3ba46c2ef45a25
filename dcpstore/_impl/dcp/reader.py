"""DCP ``StorageReader`` written once over :class:`~dcpstore.storage.Storage`.

Load, as ``torch.distributed.checkpoint.load`` drives it::

    (all ranks)   read_metadata        ``.metadata``, verified against the
                                       manifest (read_checkpoint_metadata)
    (all ranks)   set_up_storage_reader -> prepare_local_plan
                                       (raises what check_destination found
                                       wrong with the caller's state dict)
    (coordinator) prepare_global_plan
    (all ranks)   read_data            the plan's items: sizes checked against
                                       the manifest and the files' real
                                       sizes, read jobs planned
                                       (:mod:`.read_plan`) and run on
                                       ``workers`` threads; every item's
                                       CRC32C verified before it is copied
                                       into the caller's state, except
                                       tensors of 64 KiB or more, read
                                       straight into their destination and
                                       verified there (their location proven
                                       from their record); every record
                                       checked before torch.load sees it and
                                       every non-tensor item unpickled
                                       through the allowlist before DCP's
                                       planner sees it: the checks of
                                       :mod:`.item_checks`, which verify runs
                                       too

Never executes checkpoint content: ``.metadata`` and non-tensor items are
unpickled through allowlists (:mod:`dcpstore._impl.format.safe_pickle`);
``safe_globals`` / ``trusted`` (from :class:`~dcpstore._impl.values.options.LoadOptions`)
allow more. Nothing is allocated for bytes a file does not hold.

A failed load says which keys it changed (:mod:`.load_progress`).
:func:`~.load.load_state_dict` runs a whole load with this reader.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcpstore._impl.dcp.commit.reading import commit_replaced, read_checkpoint_metadata
from dcpstore._impl.dcp.item_checks import SMALL_TENSOR_COPY, ItemChecks
from dcpstore._impl.dcp.load_progress import NO_CHANGES, Changes, LoadProgress
from dcpstore._impl.dcp.read_plan import (
    COALESCE_LIMIT,
    Direct,
    DirectRun,
    Request,
    Span,
    plan_reads,
    scatter_groups,
)
from dcpstore._impl.dcp.shared_reads import Piece, SharedReads, exchange, neighbours, piece_of, plan_shared_reads
from dcpstore._impl.dcp.state_checks import load_mismatches
from dcpstore._impl.dcp.writer import rebind, serves
from dcpstore._impl.format.bitcopy import copy_values
from dcpstore._impl.format.layout import MANIFEST, METADATA, is_safetensors_file, item_key
from dcpstore._impl.format.manifest import Manifest
from dcpstore._impl.format.record_zip import RecordBytes
from dcpstore._impl.format.safe_pickle import Trust
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    LoadError,
    StateDictMismatch,
    StorageNotFound,
)
from dcpstore._impl.util.progress import NO_PROGRESS, Progress
from dcpstore._impl.util.threads import run_parallel
from dcpstore._impl.util.torch_compat import ExtensionRegistry, StorageInfo, StorageReaderTransforms
from dcpstore._impl.values.options import check_workers

log = logging.getLogger(__name__)

#: Failures that may be a replaced checkpoint's files going (a load that
#: read the old ``.metadata`` finds the files it names deleted by the new
#: save's clean-up) rather than damage.
RETRIED = (CheckpointCorrupt, StorageNotFound)
#: The attribute that marks such a failure once the load has seen its
#: ``.metadata`` replaced (set on the failing rank, read on every rank).
REPLACED = "checkpoint_replaced"


class DcpStorageReader(StorageReader):
    """A DCP ``StorageReader`` over any :class:`Storage`; verifies as it reads.
    ``progress`` counts this rank's bytes as items are read.

    Never executes checkpoint content: ``.metadata`` and non-tensor items are
    unpickled through allowlists (:mod:`dcpstore._impl.format.safe_pickle`);
    ``safe_globals=[cls, ...]`` allows more classes, ``trusted=True`` all.
    """

    def __init__(
        self,
        storage: Storage,
        *,
        workers: int | None = None,
        reopen: Callable[[str], Storage] | None = None,
        verify: bool = True,
        extension_registry: ExtensionRegistry | None = None,
        safe_globals: Sequence[Any] | None = None,
        trusted: bool = False,
        progress: Progress = NO_PROGRESS,
        earlier: Changes = NO_CHANGES,
    ) -> None:
        super().__init__()
        #: Undoes the DCP stream transforms an item names (default registry: ZStandard).
        self.transforms = StorageReaderTransforms(extension_registry)
        self.storage = storage
        self.workers = check_workers(workers, storage.default_workers())
        self.verify = verify
        self.bar = progress
        self._trust = Trust.of(safe_globals, trusted)
        self._reopen = reopen
        self._manifest: Manifest | None = None
        self._metadata: Metadata | None = None
        self._preloaded = False
        self._checks: ItemChecks | None = None
        self._storage_data: dict[MetadataIndex, StorageInfo] = {}
        self._mismatches: list[str] = []
        #: What earlier tries of this load changed (see load.load_state_dict).
        self._earlier = earlier
        self._progress = LoadProgress((), earlier)
        #: CRC32C of the ``.metadata`` bytes this load read (None: none yet).
        self._commit_crc: int | None = None
        #: Data files' sizes from the coordinator's listing (see share_commit).
        self._known_sizes: dict[str, int] = {}
        #: The bytes this load's direct reads move in all (see Storage.read_into).
        self._batch: int | None = None
        #: Bytes this rank fetched from storage in this load (not those other ranks
        #: handed it); added to under the planner's lock of read_data.
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Point the next load at ``checkpoint_id`` (DCP calls this only when
        ``dcp.load`` is given a ``checkpoint_id``). The commit is read afresh
        on every load: the checkpoint at a URI may have been replaced since."""
        self._preloaded = False
        self.storage = rebind(self.storage, checkpoint_id, self._reopen, "reader")

    def preload_metadata(self) -> Metadata:
        """Read and verify the commit now (every rank), so that a missing or
        damaged checkpoint fails fast with a clear error, outside DCP. The
        next load uses it; any later load reads the commit again (the
        checkpoint at a URI may be replaced between two loads)."""
        if not self._preloaded:
            # The files' sizes from one listing, in flight beside the commit
            # read: _check_sizes then costs no round trip (where it can).
            commit: list[tuple[Metadata, Manifest | None]] = []

            def read_commit() -> None:
                commit.append(read_checkpoint_metadata(self.storage, self._trust, on_read=self._note_commit))

            jobs = [read_commit, self.storage.learn_sizes]
            run_parallel(lambda job: job(), jobs, 2, "dcpstore-commit-read")
            self._metadata, self._manifest = commit[0]
            self._preloaded = True
        assert self._metadata is not None
        return self._metadata

    def _note_commit(self, blob: bytes) -> None:
        self._commit_crc = crc32c(blob)

    # -- one commit read per job ---------------------------------------------
    def commit_for_sharing(self) -> SharedCommit:
        """The coordinator's half of :meth:`share_commit`: read the commit
        (and list the checkpoint's files) as :meth:`preload_metadata` does,
        and what the other ranks need of it."""
        metadata = self.preload_metadata()
        paths = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
        sizes = {path: n for path in sorted(paths) if (n := self.storage.size_seen(path)) is not None}
        return SharedCommit(metadata, self._manifest, self._commit_crc, sizes)

    def take_commit(self, shared: SharedCommit) -> None:
        """Another rank's half of :meth:`share_commit`: use the coordinator's
        commit read as this load's own (the next load reads it again)."""
        self._metadata, self._manifest, self._commit_crc = shared.metadata, shared.manifest, shared.commit_crc
        self._known_sizes = dict(shared.sizes)
        self._preloaded = True

    def share_commit(self, process_group: dist.ProcessGroup | None) -> None:
        """Collective over ``process_group`` (None: the default group): its
        first rank reads the commit, every other rank takes it over the
        group, so that a job's load reads ``.metadata``, the manifest and
        the listing once, not once per rank (at 16,384 ranks, 66 times S3's
        GET rate on the checkpoint's prefix). A failed read raises the same
        error on every rank."""
        coordinator = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        payload: list[Any] = [None]
        failure: BaseException | None = None
        if dist.get_rank() == coordinator:
            try:
                payload[0] = self.commit_for_sharing()
            except BaseException as e:  # told to every rank before it is raised here
                failure = e
                if isinstance(e, RETRIED) and self.replaced():
                    vars(e)[REPLACED] = True  # so that every rank loads again, or none
                if isinstance(e, CheckpointError):
                    payload[0] = (type(e), str(e), dict(vars(e)))
        dist.broadcast_object_list(payload, src=coordinator, group=process_group)
        if failure is not None:
            raise failure
        if isinstance(payload[0], SharedCommit):
            if dist.get_rank() != coordinator:
                self.take_commit(payload[0])
            return
        if payload[0] is None:  # the coordinator failed otherwise: its own error says how
            raise LoadError(
                f"load from {self.storage.uri}: the coordinator (rank {coordinator}) could not read the commit"
            )
        kind, message, attributes = payload[0]
        error = kind(message)
        vars(error).update(attributes)
        raise error

    def replaced(self) -> bool:
        """Whether another save has committed over the checkpoint since this
        load read its ``.metadata`` (or removed it): a failure of the load
        may then be the replaced checkpoint's files going, not damage."""
        return self._commit_crc is not None and commit_replaced(self.storage, self._commit_crc)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP asks for rank-local metadata only after the global one
            # failed: the checkpoint of a save with use_collectives=False.
            raise CheckpointNotFound(
                f"no {METADATA} at {self.storage.uri}: dcpstore reads checkpoints with one global {METADATA} "
                "and does not read rank-local __{rank}.metadata (saves with use_collectives=False)"
            )
        metadata = self.preload_metadata()
        self._preloaded = False  # this load has it; the next one reads it again
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CheckpointCorrupt(f"{self.storage.describe(METADATA)}: no storage_data")
        first = next(iter(metadata.storage_data.values()), None)
        if is_safetensors_file(getattr(first, "relative_path", "")):  # a save's items are all of one kind
            raise LoadError(
                f"{self.storage.uri} holds safetensors shards, not DCP's records: load it with "
                "dcp.load(state, storage_reader=dcpstore.SafetensorsReader(uri))"
            )
        self._storage_data = metadata.storage_data
        self._checks = ItemChecks(metadata, self.storage, self.transforms, self._trust)
        self.bytes_read = 0

    def check_destination(self, state_dict: dict[str, Any]) -> None:
        """Compare the caller's ``state_dict`` with the checkpoint before
        ``dcp.load`` (see :func:`~dcpstore._impl.dcp.state_checks.load_mismatches`).
        What it finds is raised from :meth:`prepare_local_plan`, inside DCP's
        planning step, which gathers every rank's failure: all ranks then
        raise together and none is left waiting in a collective."""
        self._mismatches = load_mismatches(state_dict, self.preload_metadata())

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        if self._mismatches:
            raise StateDictMismatch(
                f"cannot load {self.storage.uri} into this state_dict; nothing was loaded: "
                + "; ".join(self._mismatches)
            )
        # This rank's host, for the coordinator's plan of shared reads (no collective of its own).
        return dataclasses.replace(plan, storage_data=socket.gethostname())

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Items several ranks need are read by one of them and handed to the
        others (:mod:`.shared_reads`), where the load runs over the whole
        default group (the plans' order is then the global ranks')."""
        if len(plans) < 2 or not is_distributed() or len(plans) != dist.get_world_size():
            return plans
        hosts = [p.storage_data for p in plans]
        known = all(isinstance(h, str) for h in hosts)  # a planner of the caller's may drop them: one host
        return plan_shared_reads(plans, self._storage_data, hosts if known else None)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        share = plan.storage_data if isinstance(plan.storage_data, SharedReads) else None
        shared_pieces = share.pieces() if share is not None else set()
        per_file: dict[str, list[Request]] = defaultdict(list)  # what this rank reads for itself alone
        shared: dict[Piece, list[Request]] = defaultdict(list)  # what comes through the exchange
        for req in plan.items:
            info = self._storage_data[req.storage_index]
            piece = piece_of(info) if shared_pieces else None
            if piece in shared_pieces:
                shared[piece].append((req, info))
            else:
                per_file[info.relative_path].append((req, info))
        assert self._metadata is not None and self._checks is not None
        lock = threading.Lock()
        self._progress = LoadProgress((req.dest_index.fqn for req in plan.items), self._earlier)
        try:
            every_file = {path: list(reqs) for path, reqs in per_file.items()}
            for piece, reqs in shared.items():
                every_file.setdefault(piece.path, []).extend(reqs)
            if share is None:
                jobs = self._plan_own_reads(per_file, every_file)
                run_parallel(lambda job: self._read_job(job, planner, lock), jobs, self.workers, "dcpstore-read")
            else:
                try:
                    jobs, early = self._plan_own_reads(per_file, every_file), None
                except BaseException as e:
                    # Told to the other ranks in the exchange's first round:
                    # raised here, they would wait for this rank there.
                    jobs, early = [], e
                self._read_shared(share, shared, jobs, planner, lock, early)
        except BaseException as e:
            error = self._progress.annotate(e, self.storage.uri)  # what this rank's state now holds
            if isinstance(error, RETRIED) and self.replaced():
                vars(error)[REPLACED] = True  # the same decision on every rank: DCP hands them this error
            # Raised, not set on the future: torch's Future holds an error where Python's collector
            # cannot see it, and the traceback wait() adds leads back to the future, so every frame
            # (read buffers, the planner's state dict) of every failed load would stay in memory.
            # DCP gathers a raise from here exactly as one from wait().
            raise error from error.__cause__
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _plan_own_reads(
        self, per_file: dict[str, list[Request]], every_file: dict[str, list[Request]]
    ) -> list[Span | DirectRun]:
        """Check the sizes of every file this rank's items lie in, and plan
        the reads of those it reads for itself alone (``per_file``)."""
        assert self._metadata is not None and self._checks is not None
        self._check_sizes(every_file)
        tensors = self._manifest["tensors"] if self._manifest is not None else {}
        raw = {
            item_key(path, info.offset): loc
            for path, reqs in per_file.items()
            for req, info in reqs
            if (loc := self._checks.raw_location(path, info, req.storage_index, tensors)) is not None
        }
        jobs = plan_reads(per_file, raw, self._metadata, self.workers, self._manifest_where())
        self._batch = sum(job.length for job in jobs)  # object stores share their budget out over it
        self.bar.start(sum(info.length for reqs in every_file.values() for _, info in reqs))
        return jobs

    def _read_shared(
        self,
        share: SharedReads,
        shared: dict[Piece, list[Request]],
        jobs: list[Span | DirectRun],
        planner: LoadPlanner,
        lock: threading.Lock,
        early: BaseException | None,
    ) -> None:
        """This rank's own reads on worker threads, beside its part of the
        exchange of the items several ranks need (on this thread, in step
        with every other rank). ``early``: how this rank's load failed
        before (it still takes part, to tell the others)."""
        own: list[BaseException] = [] if early is None else [early]

        def read_own() -> None:
            try:
                run_parallel(lambda job: self._read_job(job, planner, lock), jobs, self.workers, "dcpstore-read")
            except BaseException as e:
                own.append(e)
                self._progress.fail(e)

        def read_pieces(pieces: Sequence[Piece]) -> dict[Piece, torch.Tensor]:
            groups = neighbours(pieces, COALESCE_LIMIT)
            batch = sum(p.length for p in pieces)  # read at about the same time: shares the connection budget
            blobs: dict[Piece, torch.Tensor] = {}
            read = functools.partial(self._read_pieces, batch=batch, lock=lock)
            for group, blob in zip(groups, run_parallel(read, groups, self.workers, "dcpstore-read-shared")):
                for piece in group:
                    start = piece.offset - group[0].offset
                    blobs[piece] = blob[start : start + piece.length]
            return blobs

        def use(piece: Piece, blob: memoryview) -> None:
            self._progress.check()
            self._use_span(Span(piece.path, piece.offset, piece.length, tuple(shared[piece])), blob, planner, lock)

        worker = threading.Thread(target=read_own, name="dcpstore-read-own", daemon=True)
        worker.start()
        try:
            exchange(share, self.storage.uri, read_pieces, use, lambda: early or self._progress.error)
        except BaseException as e:
            self._progress.fail(e)  # this rank's own reads start no new item
            raise
        finally:
            worker.join()
        if own:
            raise own[0]

    def _read_pieces(self, group: Sequence[Piece], batch: int, lock: threading.Lock) -> torch.Tensor:
        """Neighbouring stored items of one file, read whole with one ranged
        read for the ranks that need them, into a buffer the exchange sends
        as it is."""
        self._progress.check()
        first = group[0]
        length = sum(p.length for p in group)
        blob = torch.empty(length, dtype=torch.uint8)
        array: Any = blob.numpy()
        try:
            n = self.storage.read_into(first.path, first.offset, [memoryview(array).cast("B")], batch_hint=batch)
        except StorageNotFound as e:
            raise CheckpointCorrupt(f"{self.storage.describe(first.path)}: data file is missing") from e
        self._check_whole(first.path, first.offset, n, length)
        with lock:
            self.bytes_read += length
        return blob

    def _check_sizes(self, per_file: dict[str, list[Request]]) -> None:
        """Each file's real size against the manifest, and against the items
        to read from it: nothing is allocated for bytes a file does not hold
        (a plain file: a FIFO or device is refused here, before any read).

        One size request per file, all in flight together (on an object
        store, one after another they would delay the load by a round trip
        per file); a size this storage already saw (``Storage.size_seen``)
        costs none.
        """
        manifest = self._manifest if self.verify else None
        checks = self._checks
        assert checks is not None

        def check(path: str) -> None:
            reqs = per_file[path]
            entry = manifest["files"].get(path) if manifest is not None else None
            if manifest is not None and entry is None:
                raise CheckpointCorrupt(
                    f"{self.storage.describe(path)}: not listed in the integrity manifest {self._manifest_where()}"
                )
            actual = self._known_sizes.get(path)
            if actual is None:
                actual = self.storage.size_seen(path)
            if actual is None:
                try:
                    actual = self.storage.size(path)
                except StorageNotFound as e:
                    raise CheckpointCorrupt(f"{self.storage.describe(path)}: data file is missing") from e
            if entry is not None and actual != entry["size"]:
                raise CheckpointCorrupt(
                    f"{self.storage.describe(path)}: size {actual} bytes, expected {entry['size']} "
                    "(truncated or damaged)"
                )
            end = max(info.offset + info.length for _, info in reqs)
            if end > actual:
                raise CheckpointCorrupt(
                    f"{self.storage.describe(path)}: items run to byte {end}, but the file holds {actual} "
                    "(truncated, or a damaged .metadata)"
                )
            for req, info in reqs:
                checks.before_read(path, info, req.storage_index)

        run_parallel(check, sorted(per_file), len(per_file), "dcpstore-size")

    def _read_job(self, job: Span | DirectRun, planner: LoadPlanner, lock: threading.Lock) -> None:
        try:
            self._progress.check()
            if isinstance(job, DirectRun):
                self._read_run(job, planner, lock)
            else:
                self._read_span(job, planner, lock)
        except BaseException as e:
            self._progress.fail(e)  # the other jobs start no new item
            raise

    def _read_run(self, run: DirectRun, planner: LoadPlanner, lock: threading.Lock) -> None:
        """Read tensors' bytes straight into their destinations, verify each
        item's CRC32C, and commit them.

        A destination must be a contiguous CPU tensor of the stored dtype and
        size (a plain state dict's tensors are); any other goes through its
        record as :meth:`_read_span` does. Neighbouring tensors are read with
        one scatter read (:meth:`Storage.read_into`), the record bytes between
        them landing in scratch buffers.
        """
        with lock:
            targets = [planner.resolve_tensor(d.req).detach() for d in run.items]
        placed: list[tuple[Direct, torch.Tensor, memoryview]] = []
        for d, target in zip(run.items, targets):
            dest = _byte_view(target, d.dtype, d.nbytes)
            if dest is None:
                span = Span(d.path, d.info.offset, d.info.length, ((d.req, d.info),))
                self._read_span(span, planner, lock, target)
            else:
                placed.append((d, target, dest))
        for group in scatter_groups(placed):
            self._progress.check()
            verified, error = self._scatter_read(group)
            with lock:
                for (d, target, _), exposed in verified:
                    self.bytes_read += d.length
                    planner.commit_tensor(d.req, target)
                    self._progress.loaded([d.req.dest_index.fqn], exposed=exposed)
            self.bar.update(sum(d.length for (d, _, _), _ in verified))
            if error is not None:
                raise error

    def _scatter_read(
        self, group: list[tuple[Direct, torch.Tensor, memoryview]]
    ) -> tuple[list[tuple[tuple[Direct, torch.Tensor, memoryview], bool]], CheckpointCorrupt | None]:
        """One scatter read of every byte of the group's items: each record's
        header and trailer into scratch buffers, its tensor bytes into the
        destination; then each item's CRC32C over all three, as recorded.

        Returns the verified entries (with whether their bytes went straight
        into the destination), and the first checksum failure, if any. A
        failed or short read raises: the destinations read into directly
        then hold unverified bytes (recorded in ``self._progress``)."""
        path = group[0][0].path
        start = pos = group[0][0].info.offset
        buffers: list[memoryview] = []
        parts: list[tuple[Direct, list[memoryview], memoryview]] = []
        #: Each buffer's item (its index in ``parts``; -1: another item's bytes).
        owner: list[int] = []
        for d, _, dest in group:
            if d.info.offset > pos:
                buffers.append(memoryview(bytearray(d.info.offset - pos)))  # another item, not ours
                owner.append(-1)
            if d.nbytes < SMALL_TENSOR_COPY:
                # Small: the whole record in one scratch buffer, then a copy
                # (3 buffers and 3 CRC calls per tiny tensor cost more).
                pieces = [memoryview(bytearray(d.length))]
            else:
                pieces = [memoryview(bytearray(d.data_offset)), dest, memoryview(bytearray(d.end - d.start - d.nbytes))]
            buffers += pieces
            owner += [len(parts)] * len(pieces)
            parts.append((d, pieces, dest))
            pos = d.end
        exposed = [d.req.dest_index.fqn for d, pieces, _ in parts if len(pieces) > 1]
        self._progress.exposing(exposed)
        # Each item's CRC32C, piece by piece as its bytes land (in cache on
        # a local disk: see Storage.read_into_each).
        crcs = [0] * len(parts)

        def checksum(k: int, view: memoryview) -> None:
            if owner[k] >= 0:
                crcs[owner[k]] = crc32c(view, crcs[owner[k]])

        try:
            if self._verifying():
                n = self.storage.read_into_each(path, start, buffers, checksum, batch_hint=self._batch)
            else:
                n = self.storage.read_into(path, start, buffers, batch_hint=self._batch)
        except StorageNotFound as e:
            self._progress.exposing(exposed, undo=True)  # never opened: nothing was written
            raise CheckpointCorrupt(f"{self.storage.describe(path)}: data file is missing") from e
        self._check_whole(path, start, n, pos - start)
        verified = []
        error = None
        assert self._checks is not None
        for i, (entry, (d, pieces, dest)) in enumerate(zip(group, parts)):
            if len(pieces) == 1:
                record = RecordBytes.whole(pieces[0])
            else:  # the header and the trailer around the bytes that went straight into the destination
                record = RecordBytes(d.length, [(0, pieces[0]), (d.data_offset + d.nbytes, pieces[2])])
            try:
                self._check_crc(path, d.info, crcs[i])
                where = (d.data_offset, d.nbytes)
                self._checks.check_raw(path, d.info, d.req.storage_index, where, record, self._manifest_where())
            except CheckpointCorrupt as e:
                error = error or e
                continue
            if len(pieces) == 1:
                dest[:] = pieces[0][d.data_offset : d.data_offset + d.nbytes]
            verified.append((entry, len(pieces) > 1))
        return verified, error

    def _read_span(
        self, span: Span, planner: LoadPlanner, lock: threading.Lock, target: torch.Tensor | None = None
    ) -> None:
        """Read a run of neighbouring items with one ranged read; ``target``:
        the destination of its single tensor item, if already resolved."""
        blob = self._read_checked(span.path, span.offset, span.length)
        with lock:
            self.bytes_read += len(blob)
        self._use_span(span, memoryview(blob), planner, lock, target)

    def _read_checked(self, path: str, offset: int, length: int) -> bytes:
        try:
            blob = self.storage.read_range(path, offset, length)
        except StorageNotFound as e:
            raise CheckpointCorrupt(f"{self.storage.describe(path)}: data file is missing") from e
        self._check_whole(path, offset, len(blob), length)
        return blob

    def _check_whole(self, path: str, offset: int, got: int, length: int) -> None:
        """A read of ``length`` bytes at ``offset`` that brought ``got``."""
        if got != length:
            raise CheckpointCorrupt(
                f"{self.storage.describe(path)}: short read at offset {offset} ({got} of {length} bytes; truncated?)"
            )

    def _use_span(
        self,
        span: Span,
        view: memoryview,
        planner: LoadPlanner,
        lock: threading.Lock,
        target: torch.Tensor | None = None,
    ) -> None:
        """Verify the span's items (``view``: its bytes, however they came)
        and hand them to the planner."""
        self.bar.update(len(view))
        checks = self._checks
        assert checks is not None
        for req, info in span.reqs:
            start = info.offset - span.offset
            item = view[start : start + info.length]
            self._verify_item(span.path, info, item)
            if req.type == LoadItemType.BYTE_IO:
                # Built through the allowlist first: refused before the planner runs it.
                item = checks.object_bytes(span.path, info, req.storage_index, item)
                self._progress.check()  # verified, and the load goes on: change the destination
                with lock:
                    planner.load_bytes(req, io.BytesIO(item))
                self._progress.loaded([req.dest_index.fqn])
                continue
            tensor = _narrow(checks.tensor(span.path, info, req.storage_index, item), req.storage_offsets, req.lengths)
            self._progress.check()  # verified, and the load goes on: change the destination
            if target is None:
                with lock:
                    target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise CheckpointCorrupt(
                    f"{self.storage.describe(span.path)}: item {req.storage_index.fqn} has shape "
                    f"{tuple(tensor.size())}, the plan expects {tuple(target.size())}"
                )
            copy_values(target, tensor)
            with lock:
                planner.commit_tensor(req, target)
            self._progress.loaded([req.dest_index.fqn])
            target = None

    def _manifest_where(self) -> str:
        """The manifest this load checks against, for messages: its real
        name (a save over a used URI writes ``.dcpstore.{tag}.json``)."""
        return self._manifest["where"] if self._manifest is not None else self.storage.describe(MANIFEST)

    def _verifying(self) -> bool:
        """Whether this load checks items' CRC32Cs (against its manifest)."""
        return self.verify and self._manifest is not None

    def _verify_item(self, path: str, info: StorageInfo, *pieces: memoryview) -> None:
        """Check an item's CRC32C; ``pieces`` are its bytes, in order."""
        if not self._verifying():
            return
        crc = 0
        for piece in pieces:
            crc = crc32c(piece, crc)
        self._check_crc(path, info, crc)

    def _check_crc(self, path: str, info: StorageInfo, crc: int) -> None:
        """Check an item's CRC32C, ``crc`` computed over its bytes as read."""
        if not self._verifying():
            return
        assert self._manifest is not None
        expected = self._manifest["items"].get(item_key(path, info.offset))
        if expected is None:
            raise CheckpointCorrupt(
                f"{self.storage.describe(path)}: item at offset {info.offset} not in the manifest "
                f"{self._manifest_where()}"
            )
        if crc != expected:
            raise CheckpointCorrupt(
                f"{self.storage.describe(path)}: checksum mismatch in item at offset {info.offset} "
                f"({info.length} bytes, against {self._manifest_where()}): the data file is damaged"
            )

    @property
    def checkpoint_id(self) -> str:
        return self.storage.url.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return serves(checkpoint_id)


@dataclasses.dataclass(frozen=True)
class SharedCommit:
    """What the coordinator's commit read gives every rank of a load:
    ``.metadata`` (read through the allowlist there), its manifest, the
    CRC32C of the ``.metadata`` bytes (to see a replacing save), and the
    data files' sizes its listing found."""

    metadata: Metadata
    manifest: Manifest | None
    commit_crc: int | None
    sizes: dict[str, int]


def _byte_view(target: torch.Tensor, dtype: torch.dtype, nbytes: int) -> memoryview | None:
    """``target``'s bytes as a writable memoryview, if it can take the raw
    bytes as they lie (contiguous, on the CPU, same dtype and size, and no
    conjugate or negative bit: such a view's bytes are not its values; not
    quantized: its values need its quantizer, which copy_ applies)."""
    ok = target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous() and target.nbytes == nbytes
    ok = ok and not target.is_conj() and not target.is_neg() and not target.is_quantized
    if not ok or nbytes == 0:
        return None
    # as_strided, not reshape(-1): a contiguous one-element view (x[:1, 2])
    # may carry any stride, which view(uint8) refuses.
    array: Any = target.as_strided((target.numel(),), (1,)).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = torch.narrow(tensor, dim, start, length)
    return tensor
