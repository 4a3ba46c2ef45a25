"""DCP ``StorageWriter`` written once over :class:`~dcpstore.storage.Storage`.

Nothing here knows which backend it talks to: local files, S3, MSC and fsspec
all arrive through the same few byte-level calls (see
:mod:`dcpstore._impl.storage.base`). The commit protocol is the
:class:`~dcpstore._impl.dcp.commit.SaveSession`'s; this module plans the files and
writes them.

Save, as ``torch.distributed.checkpoint.save`` drives it::

    (all ranks)   [reset(checkpoint_id)]  only when DCP is given a checkpoint_id:
                                        this save goes to that URI (and so do
                                        later saves given none)
    (all ranks)   storage_meta          starts this save's SaveSession, so the
                                        planner sees the save id .metadata records
    (all ranks)   set_up_storage_writer -> prepare_local_plan
    (coordinator) prepare_global_plan   assigns each rank its ``__{rank}_`` prefix
                                        (in its spread directory, if the save
                                        spreads) and claims the URI (SaveSession.claim)
    (all ranks)   write_data            ``workers`` threads, one data file each,
                                        size-balanced buckets, largest first;
                                        once every file is written, one check
                                        that the URI is still this save's
                                        (OwnerGate), then every file committed
                                        (durable) on return. On an object store,
                                        where the writer knows DCP's process
                                        group (``shares_owner_check``), that
                                        check is one per save, not per rank:
                                        every rank reports ready over the
                                        group, the coordinator reads the
                                        marker, every rank gets the outcome
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

Every dcpstore writer is this class: file naming, spread prefixes, the
claim, the ownership gate and the publish are written here once; another
writer (the NVRx engine's, Megatron's async one) replaces two hooks,
:meth:`bucket_items` and :meth:`write_file`, and sets two flags.
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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcpstore._impl.dcp.commit.session import SaveSession, check_commit_files
from dcpstore._impl.dcp.data_files import (
    file_size_hint,
    item_nbytes,
    rank_prefix,
    resolve_item,
    split_buckets,
    write_data_file,
    write_stats,
)
from dcpstore._impl.dcp.failures import describe_failure
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate, run_gated, run_shared_gated
from dcpstore._impl.storage import (
    AUTO_SPREAD,
    Storage,
    backend_name,
    check_spread_prefixes,
    parse_uri,
    resolve_spread_prefixes,
)
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointError, CheckpointExists, InvalidArgument, SaveError
from dcpstore._impl.util.progress import NO_PROGRESS, Progress
from dcpstore._impl.util.torch_compat import (
    DistWrapper,
    StoragePrefix,
    StorageWriterTransforms,
    StreamTransformExtension,
)
from dcpstore._impl.util.warning_filters import ignoring
from dcpstore._impl.values.options import SaveOptions, check_workers
from dcpstore._impl.values.results import SaveStats

#: DCP warns on every call made without an initialised process group; a
#: single-process save or load is a supported, deliberate use here.
NO_DIST_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


@dataclass
class SaveToken(StoragePrefix):
    """The coordinator's per-rank plan data: the file prefix (``__{rank}_``,
    as stock DCP) and the save id every rank checks before publishing."""

    save_id: str = ""
    #: Whether the save writes save-unique names (the claim's choice).
    tagged: bool = False
    #: How many ranks share one ownership check (the coordinator's choice,
    #: :meth:`DcpStorageWriter.shared_check_ranks`): all it planned for,
    #: over a group of exactly this size; 0: each rank checks its own.
    shared_check_ranks: int = 0


#: Why ``use_collectives=False`` is refused (DCP's rank-local metadata).
NO_COLLECTIVES_WHY = (
    "use_collectives=False makes every rank commit its own __{rank}.metadata: there is no single commit "
    "point, so a crash between two ranks' commits leaves a mixture of two saves, which dcpstore never "
    "publishes; save with use_collectives=True (the default)"
)


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
    #: The ranks share one ownership check (:meth:`DcpStorageWriter.exchange_owner_check`).
    shared_check: bool = False
    #: This rank has joined that check's exchange (each rank joins it once).
    exchanged: bool = False

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
    :meth:`~dcpstore._impl.dcp.commit.SaveSession.publish`); the attribute of the
    same name may be replaced between saves (each save takes the files
    the attribute holds when it begins). ``spread_prefixes``: the key
    prefixes the ranks' data files are spread over
    (:attr:`dcpstore.SaveOptions.spread_prefixes`; 1: stock DCP's flat layout;
    ``"auto"``: from the number of ranks, :func:`auto_spread_prefixes`).
    Saves through one writer may overlap (see the module docstring).
    """

    #: How every rank gets the save's session. False (DCP's save): the
    #: coordinator claims the URI in :meth:`prepare_global_plan` and each
    #: rank's plan carries the token (:class:`SaveToken`). True: the
    #: coordinator claimed it before planning (:meth:`claim_shared`), so
    #: plans carry only file prefixes and may be cached and replayed (NVRx's
    #: planner does).
    claims_before_planning: bool = False
    #: Data files are written under their final names as they go (NVRx
    #: writes with ``open()``): the URI must be this save's before any of
    #: them is written, too.
    writes_in_place: bool = False
    #: The ranks that plan together (decentralized planning asks this
    #: rank's place in it); None: the default group.
    process_group: dist.ProcessGroup | None = None
    #: Whether :attr:`process_group` is the group DCP saves over, so that
    #: the ranks may share one ownership check over it
    #: (:meth:`exchange_owner_check`): :func:`save_state_dict` runs
    #: ``dcp.save`` itself and sets it. Under a caller's own ``dcp.save``
    #: the writer is not told DCP's group, and a collective over another
    #: group could hang or interleave with the caller's, so each rank
    #: checks for itself.
    shares_owner_check: bool = False

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
        spread_prefixes: int | str = AUTO_SPREAD,
    ) -> None:
        super().__init__()
        self.commit_files = dict(check_commit_files(commit_files))
        self.spread_prefixes = check_spread_prefixes(spread_prefixes)
        #: The id the coordinator's claim records (None: a fresh one per save).
        self._save_id = save_id
        self.storage = storage
        self.workers = check_workers(workers, storage.default_workers())
        self.single_file_per_rank = single_file_per_rank
        self.overwrite = overwrite
        #: DCP's stream transforms for every item (None: store items as they are).
        self.transforms = StorageWriterTransforms(list(extensions)) if extensions else None
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
        # Each rank's prefix (``__{i}_`` as stock DCP, in its spread
        # directory); the coordinator's claim and its token too, unless the
        # session was claimed and shared before planning.
        spread = resolve_spread_prefixes(self.spread_prefixes, len(plans))
        if self.claims_before_planning:
            return [
                dataclasses.replace(plan, storage_data=StoragePrefix(rank_prefix(i, spread)))
                for i, plan in enumerate(plans)
            ]
        self.session.claim(self.overwrite)
        save_id, tagged = self.session.token
        sharing = self.shared_check_ranks(len(plans))
        return [
            dataclasses.replace(plan, storage_data=SaveToken(rank_prefix(i, spread), save_id, tagged, sharing))
            for i, plan in enumerate(plans)
        ]

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """This rank's part of :meth:`prepare_global_plan` (NVRx's planner,
        for a writer that ``claims_before_planning``: a plan carries only
        the prefix)."""
        if not self.claims_before_planning:
            raise InvalidArgument("this writer's plans carry the save's token: plan them on the coordinator")
        rank, ranks = (
            (dist.get_rank(self.process_group), dist.get_world_size(self.process_group)) if is_distributed() else (0, 1)
        )
        prefix = rank_prefix(rank, resolve_spread_prefixes(self.spread_prefixes, ranks))
        return dataclasses.replace(local_plan, storage_data=StoragePrefix(prefix))

    def claim_shared(self, wrapper: DistWrapper) -> None:
        """Claim this save's URI before planning (a writer that
        ``claims_before_planning``): :func:`claim_and_share` on ``wrapper``'s
        group, a collective; raises on every rank alike."""
        self._save().session = claim_and_share(self._save().storage, wrapper, self.overwrite, self._save_id)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t_start = time.perf_counter()
        save = self._save()
        save.stats.plan_s = t_start - save.stats.started
        token = plan.storage_data
        if isinstance(token, SaveToken) and (token.save_id, token.tagged) != self.session.token:
            save.session = SaveSession(save.storage, token.save_id, token.tagged)  # a follower: the coordinator's save
        save.shared_check = isinstance(token, SaveToken) and self.shares_check_among(token.shared_check_ranks)
        save.exchanged = False
        future: Future[list[WriteResult]] = Future()
        try:
            self.progress.start(sum(item_nbytes(it) for it in plan.items))
            results = self.write_files(self.named_buckets(plan), planner)
        except BaseException as e:  # DCP gathers exceptions across ranks
            if save.shared_check and not save.exchanged:
                # Failed before its files got anywhere: the other ranks wait for it in the exchange.
                with contextlib.suppress(Exception):
                    self.exchange_owner_check(False)
            self.release()
            future.set_exception(e)  # type: ignore[arg-type]  # torch's stub types it as the value
            return future
        write_stats(save.stats, results, t_start)
        future.set_result(results)
        return future

    # -- a rank's data files: written once, for every writer ------------------
    def named_buckets(self, plan: SavePlan) -> list[tuple[str, list[WriteItem]]]:
        """This rank's data files: ``(name, items)`` per bucket of
        :meth:`bucket_items`, named by the save's session."""
        prefix: str = plan.storage_data.prefix
        return [(self.session.data_file(prefix, i), items) for i, items in enumerate(self.bucket_items(plan.items))]

    def write_files(self, named: Sequence[tuple[str, list[WriteItem]]], planner: SavePlanner) -> list[WriteResult]:
        """Write every data file of :meth:`named_buckets`, each on its own
        thread through :meth:`write_file`; one ownership check
        (:class:`~dcpstore._impl.dcp.liveness.owner_gate.OwnerGate`) once every file is
        written and before any is published -- and before any is written,
        for a writer that ``writes_in_place``. Returns the write results."""
        storage = self._save().storage
        lock = threading.Lock()  # planners are not promised to be thread-safe

        def data_of(item: WriteItem) -> io.BytesIO | torch.Tensor:
            return resolve_item(planner, item, lock)

        batch = sum(file_size_hint(items) for _, items in named)
        if self.writes_in_place:
            self.session.check_owner()

        def work(nb: tuple[str, list[WriteItem]], gate: OwnerGate) -> list[WriteResult]:
            return self.write_file(storage, nb[0], nb[1], data_of, gate, batch)

        save = self._save()
        if save.shared_check:

            def exchange(ready: bool) -> BaseException | None:
                save.exchanged = True
                return self.exchange_owner_check(ready)

            per_file = run_shared_gated(exchange, work, named, "dcpstore-write")
        else:
            per_file = run_gated(self.session.check_owner, work, named, "dcpstore-write")
        return [r for rs in per_file for r in rs]

    # -- one ownership check per save ----------------------------------------
    def shared_check_ranks(self, ranks: int) -> int:
        """Coordinator: ``ranks`` where they may share one ownership check,
        else 0. Only where every rank reaches the coordinator's storage by
        the same name: an object store, not a directory of this machine's
        filesystem, which may be each node's own (a tiered manager's node
        directories, each with its node's marker, which the coordinator's
        read would never see)."""
        return ranks if self._save().storage.local_path() is None else 0

    def shares_check_among(self, ranks: int) -> bool:
        """Whether this save's ranks share one ownership check: the writer
        knows DCP's group (:attr:`shares_owner_check`) and it holds exactly
        the ``ranks`` the coordinator planned for (more than one)."""
        if not (self.shares_owner_check and ranks > 1 and is_distributed()):
            return False
        return bool(dist.get_world_size(self.process_group) == ranks)

    def exchange_owner_check(self, ready: bool) -> BaseException | None:
        """Every rank, once per save, on DCP's thread (where the job's
        collectives run): report whether this rank's files are ready to
        publish (``ready``; False: one failed, which is reported through
        DCP's gather as ever), then take the coordinator's outcome. The
        coordinator checks the marker once every rank has reported, so the
        one read follows the writing of every data file of the save and
        precedes the publication of any. Returns the check's failure (the
        coordinator's own exception there, a :class:`SaveError` naming it
        elsewhere), or None."""
        wrapper = DistWrapper(self.process_group, True, 0)
        wrapper.gather_object(ready)
        error: BaseException | None = None
        said: str | None = None
        if wrapper.is_coordinator:
            try:
                self.session.check_owner()
            except BaseException as e:  # every rank waits in the broadcast below: it must be sent
                error, said = e, describe_failure(e)
        said = wrapper.broadcast_object(said)
        if error is not None:
            return error
        return None if said is None else SaveError(f"{said} (checked by the coordinator)")

    # -- hooks: what a writer of another kind replaces ------------------------
    def bucket_items(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        """Hook: this rank's items, one list per data file (size-balanced
        over ``workers`` files; one file per item when not
        ``single_file_per_rank``)."""
        if self.single_file_per_rank:
            return split_buckets(items, self.workers)
        return [[item] for item in items]

    def write_file(
        self,
        storage: Storage,
        name: str,
        items: list[WriteItem],
        data_of: Callable[[WriteItem], io.BytesIO | torch.Tensor],
        gate: OwnerGate,
        batch: int,
    ) -> list[WriteResult]:
        """Hook: write data file ``name`` holding ``items``, published only
        once ``gate.wait()`` passes; its items' write results, each with its
        :class:`~dcpstore._impl.dcp.commit.ItemRecord`. ``batch``: the bytes of
        all the files this rank writes now (object stores share their
        connection budget over them)."""
        return write_data_file(storage, name, items, data_of, self.transforms, self.progress, gate, batch)

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


def claim_and_share(storage: Storage, wrapper: DistWrapper, overwrite: bool, save_id: str | None) -> SaveSession:
    """The coordinator claims the URI; every rank gets the session's token
    (or the coordinator's failure: ``CheckpointExists`` or ``SaveError`` on
    every rank alike) by broadcast on ``wrapper``'s group, so no rank writes
    before the claim. Returns this rank's session."""
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
    options: SaveOptions,
    *,
    workers: int | None,
    process_group: dist.ProcessGroup | None,
    progress: Progress = NO_PROGRESS,
    commit_files: Mapping[str, bytes] | None = None,
) -> SaveStats:
    """One whole DCP save of ``state_dict`` to ``storage`` with dcpstore's
    writer (every rank calls it; ``process_group`` None: no collectives),
    as ``options`` say (its planner, overwrite, spread and save id; the
    caller passes the threads and the group it resolved), the coordinator's
    ``commit_files`` in its commit. The native engine, sync or on an async
    saver's background thread.
    Raises what DCP raises (a ``CheckpointException`` for a failure on any
    rank)."""
    writer = DcpStorageWriter(
        storage,
        workers=workers,
        overwrite=options.overwrite,
        progress=progress,
        save_id=options.save_id,
        spread_prefixes=options.spread_prefixes,
        commit_files=commit_files,
    )
    writer.process_group, writer.shares_owner_check = process_group, True  # dcp_save below saves over this group
    no_dist = not is_distributed()
    try:
        with ignoring(NO_DIST_WARNING) if no_dist else contextlib.nullcontext():
            dcp_save(
                state_dict, storage_writer=writer, planner=options.planner, process_group=process_group, no_dist=no_dist
            )
    except BaseException:
        writer.release()  # e.g. another rank failed: gc may collect what this save left
        raise
    return writer.stats
