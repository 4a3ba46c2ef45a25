"""What an engine is (:class:`Engine`), and the one way to get one by name.

An engine runs the background half of a save -- plan, write, commit -- on
a snapshot the saver has already staged. Which engines exist is the table
:data:`dcpstore._impl.values.options.ENGINES` (name -> ``"module:Class"``): it sits with
the options because :class:`~dcpstore._impl.values.options.SaveOptions` validates
``engine=`` against it, below every engine; :func:`engine_class` imports
the class a row names. A new engine is one module and one row there.

Each :class:`~dcpstore.AsyncSaver` makes one instance per engine it runs
(:meth:`Engine.__init__`), for whatever the engine keeps between saves
(NVRx's plan caches, the process engine's checkpoint processes), and
closes it with the saver. What the choice of engine decides before a save
starts -- whether it can run here, whether it can write the storage, what
``engine="auto"`` picks -- is :mod:`.selection`'s, from the class alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import ClassVar, Protocol, cast

import torch.distributed as dist

from dcpstore._impl.engines.staging import StagedState
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.progress import Progress
from dcpstore._impl.values.options import ENGINE_CHOICES, ENGINES, SaveOptions
from dcpstore._impl.values.results import SaveStats


@dataclass
class SaveJob:
    """One background save, as the saver hands it to an engine."""

    #: The snapshot (host memory; shared memory where the engine asked for it).
    staged: StagedState
    storage: Storage
    #: The saver's background group over the save's ranks (None: one
    #: process without torch.distributed).
    group: dist.ProcessGroup | None
    workers: int
    options: SaveOptions
    #: This rank's progress bar (the engine reports the bytes it writes).
    progress: Progress
    #: Small files of the caller's that the commit carries (the coordinator's count).
    commit_files: Mapping[str, bytes] = field(default_factory=dict)


class Engine(Protocol):
    """Runs the background half of async saves; one instance per saver."""

    #: Its row's name in :data:`dcpstore._impl.values.options.ENGINES`.
    name: ClassVar[str]
    #: Whether the saver stages for it in memory that another process can
    #: map (the process engine's); else in this process's own memory.
    shared_staging: ClassVar[bool]

    def __init__(self, collective_timeout: timedelta | None) -> None:
        """``collective_timeout``: the saver's, for collectives the engine
        runs on groups of its own."""

    @classmethod
    def unavailable(cls) -> str | None:
        """Why it cannot run in this process (a package missing, with what
        to install); None: it can."""

    @classmethod
    def target_problem(cls, backend: str, uri: str) -> str | None:
        """Why it cannot write ``uri`` through the backend named ``backend``
        (a name of :data:`dcpstore.storage.BACKENDS`); None: it can."""

    def save(self, job: SaveJob) -> SaveStats:
        """Plan, write and commit ``job`` (on the saver's background thread;
        every rank calls it, in save order). Raises what failed, on every
        rank when any rank failed."""

    def close(self) -> None:
        """Release what it keeps between saves (the saver is closing)."""


def engine_class(name: str) -> type[Engine]:
    """The engine class of the row ``name`` of :data:`~dcpstore._impl.values.options.ENGINES`.

    Raises:
        InvalidArgument: ``name`` is no engine's (``"auto"`` is a choice
            among them: :func:`dcpstore._impl.engines.selection.select_engine`).
    """
    spec = ENGINES.get(name)
    if spec is None:
        raise InvalidArgument(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got {name!r}")
    module, _, attr = spec.target.partition(":")
    return cast("type[Engine]", getattr(importlib.import_module(module), attr))
