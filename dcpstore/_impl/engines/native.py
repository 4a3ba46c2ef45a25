"""The native engine: DCP's own save with dcpstore's writer, on the saver's thread.

The same save the sync path runs (:func:`dcpstore._impl.dcp.writer.save_state_dict`),
here on an :class:`~dcpstore.AsyncSaver`'s background thread with a staged
snapshot and the saver's background group. Every backend; nothing kept
between saves.
"""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

from dcpstore._impl.dcp.writer import save_state_dict
from dcpstore._impl.engines.engine import SaveJob
from dcpstore._impl.values.results import SaveStats


class NativeEngine:
    """:class:`~dcpstore._impl.engines.engine.Engine` ``"native"``."""

    name: ClassVar[str] = "native"
    shared_staging: ClassVar[bool] = False

    def __init__(self, collective_timeout: timedelta | None) -> None:
        del collective_timeout  # its collectives run on the saver's background group

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    @classmethod
    def target_problem(cls, backend: str, uri: str) -> str | None:
        return None

    def save(self, job: SaveJob) -> SaveStats:
        return save_state_dict(
            job.staged.state_dict,
            job.storage,
            job.options,
            workers=job.workers,
            process_group=job.group,
            progress=job.progress,
            commit_files=job.commit_files,
        )

    def close(self) -> None:
        pass
