"""One whole DCP load with dcpstore's reader, as every rank runs it
(:func:`load_state_dict`), including the tries of a load whose checkpoint
other saves keep replacing. Its save side is
:func:`~dcpstore._impl.dcp.writer.save_state_dict`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from dcpstore._impl.dcp.failures import describe_failure, load_error
from dcpstore._impl.dcp.load_progress import NO_CHANGES, LoadProgress, changes_of
from dcpstore._impl.dcp.reader import REPLACED, RETRIED, DcpStorageReader
from dcpstore._impl.dcp.state_checks import check_top_level_keys
from dcpstore._impl.dcp.writer import NO_DIST_WARNING
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointError, PeerFailed
from dcpstore._impl.util.progress import NO_PROGRESS, Progress
from dcpstore._impl.util.warning_filters import ignoring
from dcpstore._impl.values.options import LoadOptions
from dcpstore._impl.values.results import LoadStats

log = logging.getLogger(__name__)

#: Tries of one load whose checkpoint other saves keep replacing while it
#: runs (see :func:`load_state_dict`).
LOAD_TRIES = 4


def load_state_dict(
    state_dict: dict[str, Any], storage: Storage, options: LoadOptions, progress: Progress = NO_PROGRESS
) -> LoadStats:
    """One whole DCP load of ``storage`` into ``state_dict`` in place, with
    dcpstore's reader (every rank calls it); returns what this rank read. A
    failure on any rank raises the first failed rank's
    :class:`CheckpointError` (or a :class:`~dcpstore.LoadError`) on every
    rank.

    A destination that disagrees with the checkpoint (a stored object where
    it holds a tensor; complex -> real, floating -> integer, anything ->
    bool) raises :class:`~dcpstore.StateDictMismatch` before anything is
    read; missing or truncated files are found before anything is changed
    too. A damaged item stops the load where it is found; the error says
    which keys it had already changed on this rank (its ``loaded_keys``,
    ``partly_loaded_keys`` and ``damaged_keys``; every other key is
    unchanged).

    A load racing a save over the same URI loads the old checkpoint or the
    new one, whole: one that read the old ``.metadata`` can find the files
    it names deleted by the new save once that has committed, and such a
    failure (a missing or damaged file, when the ``.metadata`` read is no
    longer there) loads again, from the new commit, up to
    :data:`LOAD_TRIES` tries in all. The first failed rank's error decides,
    so every rank tries again or none. A try that succeeds sets every key;
    a last one that fails names what all the tries changed."""
    check_top_level_keys(state_dict, loading=True)
    earlier = NO_CHANGES
    for attempt in range(1, LOAD_TRIES + 1):
        reader = DcpStorageReader(
            storage,
            workers=options.workers,
            verify=options.verify,
            safe_globals=options.safe_globals,
            trusted=options.trusted,
            progress=progress,
            earlier=earlier,
        )
        try:
            return _load_once(state_dict, reader, options)
        except CheckpointError as e:
            annotated = "loaded_keys" in vars(e)  # failed in read_data: it says what all tries changed
            if not vars(e).get(REPLACED):
                if earlier != NO_CHANGES and not annotated:
                    raise LoadProgress((), earlier).annotate(e, storage.uri) from e
                raise
            if attempt == LOAD_TRIES:
                again = f"replaced by other saves during each of the {LOAD_TRIES} tries of this load"
                error = LoadProgress((), earlier).annotate(e, storage.uri) if not annotated else e
                out = type(error)(f"{error} ({storage.uri} was {again})")
                vars(out).update(vars(error))
                raise out from e
            log.debug("%s was replaced while being loaded (%s); loading it again", storage.uri, e)
            if annotated:
                earlier = changes_of(e)
    raise AssertionError("unreachable")  # the loop returns or raises


def _load_once(state_dict: dict[str, Any], reader: DcpStorageReader, options: LoadOptions) -> LoadStats:
    """One try of :func:`load_state_dict`."""
    t0 = time.perf_counter()
    no_dist = not is_distributed()
    try:
        if not no_dist:
            # One commit read per job; a failure of it raises alike on every rank, before any other collective.
            reader.share_commit(options.process_group)
        reader.check_destination(state_dict)
    except RETRIED as e:
        if no_dist and reader.replaced():  # shared: the coordinator decided, for every rank
            vars(e)[REPLACED] = True
        raise
    t_read = time.perf_counter()
    try:
        with ignoring(NO_DIST_WARNING) if no_dist else contextlib.nullcontext():
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=options.planner,
                process_group=options.process_group,
                no_dist=no_dist,
            )
    except CheckpointException as e:
        raise load_error(e, reader.storage.uri) from e
    except RuntimeError as e:
        if no_dist:
            raise
        # DCP's own collectives between the steps: every failure inside a
        # step reaches us as a CheckpointException, so this is a peer gone.
        raise PeerFailed(
            f"load from {reader.storage.uri} failed: a collective among the ranks failed "
            f"(was a rank lost?): {describe_failure(e)}"
        ) from e
    return LoadStats(bytes_read=reader.bytes_read, metadata_s=t_read - t0, read_s=time.perf_counter() - t_read)
