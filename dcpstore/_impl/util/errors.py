"""The dcpstore exception family.

Every error dcpstore raises on purpose derives from :class:`CheckpointError`
(an ``Exception``), and where a built-in fits too it is also that built-in, so
``except FileNotFoundError`` keeps working. Backend errors (botocore, OSError,
DCP's ``CheckpointException`` -- a ``BaseException``) are always chained with
``raise ... from e`` so the cause stays visible.

Messages name the URI or argument and the cause. They never contain secrets:
URIs pass through :func:`dcpstore._impl.storage.uri.redact` first.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every dcpstore error."""


class InvalidArgument(CheckpointError, ValueError):
    """An argument to a dcpstore call is out of range or of the wrong kind."""


class InvalidURI(InvalidArgument):
    """A URI that dcpstore cannot parse or has no backend for."""


class BackendUnavailable(CheckpointError, ImportError):
    """The backend for a URI needs an optional dependency that is not installed."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the URI."""


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint failed verification (size, checksum, missing file)."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint holds a class or function dcpstore does not unpickle
    without an explicit opt-in (``safe_globals=[...]`` or ``trusted=True``);
    the message names the file or item and the class. Also a file that
    resolves outside the checkpoint directory (a symbolic link out of it),
    which is never read, opt-in or not."""


class StorageError(CheckpointError, OSError):
    """A storage backend operation failed (after its retries)."""


class StorageNotFound(StorageError, FileNotFoundError):
    """An object, file, directory or bucket does not exist."""


class ObjectTooLarge(StorageError):
    """A whole-object read was refused, before reading, because the object
    holds more than the caller's ``limit`` bytes (``size``: what it holds)."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class StoragePermissionError(StorageError, PermissionError):
    """The backend refused the operation: credentials or permissions."""


class SaveError(CheckpointError):
    """A save failed; nothing was committed."""


class CheckpointExists(SaveError, FileExistsError):
    """A save with ``overwrite=False`` found a committed checkpoint at its URI;
    nothing was written."""


class LoadError(CheckpointError):
    """A load failed."""


class PeerFailed(LoadError):
    """This rank's load stopped because another rank failed (while reading
    items it reads for the others: :mod:`dcpstore._impl.dcp.shared_reads`)
    or was lost; a failed rank's own error says why."""


class StateDictMismatch(LoadError):
    """A strict load found keys the checkpoint and the model do not share.

    ``report`` (a :class:`dcpstore.adapters.fsdp.LoadReport`) lists the
    missing, unexpected and mismatched keys; nothing was loaded.
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class EngineFallbackWarning(UserWarning):
    """``engine="auto"`` could not run the engine it prefers and chose the
    native one; the message says why."""
