"""What writes leave behind: in-progress writes (:class:`IncompleteWrite`,
listed and removed by ``dcpstore gc`` through
:meth:`~dcpstore._impl.storage.base.Storage.incomplete_writes`) and clean-ups a
failed write could not do (:class:`Unfinished`, recorded with
:meth:`~dcpstore._impl.storage.base.Storage.leave_unfinished` for the writer's
owner to try again).

Imports nothing of dcpstore.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class IncompleteWrite:
    """A write in progress, or what an interrupted one left: a temporary
    file, an open multipart upload (:meth:`Storage.incomplete_writes`)."""

    #: Relative to the root: a temporary file's own path, an upload's object path.
    path: str
    #: Seconds since it was last written (temporary files) or started
    #: (uploads), as listed; None: the backend does not say.
    age_s: float | None
    #: The backend's own name for it where the path is not one (S3: the
    #: upload id: a later upload of the same key is another write).
    key: str = ""


@dataclass(frozen=True)
class Unfinished:
    """A clean-up that a failed write could not do (the storage did not
    answer): what it is, for messages, and how to try it again (raises a
    :class:`~dcpstore._impl.util.errors.CheckpointError` while it still fails)."""

    what: str
    retry: Callable[[], object]
