"""Built-in and library exceptions mapped to the dcpstore family
(:func:`map_os_error`); :func:`library_text` is where every text from a
library or server passes before it enters one of our messages."""

from __future__ import annotations

import errno

from dcpstore._impl.storage.secrets import scrub, scrub_exception
from dcpstore._impl.storage.uri import redact
from dcpstore._impl.util.errors import CheckpointError, StorageError, StorageNotFound, StoragePermissionError


def library_text(text: str) -> str:
    """Text from a storage library or server (an exception's message, an
    S3 error body) made fit for our messages. Every such text passes here,
    so that this is the one place where it is cleaned (URIs redacted,
    credentials scrubbed: an endpoint may echo them back)."""
    return scrub(redact(str(text))).strip()


def library_detail(e: BaseException) -> str:
    """A library exception, as error messages quote it (see :func:`library_text`).

    An ``OSError`` with an errno reads ``No space left on device (ENOSPC)``;
    anything else ``TypeName: its text``.
    """
    if isinstance(e, OSError) and e.strerror and e.errno:
        code = errno.errorcode.get(e.errno, "")
        return e.strerror + (f" ({code})" if code else "")
    scrub_exception(e)  # quoted here, and chained to ours by the caller
    text = library_text(str(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def map_os_error(e: BaseException, what: str, *, denied: str = "permission denied") -> CheckpointError:
    """The dcpstore exception for a built-in error (``OSError`` and kin, which
    most storage libraries raise), ``what`` naming the operation and URI."""
    if isinstance(e, FileNotFoundError):
        return StorageNotFound(f"{what}: no such file or directory")
    if isinstance(e, NotADirectoryError):  # a path component is a file
        return StorageNotFound(f"{what}: a parent is not a directory")
    if isinstance(e, PermissionError):
        return StoragePermissionError(f"{what}: {denied}")
    return StorageError(f"{what}: {library_detail(e)}")
