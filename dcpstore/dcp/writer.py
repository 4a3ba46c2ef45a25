"""DCP ``StorageWriter`` written once over :class:`~dcpstore.storage.Storage`.

Nothing here knows which backend it talks to: local files, S3, MSC and fsspec
all arrive through the same few byte-level calls (see
:mod:`dcpstore.storage.base`). The commit protocol is the
:class:`~dcpstore.dcp.commit.SaveSession`'s; this module plans the files and
writes them.

Save, as ``torch.distributed.checkpoint.save`` drives it::

    (all ranks)   [reset(checkpoint_id)]  only when DCP is given a checkpoint_id:
                                        this save goes to that URI (and so do
                                        later saves given none)
    (all ranks)   storage_meta          starts this save's SaveSession, so the
                                        planner sees the save id .metadata records
    (all ranks)   set_up_storage_writer -> prepare_local_plan
    (coordinator) prepare_global_plan   assigns each rank its ``__{rank}_`` prefix
                                        (in its spread directory, if the storage
                                        spreads) and claims the URI (SaveSession.claim)
    (all ranks)   write_data            ``workers`` threads, one data file each,
                                        size-balanced buckets, largest first;
                                        once every file is written, one check
                                        that the URI is still this save's
                                        (OwnerGate), then every file committed
                                        (durable) on return
    (coordinator) finish                runs only if *every* rank's write_data
                                        succeeded (DCP gathers the results):
                                        SaveSession.publish -- the commit files,
                                        the manifest, then ``.metadata`` last
    (coordinator) release               when the save failed on any rank
                                        (:func:`save_state_dict` calls it when
                                        ``dcp.save`` raises): SaveSession.release

One writer serves saves that overlap: ``dcp.async_save`` runs each save's
``dcp.save`` whole on a thread of its own (the thread executor starts one per
call; the process executor's checkpoint process runs them one at a time on
its main thread), so several saves through one writer may be at any of the
steps above at once, in any interleaving. Nothing of one save is kept on the
writer object: DCP runs every call of one save on one thread and passes no
handle to tell saves apart, so each thread's current save (:class:`_Save`:
its URI, session and stats) is its own, begun by ``reset`` or, without
a checkpoint_id, by the first call of the next save on that thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import _StoragePrefix, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CheckpointError, InvalidArgument, SaveError
from ..format.layout import spread_file_prefix
from ..format.record import RecordStream, compact_cpu_tensor, encode_item
from ..handle import SaveStats
from ..options import check_workers
from ..progress import NO_PROGRESS, Progress
from ..quiet import ignoring
from ..storage import Storage, backend_name, parse_uri
from .commit import ItemRecord, SaveSession, check_commit_files
from .owner_gate import OwnerGate, run_gated

#: DCP warns on every call made without an initialised process group; a
#: single-process save or load is a supported, deliberate use here.
NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


@dataclass
class SaveToken(_StoragePrefix):
    """The coordinator's per-rank plan data: the file prefix (``__{rank}_``,
    as stock DCP) and the save id every rank checks before publishing."""

    save_id: str = ""
    #: Whether the save writes save-unique names (the claim's choice).
    tagged: bool = False


#: About what a tensor record adds to its bytes (zip headers, pickle,
#: alignment; ~1.3 KiB measured), rounded up.
RECORD_HEADERS_ESTIMATE = 4096


def item_nbytes(item: WriteItem) -> int:
    """The bytes of a tensor item's data (0 for a bytes item)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for dim in item.tensor_data.size:
        numel *= dim
    return numel * item.tensor_data.properties.dtype.itemsize


#: Why ``use_collectives=False`` is refused (DCP's rank-local metadata).
NO_COLLECTIVES_WHY = (
    "use_collectives=False makes every rank commit its own __{rank}.metadata: there is no single commit "
    "point, so a crash between two ranks' commits leaves a mixture of two saves, which dcpstore never "
    "publishes; save with use_collectives=True (the default)"
)


def file_size_hint(items: Sequence[WriteItem]) -> int:
    """The expected size of a data file holding ``items``: the tensor bytes
    and an upper estimate of each record's headers."""
    return sum(item_nbytes(it) + RECORD_HEADERS_ESTIMATE for it in items)


def split_buckets(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Size-balanced buckets: tensors largest first into the lightest bucket,
    byte blobs round-robin. Empty buckets are dropped."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    blobs = [it for it in items if it.type == WriteItemType.BYTE_IO]
    tensors = sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=item_nbytes, reverse=True)
    for i, item in enumerate(blobs):
        buckets[i % bins].append(item)
    for item in tensors:
        idx = min(range(bins), key=sizes.__getitem__)
        buckets[idx].append(item)
        sizes[idx] += item_nbytes(item)
    return [b for b in buckets if b]


def _resolve(planner: SavePlanner, item: WriteItem, lock: threading.Lock) -> io.BytesIO | torch.Tensor:
    """The bytes or CPU tensor to write for ``item``; errors name the key."""
    try:
        with lock:
            data = planner.resolve_data(item)
        return data if isinstance(data, io.BytesIO) else compact_cpu_tensor(data)
    except Exception as e:
        raise SaveError(f"cannot serialise {item.index.fqn!r}: {type(e).__name__}: {e}") from e


def write_stats(stats: SaveStats, results: Sequence[WriteResult], started: float) -> None:
    """Fill in ``stats``' write phase from this rank's write results."""
    stats.write_s = time.perf_counter() - started
    stats.bytes_written = sum(r.storage_data.file_size for r in results if r.storage_data.offset == 0)
    stats.files = sorted({r.storage_data.relative_path for r in results})


def rank_prefix(rank: int, spread: int) -> str:
    """The DCP file prefix of ``rank``'s data files (``__{rank}_``, as stock
    DCP), in its spread directory when the storage spreads them."""
    return spread_file_prefix(f"__{rank}_", rank, spread)


def write_data_file(
    storage: Storage,
    name: str,
    items: Sequence[WriteItem],
    data_of: Callable[[WriteItem], io.BytesIO | torch.Tensor],
    transforms: _StorageWriterTransforms | None,
    progress: Progress,
    gate: OwnerGate,
    batch_hint: int | None = None,
) -> list[WriteResult]:
    """Write one data file ``name`` holding ``items`` (``data_of(item)``: its
    bytes or CPU tensor, asked for one item at a time), published once
    ``gate`` passes; returns the items' write results, each carrying its
    :class:`ItemRecord`. ``batch_hint``: the bytes of all the files this
    rank writes now, over which object stores share their connection budget
    (:meth:`~dcpstore.storage.StorageOptions.upload_part_size`). Every
    writer's data files are written here."""
    written = []
    with storage.open_write(name, size_hint=file_size_hint(items), batch_hint=batch_hint) as writer:
        stream = RecordStream(writer)
        for item in items:
            data = data_of(item)
            descriptors: tuple[str, ...] = ()
            if transforms is not None:
                data, descriptors = encode_item(data, item, transforms)
            written.append((item, stream.write_item(data), descriptors))
            progress.update(item_nbytes(item))
        file_size, file_crc = stream.finish()
        writer.seal()  # the last part leaves now, not after the gate's round trip
        # Leaving the block publishes the file; a save that lost its
        # URI to a later save must not clobber that save's files.
        gate.wait()
    return [
        WriteResult(
            index=item.index,
            size_in_bytes=w.length,
            storage_data=ItemRecord(name, w.offset, w.length, w.crc32c, file_size, file_crc, w.raw, descriptors),
        )
        for item, w, descriptors in written
    ]


@dataclass
class _Save:
    """One save through a :class:`DcpStorageWriter`: what its DCP calls share."""

    storage: Storage
    #: Its commit protocol (from ``storage_meta``; a follower rank's is
    #: replaced by one with the coordinator's token in ``write_data``).
    session: SaveSession | None = None
    #: ``set_up_storage_writer`` ran: the next ``storage_meta`` or set-up on
    #: this thread begins another save.
    running: bool = False
    stats: SaveStats = field(default_factory=SaveStats)
    #: The writer's ``commit_files`` when this save began.
    commit_files: Mapping[str, bytes] = field(default_factory=dict)

    def release(self) -> None:
        if self.session is not None:
            self.session.release()


class DcpStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` over any :class:`Storage`.

    ``workers`` threads write one data file each per rank
    (``single_file_per_rank=False``: one file per item, as stock DCP's
    option); ``extensions``: DCP's stream transforms, applied to every item
    as stock DCP applies them; ``progress`` counts this rank's bytes as
    items are written. Built by :func:`save_state_dict` (:func:`dcpstore.save`)
    and, from a URI, by :class:`dcpstore.StorageWriter` (which passes
    ``reopen`` so that :meth:`reset` can re-point it to another URI).
    ``commit_files``: name -> bytes of small files the coordinator writes
    with the commit, before ``.metadata`` (see
    :meth:`~dcpstore.dcp.commit.SaveSession.publish`); the attribute of the
    same name may be replaced between saves (each save takes the files
    the attribute holds when it begins).
    Saves through one writer may overlap (see the module docstring).
    """

    def __init__(
        self,
        storage: Storage,
        *,
        workers: int | None = None,
        reopen: Callable[[str], Storage] | None = None,
        single_file_per_rank: bool = True,
        overwrite: bool = True,
        extensions: Sequence[StreamTransformExtension] = (),
        progress: Progress = NO_PROGRESS,
        save_id: str | None = None,
        commit_files: Mapping[str, bytes] | None = None,
    ) -> None:
        super().__init__()
        self.commit_files = dict(check_commit_files(commit_files))
        #: The id the coordinator's claim records (None: a fresh one per save).
        self._save_id = save_id
        self.storage = storage
        self.workers = check_workers(workers, storage.default_workers())
        self.single_file_per_rank = single_file_per_rank
        self.overwrite = overwrite
        #: DCP's stream transforms for every item (None: store items as they are).
        self.transforms = _StorageWriterTransforms(list(extensions)) if extensions else None
        self._reopen = reopen
        self.progress = progress
        #: This thread's current save (see the module docstring).
        self._saves = self._save_slots()

    # -- this thread's save -------------------------------------------------
    @staticmethod
    def _save_slots() -> threading.local | types.SimpleNamespace:
        """Where the current save lives: one per thread, as DCP runs every
        writer call of one save on one thread (saves may overlap)."""
        return threading.local()

    def _current(self) -> _Save | None:
        save: _Save | None = getattr(self._saves, "save", None)
        return save

    def _begin(self, storage: Storage) -> _Save:
        """Begin this thread's next save, at ``storage``."""
        previous = self._current()
        if previous is not None:
            previous.release()  # this thread's previous save, should it never have finished
        save = self._saves.save = _Save(storage, commit_files=dict(self.commit_files))
        return save

    def _save(self) -> _Save:
        """This thread's save that DCP is setting up or running."""
        save = self._current()
        if save is None:
            raise SaveError("the DCP writer was used before set_up_storage_writer")
        return save

    @property
    def session(self) -> SaveSession:
        """This thread's save's commit protocol (a new one per save, from
        ``storage_meta`` or set-up; a follower rank's takes the coordinator's
        save id in ``write_data``)."""
        session = self._save().session
        if session is None:
            raise SaveError("the DCP writer was used before set_up_storage_writer")
        return session

    @property
    def stats(self) -> SaveStats:
        """This thread's last save's phase timings and volume."""
        save = self._current()
        return save.stats if save is not None else SaveStats()

    # -- DCP protocol -----------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Begin a save at ``checkpoint_id`` (DCP calls this, on every rank,
        only when ``dcp.save`` is given a ``checkpoint_id``); later saves
        given none go there too, as with stock DCP's writers."""
        self.storage = rebind(self.storage, checkpoint_id, self._reopen, "writer")
        self._begin(self.storage)

    def storage_meta(self) -> StorageMeta | None:
        # DCP asks before set_up_storage_writer, to hand the planner the save
        # id: the save's session starts here so that it is the id .metadata
        # records.
        save = self._current()
        if save is None or save.running:
            save = self._begin(self.storage)
        if save.session is None:
            save.session = SaveSession(save.storage, self._save_id)
        return save.session.storage_meta()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Runs on every save (reset() only with a checkpoint_id, storage_meta()
        # only on DCP versions that ask for it).
        save = self._current()
        if save is None or save.running:
            save = self._begin(self.storage)
        if not kwargs.get("use_collectives", True):
            raise InvalidArgument(f"cannot save to {save.storage.uri}: {NO_COLLECTIVES_WHY}")
        save.running = True
        save.stats = SaveStats(started=time.perf_counter())
        if save.session is None:
            save.session = SaveSession(save.storage, self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._save().storage.makedirs()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.session.claim(self.overwrite)
        save_id, tagged = self.session.token
        spread = self._save().storage.options.spread_prefixes
        return [
            dataclasses.replace(plan, storage_data=SaveToken(rank_prefix(i, spread), save_id, tagged))
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t_start = time.perf_counter()
        save = self._save()
        save.stats.plan_s = t_start - save.stats.started
        token: SaveToken = plan.storage_data
        if (token.save_id, token.tagged) != self.session.token:  # a follower: the coordinator's save
            save.session = SaveSession(save.storage, token.save_id, token.tagged)
        if self.single_file_per_rank:
            buckets = split_buckets(plan.items, self.workers)
        else:
            buckets = [[item] for item in plan.items]
        self.progress.start(sum(item_nbytes(it) for it in plan.items))
        lock = threading.Lock()  # planners are not promised to be thread-safe
        future: Future[list[WriteResult]] = Future()
        named = [(self.session.data_file(token.prefix, i), bucket) for i, bucket in enumerate(buckets)]
        batch = sum(file_size_hint(bucket) for bucket in buckets)
        try:
            per_file = run_gated(
                self.session.check_owner,
                lambda nb, gate: self._write_file(save.storage, nb[0], nb[1], planner, lock, gate, batch),
                named,
                "dcpstore-write",
            )
        except BaseException as e:  # DCP gathers exceptions across ranks
            self.release()
            future.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the value
            return future
        results = [r for rs in per_file for r in rs]
        write_stats(save.stats, results, t_start)
        future.set_result(results)
        return future

    def _write_file(
        self,
        storage: Storage,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
        lock: threading.Lock,
        gate: OwnerGate,
        batch: int,
    ) -> list[WriteResult]:
        return write_data_file(
            storage, name, items, lambda item: _resolve(planner, item, lock), self.transforms, self.progress, gate, batch
        )

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        t_start = time.perf_counter()
        save = self._save()
        self.session.publish(metadata, results, save.commit_files)
        save.stats.commit_s = time.perf_counter() - t_start

    def release(self) -> None:
        """This thread's save failed (on any rank) or never finished: its
        session's :meth:`~SaveSession.release` (coordinator: ``gc`` may then
        collect what the save left; a no-op elsewhere and after the commit).
        DCP tells no writer that another rank failed: :func:`save_state_dict`
        calls this when ``dcp.save`` raises. Idempotent."""
        save = self._current()
        if save is not None:
            save.release()

    @property
    def checkpoint_id(self) -> str:
        """This thread's save's URI (the writer's, outside a save)."""
        save = self._current()
        return (save.storage if save is not None else self.storage).url.uri

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_saves"]  # per thread: a copy begins no save
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._saves = self._save_slots()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether dcpstore serves ``checkpoint_id``: a local path, ``file://``,
        ``s3://``, ``msc://`` or a scheme an installed fsspec filesystem
        knows (not any string that parses as a URI)."""
        return serves(checkpoint_id)


def rebind(
    storage: Storage,
    checkpoint_id: str | os.PathLike[str] | None,
    reopen: Callable[[str], Storage] | None,
    role: Literal["writer", "reader"],
) -> Storage:
    """The storage that a DCP ``reset(checkpoint_id)`` points the next save
    or load at (``role``: "writer" or "reader", for the message):
    ``storage`` itself when ``checkpoint_id`` is None or names its URI, else
    ``reopen(checkpoint_id)``. Without ``reopen`` (a writer or reader built
    on one :class:`Storage`) switching is refused with ``InvalidArgument``."""
    if checkpoint_id is None or parse_uri(checkpoint_id).uri == storage.url.uri:
        return storage
    if reopen is None:
        raise InvalidArgument(
            f"this {role} is bound to {storage.uri}; cannot switch to checkpoint_id "
            f"{os.fspath(checkpoint_id)!r} (dcpstore.Storage{role.capitalize()} can)"
        )
    return reopen(os.fspath(checkpoint_id))


def serves(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a backend of dcpstore's serves ``checkpoint_id``."""
    try:
        backend_name(parse_uri(checkpoint_id))
    except CheckpointError:
        return False
    return True


def save_state_dict(
    state_dict: dict[str, Any],
    storage: Storage,
    *,
    workers: int | None,
    process_group: dist.ProcessGroup | None,
    planner: SavePlanner | None,
    overwrite: bool = True,
    progress: Progress = NO_PROGRESS,
    save_id: str | None = None,
) -> SaveStats:
    """One whole DCP save of ``state_dict`` to ``storage`` with dcpstore's
    writer (every rank calls it; ``process_group`` None: no collectives).
    The native engine, sync or on an async saver's background thread.
    Raises what DCP raises (a ``CheckpointException`` for a failure on any
    rank). ``save_id``: the id the coordinator's claim records
    (:class:`~dcpstore.dcp.commit.SaveSession`; None: a fresh one)."""
    writer = DcpStorageWriter(storage, workers=workers, overwrite=overwrite, progress=progress, save_id=save_id)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with ignoring(NO_DIST_WARNING) if no_dist else contextlib.nullcontext():
            dcp_save(state_dict, storage_writer=writer, planner=planner, process_group=process_group, no_dist=no_dist)
    except BaseException:
        writer.release()  # e.g. another rank failed: gc may collect what this save left
        raise
    return writer.stats
