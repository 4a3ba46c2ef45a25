"""One way to summarise a failed save or load, on every path.

DCP reports a failure on any rank as a ``CheckpointException`` mapping rank
-> exception (a ``BaseException``, raised on every rank); NVRx raises the same
type from its finalize; our own code raises :class:`~dcpstore.CheckpointError`
subclasses; a backend may raise anything. The sync and async saves, the NVRx
engine (which also broadcasts a failure to the other ranks as text) and the
load all turn these into one-line messages here, so every path names the
failed ranks and causes the same way, and never a secret (messages pass
through :func:`~dcpstore.storage.redact` for URIs and
:func:`~dcpstore._impl.storage.secrets.scrub` for credentials: an endpoint that
echoes request headers puts them in a library's exception text).
"""

from __future__ import annotations

from dcpstore._impl.storage import redact
from dcpstore._impl.storage.secrets import scrub
from dcpstore._impl.util.errors import CheckpointError, CheckpointExists, LoadError, PeerFailed, SaveError

#: Failed ranks named in one message; the rest are counted.
RANKS_SHOWN = 4


def rank_failures(e: BaseException) -> list[tuple[int, BaseException]]:
    """``(rank, exception)`` of every failed rank, by rank, if ``e`` is DCP's
    ``CheckpointException`` (duck-typed: NVRx raises torch's own); else []."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [(rank, exc[0] if isinstance(exc, tuple) else exc) for rank, exc in sorted(failures.items())]


def root_cause(e: BaseException) -> BaseException:
    """The first failed rank's exception for a ``CheckpointException``, past
    ranks that only stopped because another failed
    (:class:`~dcpstore._impl.util.errors.PeerFailed`); else ``e``."""
    causes = [cause for _, cause in rank_failures(e)]
    own = [cause for cause in causes if not isinstance(cause, PeerFailed)]
    return (own or causes or [e])[0]


def describe_failure(e: BaseException) -> str:
    """One line naming what failed: ``rank R: Type: message; ...`` for a
    ``CheckpointException`` (the first :data:`RANKS_SHOWN` ranks), else
    ``Type: message``."""
    ranks = rank_failures(e)
    if not ranks:
        return _describe(e)
    parts = [f"rank {rank}: {_describe(cause)}" for rank, cause in ranks[:RANKS_SHOWN]]
    if len(ranks) > RANKS_SHOWN:
        parts.append(f"and {len(ranks) - RANKS_SHOWN} more ranks")
    return "; ".join(parts)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {scrub(redact(str(e)))}"


def save_error(e: BaseException, uri: str, what: str = "save") -> SaveError:
    """The :class:`SaveError` a failed save raises (chain it ``from e``).

    A :class:`SaveError` keeps its message (it names the URI already), and a
    refused overwrite stays a :class:`CheckpointExists` on every path; any
    other failure becomes ``"{what} to {uri} failed: ..."``.
    """
    cause = root_cause(e)
    if isinstance(cause, CheckpointExists):
        return CheckpointExists(str(cause))
    if isinstance(e, SaveError):
        return SaveError(str(e))
    if isinstance(e, CheckpointError) and not rank_failures(e):
        return SaveError(f"{what} to {uri} failed: {e}")
    return SaveError(f"{what} to {uri} failed: {describe_failure(e)}")


def load_error(e: BaseException, uri: str) -> CheckpointError:
    """The error a failed load raises (chain it ``from e``): the first failed
    rank's own :class:`CheckpointError` type and message where there is one
    (a damaged file is :class:`~dcpstore.CheckpointCorrupt` on every path),
    else a :class:`LoadError` naming the URI and the failed ranks."""
    cause = root_cause(e)
    if isinstance(cause, CheckpointError):
        error = type(cause)(str(cause))
        vars(error).update(vars(cause))  # e.g. which keys a failed read changed
        return error
    return LoadError(f"load from {uri} failed: {describe_failure(e)}")
