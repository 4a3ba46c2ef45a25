"""The front door for one checkpoint: :func:`save` and :func:`load`.

*What* is saved is the caller's state dict and DCP's planner; *where* is the
storage a URI names (:mod:`dcpstore.storage`); *how* is the DCP protocol
(:mod:`dcpstore._impl.dcp`); *when* is the engines' (:mod:`dcpstore._impl.engines`).
This module only wires them together per call, from one
:class:`~dcpstore._impl.values.options.SaveOptions` / :class:`~dcpstore._impl.values.options.LoadOptions`
built from the keywords: :func:`save` and :func:`load` take every option as
a keyword, the one way they take it (every other entry point takes the
value whole, as ``options=``). It keeps no state of its own; async saves (and
sync saves on another engine than the native one) run on the engines' per-process default
:class:`~dcpstore.AsyncSaver` (:func:`dcpstore._impl.engines.saver.default_saver`),
a cache of a thread, staging buffers and process groups, not a setting.

:func:`save_with` and :func:`load_with` take the options as one value, for
layers that keep them (:class:`~dcpstore.CheckpointManager`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from dcpstore._impl.dcp.commit.session import check_commit_files
from dcpstore._impl.dcp.failures import save_error
from dcpstore._impl.dcp.liveness.retried_cleanups import with_leftovers
from dcpstore._impl.dcp.load import load_state_dict
from dcpstore._impl.dcp.state_checks import check_saveable
from dcpstore._impl.dcp.writer import save_state_dict
from dcpstore._impl.engines.saver import default_saver
from dcpstore._impl.storage import StorageOptions, open_storage
from dcpstore._impl.util.errors import CheckpointError, InvalidArgument
from dcpstore._impl.util.keyword_hints import hint_keywords_with
from dcpstore._impl.util.progress import Progress
from dcpstore._impl.values.keywords import given_keywords, resolve_options
from dcpstore._impl.values.options import LoadOptions, SaveOptions, rank_label, shows_progress
from dcpstore._impl.values.results import CheckpointInfo, SaveHandle

log = logging.getLogger(__name__)

#: What to pass instead of ``options=``, which save and load do not take.
_SAVE_INSTEAD = {
    "options": "dcpstore.save takes each option as a keyword (a dcpstore.SaveOptions o as "
    "save(state_dict, uri, **o.as_kwargs()))"
}
_LOAD_INSTEAD = {
    "options": "dcpstore.load takes each option as a keyword (workers=..., verify=..., storage_options=...)"
}


@hint_keywords_with(_SAVE_INSTEAD)
def save(
    state_dict: dict[str, Any],
    uri: str | os.PathLike[str],
    *,
    async_: bool = False,
    workers: int | None = None,
    enable_msc: bool = False,
    engine: str = "auto",
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    storage_options: StorageOptions | None = None,
    max_in_flight: int = 1,
    overwrite: bool = True,
    progress: bool = False,
    spread_prefixes: int | str = "auto",
) -> SaveHandle:
    """Save ``state_dict`` to ``uri`` as a DCP checkpoint.

    Every rank calls it with its own shard of the state (SPMD, like
    ``dcp.save``). The checkpoint becomes visible only when its ``.metadata``
    is committed, after every rank's data is durable. Each finished save
    logs one INFO line on the ``dcpstore`` logger (URI, bytes, GB/s, phases).

    Sync (default): returns a handle that is already done; errors raise here.
    Sync saves use dcpstore's native writer unless ``engine`` names another
    engine (``"nvrx"``, ``"process"``), which then runs and is waited for.

    ``async_=True``: returns once the state is staged (a host-memory copy);
    from then on the caller may mutate its tensors. The write, commit and
    finalize run on a background thread of the per-process default
    :class:`AsyncSaver` (keep your own ``AsyncSaver`` to control its
    lifetime); ``handle.result()`` re-raises a background failure. A failure
    nobody asked for is raised by the next async save instead, and reported
    at interpreter exit.

    Args:
        state_dict: this rank's state: tensors (plain, DTensor, sharded),
            nested dicts and lists, ``Stateful`` objects, picklable values.
        uri: where to save: a local path, ``file://``, ``s3://``, ``msc://``
            or an fsspec URL (docs/uris.md).
        async_: save in the background (see above).
        workers: writer threads per rank, one data file each (default: the
            CPU count, between 2 and 8, on a local disk; 4 on object stores).
        enable_msc: route ``s3://`` and local paths through NVIDIA
            Multi-Storage-Client (``storage_options.enable_msc``).
        engine: what runs the background part (docs/engines.md):
            ``"native"`` (a thread; every backend), ``"nvrx"`` (NVRx's
            writer; local paths and MSC), ``"process"`` (a checkpoint
            process per rank; every backend but ``memory://``) or
            ``"auto"``: the checkpoint process for an object store from
            a process that uses CUDA or has at least 8 cores, else native (an
            :class:`~dcpstore.EngineFallbackWarning` says why when its
            preference cannot run); ``CheckpointInfo.engine_reason`` says
            what it chose and why.
        process_group: the ranks that save together (default: all).
        planner: a DCP ``SavePlanner`` (default: DCP's own).
        storage_options: where the bytes go: the client and its tuning
            (:class:`~dcpstore.StorageOptions`).
        max_in_flight: async saves that may be pending at once; a new one
            first waits for the oldest.
        progress: draw a progress bar of this rank's bytes on stderr (rank 0
            only, under torch.distributed).
        overwrite: saving over a committed checkpoint replaces it (until the
            new ``.metadata`` lands the URI loads the old one; a failed or
            killed save leaves the old one); ``False`` refuses such a URI
            with :class:`~dcpstore.CheckpointExists` instead.
        spread_prefixes: spread the ranks' data files over this many key
            prefixes, so that many ranks writing one checkpoint do not all
            hit one object-store partition's request limit (docs/uris.md,
            "Many ranks, one checkpoint"); ``"auto"`` (default): as many as
            the number of ranks needs (1, stock DCP's flat layout, up to 16
            ranks; 1,024 at 16,384); 1: always the flat layout. Loads read
            either layout.

    Returns:
        A :class:`~dcpstore.SaveHandle`; ``result()`` gives the
        :class:`~dcpstore.CheckpointInfo`.

    Raises:
        SaveError: the save failed (sync), or an earlier async save failed
            and nobody asked its handle (async).
        CheckpointExists: ``overwrite=False`` and ``uri`` holds a committed
            checkpoint (a ``SaveError`` and a ``FileExistsError``).
        InvalidArgument: a bad option (an unknown keyword is a
            ``TypeError`` naming the likely fix).
        InvalidURI: a URI dcpstore cannot parse or has no backend for.
        BackendUnavailable: the backend's optional package is not installed.
    """
    _check_state_dict(state_dict)
    options = resolve_options(save, None, base=SaveOptions(), given=given_keywords(save, locals()))
    return save_with(state_dict, uri, options)


def save_with(
    state_dict: dict[str, Any],
    uri: str | os.PathLike[str],
    options: SaveOptions,
    commit_files: Mapping[str, bytes] | None = None,
) -> SaveHandle:
    """:func:`save` with its options as one value (for layers that keep
    one); ``commit_files``: small files of the caller's that the commit
    carries (as :class:`~dcpstore.StorageWriter`'s)."""
    _check_state_dict(state_dict)
    # A bad name fails here, before anything is written; the bytes are the caller's as of now.
    commit_files = {name: bytes(blob) for name, blob in check_commit_files(commit_files).items()}
    if options.runs_in_background:
        handle = default_saver().submit(state_dict, uri, options, commit_files)
        if not options.async_:
            handle.result()  # sync: raise here, like the native sync path
        return handle
    t0 = time.perf_counter()
    check_saveable(state_dict)  # background saves check while staging
    leftovers = default_saver().leftovers  # what earlier failed saves could not clean up
    leftovers.retry_in_background()
    storage = open_storage(uri, storage_options=options.storage_options)
    bar = Progress(f"save {storage.uri}", enabled=shows_progress(options.progress, options.process_group))
    try:
        stats = save_state_dict(
            state_dict,
            storage,
            options,
            workers=options.workers,
            process_group=options.process_group,
            progress=bar,
            commit_files=commit_files,
        )
    except (CheckpointException, CheckpointError) as e:
        raise with_leftovers(save_error(e, storage.uri), storage, leftovers) from e
    finally:
        bar.close()
        storage.close()
    elapsed = time.perf_counter() - t0
    info = CheckpointInfo.from_stats(
        storage,
        stats,
        "sync",
        engine_reason="a synchronous save: written on the caller's thread",
        stage_s=0.0,
        blocked_s=elapsed,
        total_s=elapsed,
    )
    log.info("%s%s", rank_label(options.process_group), info.describe())
    return SaveHandle.completed(info)


@hint_keywords_with(_LOAD_INSTEAD)
def load(
    state_dict: dict[str, Any],
    uri: str | os.PathLike[str],
    *,
    workers: int | None = None,
    enable_msc: bool = False,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
    verify: bool = True,
    storage_options: StorageOptions | None = None,
    progress: bool = False,
    safe_globals: Sequence[Any] | None = None,
    trusted: bool = False,
) -> None:
    """Load the checkpoint at ``uri`` into ``state_dict`` in place.

    Like ``dcp.load``, every rank calls it; tensors are filled in place and
    resharded to the caller's layout (saved on N ranks, loaded on M). Sizes
    and checksums are verified as the bytes arrive. Each load logs one INFO
    line on the ``dcpstore`` logger (URI, bytes, GB/s, phases).

    A destination that disagrees with the checkpoint (a stored object where
    it holds a tensor; complex -> real, floating -> integer, anything ->
    bool) raises :class:`StateDictMismatch` before anything is read.
    Missing or truncated files are found before anything is changed too. A
    damaged item stops the load where it is found; the error says which keys
    it had already changed on this rank (its ``loaded_keys``,
    ``partly_loaded_keys`` and ``damaged_keys``; every other key is
    unchanged). Loading a good copy again overwrites every key.

    Never executes checkpoint content: ``.metadata`` and non-tensor items are
    unpickled through allowlists (tensors, containers, plain Python values);
    another class raises :class:`UnsafeCheckpoint` naming the item and the
    class. ``safe_globals=[cls, ...]`` allows those classes; ``trusted=True``
    allows anything (only for checkpoints you trust as you trust code).

    Args:
        state_dict: the state to fill, with this rank's tensors already
            allocated in the layout wanted (as for ``dcp.load``).
        uri: the checkpoint, as for :func:`save`.
        workers: reader threads per rank (default: the CPU count, between
            2 and 8, on a local disk; 4 on object stores).
        enable_msc: route ``s3://`` and local paths through NVIDIA
            Multi-Storage-Client (``storage_options.enable_msc``).
        process_group: the ranks that load together (default: all).
        planner: a DCP ``LoadPlanner`` (default: DCP's own).
        verify: check every item's CRC32C and every file's size against the
            manifest (``False``: trust the bytes).
        storage_options: where the bytes are: the client and its tuning
            (:class:`~dcpstore.StorageOptions`).
        progress: draw a progress bar of this rank's bytes on stderr (rank 0
            only, under torch.distributed).
        safe_globals: classes a non-tensor item may hold beyond the
            allowlist (``[cls, ...]``).
        trusted: unpickle anything (only for checkpoints you trust as you
            trust code).

    Raises:
        CheckpointNotFound: no committed checkpoint at ``uri`` (including a
            save that was interrupted before its commit).
        CheckpointCorrupt: a file is damaged or missing; the message names it.
        UnsafeCheckpoint: an item holds a class off the allowlist (nothing
            of it was executed).
        StateDictMismatch: ``state_dict`` disagrees with the checkpoint
            (nothing was read).
        LoadError: the load failed on some rank for another reason.
        StorageError: the backend failed after its retries.
        InvalidArgument: a bad option (an unknown keyword is a
            ``TypeError`` naming the likely fix).
    """
    _check_state_dict(state_dict)
    options = resolve_options(load, None, base=LoadOptions(), given=given_keywords(load, locals()))
    load_with(state_dict, uri, options)


def load_with(state_dict: dict[str, Any], uri: str | os.PathLike[str], options: LoadOptions) -> None:
    """:func:`load` with its options as one value."""
    _check_state_dict(state_dict)
    storage = open_storage(uri, storage_options=options.storage_options)
    bar = Progress(f"load {storage.uri}", enabled=shows_progress(options.progress, options.process_group))
    try:
        stats = load_state_dict(state_dict, storage, options, bar)
    finally:
        bar.close()
        storage.close()
    log.info("%s%s", rank_label(options.process_group), stats.describe(storage.uri))


def _check_state_dict(state_dict: Any) -> None:
    if not isinstance(state_dict, dict):
        raise InvalidArgument(f"state_dict must be a dict, got {type(state_dict).__name__}")
