"""How a save or a load runs, as one value: :class:`SaveOptions`, :class:`LoadOptions`.

Each option is passed one way per entry point. :func:`dcpstore.save` and
:func:`dcpstore.load` take each as a keyword and build the value from them;
every other entry point takes the value whole, as ``options=``:
:meth:`dcpstore.AsyncSaver.save`, :class:`dcpstore.CheckpointManager` (which
keeps one for all its saves), the drop-in :class:`dcpstore.StorageWriter` /
:class:`~dcpstore.StorageReader` and
:class:`dcpstore.adapters.megatron.CheckpointConfig`; each takes as keywords
only what is its own (retention, tiers, a manager's mode) and the names of
the framework it stands in for (``FileSystemWriter``'s, Bridge's fields:
:data:`dcpstore._impl.util.keyword_hints.FRAMEWORK_NAMES`). Every layer below
receives the one object, so no layer repeats the keyword list, and every
value is checked once, here, when the object is built: a
:class:`SaveOptions` that exists is valid. Where the
bytes go is one value too, :class:`~dcpstore.StorageOptions` (the client,
MSC or native, and its tuning).

Where keywords meet an ``options=`` is :mod:`dcpstore._impl.values.keywords`.

What a value object cannot know -- whether an engine can run here (NVRx
installed), and whether it can write a given backend -- is asked of the
engine (:func:`dcpstore._impl.engines.selection.engine_problem`), again by every
layer that needs it, so a configuration can never allow what the writer
refuses.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from dcpstore._impl.storage import StorageOptions, check_spread_prefixes, check_storage_options
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import InvalidArgument


@dataclass(frozen=True)
class EngineSpec:
    """One row of the engine registry: a name ``engine=`` takes and the
    engine behind it (:mod:`dcpstore._impl.engines.engine` imports it and
    states what an engine is)."""

    name: str
    #: ``"module:Class"`` of its engine.
    target: str
    summary: str


#: The engines of background saves, by name: the one table (``engine=``,
#: the CLI and the tests read it). A new engine is a module and a row here.
ENGINES: Mapping[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "native", "dcpstore._impl.engines.native:NativeEngine", "dcpstore's own writer on a background thread"
        ),
        EngineSpec(
            "nvrx", "dcpstore._impl.engines.nvrx:NvrxEngine", "NVIDIA Resiliency Extension's planner and file writer"
        ),
        EngineSpec(
            "process",
            "dcpstore._impl.engines.process:ProcessEngine",
            "dcpstore's own writer in a checkpoint process per rank",
        ),
    )
}
#: ``engine="auto"``: the engine measured to cost training least for the
#: storage and the host (:mod:`dcpstore._impl.engines.selection`).
AUTO = "auto"
#: Every value ``engine=`` takes.
ENGINE_CHOICES = (AUTO, *ENGINES)

#: Why a planner with DCP's save-plan cache switched on
#: (``DefaultSavePlanner(enable_plan_caching=True)``, what Megatron's
#: ``ckpt_assume_constant_structure`` asks for) is refused.
PLAN_CACHING_WHY = (
    "DCP's save-plan cache replays the first save's plan, and dcpstore's writer puts a per-save token in "
    "every plan (so that a concurrent writer to the same URI is detected); a replayed token looks like such a writer"
)


class InvalidOption(InvalidArgument):
    """A bad value of one option, the option (``option``, its field name)
    apart from what is wrong with it (``why``), so that an entry point that
    takes the option under another keyword (the drop-ins' ``thread_count``
    for ``workers``) names it as its caller spelt it
    (:func:`dcpstore._impl.values.keywords.resolve_options`)."""

    def __init__(self, option: str, why: str) -> None:
        super().__init__(f"{option} {why}")
        self.option, self.why = option, why

    def __reduce__(self) -> tuple[Any, ...]:  # raised in workers too: pickles with both parts
        return (type(self), (self.option, self.why))


def check_workers(workers: int | None, default: int, name: str = "workers") -> int:
    """Validate a ``workers`` argument (``None`` means ``default``), named ``name``."""
    if workers is None:
        return default
    return check_positive(name, workers)


def check_positive(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (bools refused), else InvalidOption naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidOption(name, f"must be a positive int, got {value!r}")
    return value


def uses_plan_caching(planner: Any) -> bool:
    """Whether ``planner`` is a DCP planner with its plan cache switched on."""
    return bool(getattr(planner, "_enable_plan_caching", False))


@dataclass(frozen=True)
class OptionProblem:
    """Why one option of a save is not accepted; ``option`` is the keyword of
    :func:`dcpstore.save` at fault and ``why`` what is wrong with its value,
    so that a layer mapping its own field names onto save's options can name
    its field."""

    option: str
    why: str

    @property
    def message(self) -> str:
        return f"{self.option} {self.why}"

    def error(self) -> InvalidOption:
        return InvalidOption(self.option, self.why)


def _planner_problem(planner: Any, kind: type) -> str | None:
    """Why ``planner`` is not a DCP planner of ``kind`` (``None``: it is, or
    is ``None``): checked here, not by DCP in the middle of a save."""
    if planner is None or isinstance(planner, kind):
        return None
    if isinstance(planner, type) and issubclass(planner, kind):
        return f"must be an instance of a {kind.__name__}, got the class {planner.__name__} (call it)"
    got = repr(planner) if isinstance(planner, (str, int, float)) else f"a {type(planner).__name__}"
    return f"must be None or a DCP {kind.__name__}, got {got}"


def save_option_problems(
    *,
    async_: Any = False,
    engine: Any = "auto",
    workers: Any = None,
    planner: Any = None,
    max_in_flight: Any = None,
    overwrite: Any = True,
) -> list[OptionProblem]:
    """Everything wrong with these save options (empty: fine)."""
    problems: list[OptionProblem] = []
    if (why := _planner_problem(planner, SavePlanner)) is not None:
        problems.append(OptionProblem("planner", why))
    elif uses_plan_caching(planner):
        problems.append(OptionProblem("planner", f"with plan caching cannot be used: {PLAN_CACHING_WHY}"))
    if not isinstance(async_, bool):
        problems.append(OptionProblem("async_", f"must be a bool, got {async_!r}"))
    if not isinstance(overwrite, bool):
        problems.append(OptionProblem("overwrite", f"must be a bool, got {overwrite!r}"))
    if not isinstance(engine, str) or engine not in ENGINE_CHOICES:
        problems.append(OptionProblem("engine", f"must be one of {', '.join(ENGINE_CHOICES)}, got {engine!r}"))
    for name, value in (("workers", workers), ("max_in_flight", max_in_flight)):
        try:
            check_workers(value, 1, name)
        except InvalidOption as e:
            problems.append(OptionProblem(e.option, e.why))
    return problems


def check_safe_globals(safe_globals: Any) -> tuple[Any, ...]:
    """Validate :func:`dcpstore.load`'s ``safe_globals``: classes or
    functions, or ``(obj, "module.Name")`` pairs as ``torch.serialization``
    takes them; ``None`` is none. Returns them as a tuple."""
    if safe_globals is None:
        return ()
    if isinstance(safe_globals, (str, bytes)) or not isinstance(safe_globals, Iterable):
        raise InvalidArgument(f"safe_globals must be a list of classes or functions, got {safe_globals!r}")
    entries = tuple(safe_globals)
    for entry in entries:
        pair = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str)
        named = all(isinstance(getattr(entry, attr, None), str) for attr in ("__module__", "__qualname__"))
        if not (pair or named):
            raise InvalidArgument(
                f"safe_globals entries must be classes or functions (or (obj, 'module.Name') pairs), got {entry!r}"
            )
    return entries


def check_trusted(trusted: Any) -> bool:
    """Validate :func:`dcpstore.load`'s ``trusted`` (a bool, never a truthy value)."""
    if not isinstance(trusted, bool):
        raise InvalidArgument(f"trusted must be a bool, got {trusted!r}")
    return trusted


def _check_process_group(process_group: Any) -> None:
    if process_group is not None and not is_distributed():
        raise InvalidArgument("process_group was given but torch.distributed is not initialised")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOption(name, f"must be a bool, got {value!r}")


def rank_in(process_group: dist.ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world size)`` in ``process_group`` (``None``: the default
    group), or ``None`` without torch.distributed."""
    if not is_distributed():
        return None
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def rank_label(process_group: dist.ProcessGroup | None) -> str:
    """``"rank 1/4: "`` under torch.distributed, else ``""`` (log lines)."""
    where = rank_in(process_group)
    return f"rank {where[0]}/{where[1]}: " if where else ""


def shows_progress(progress: bool, process_group: dist.ProcessGroup | None) -> bool:
    """Whether this process draws the progress bar: one rank only (rank 0 of
    the group), as bars of several processes would overwrite each other."""
    where = rank_in(process_group)
    return progress and (where is None or where[0] == 0)


class _Where:
    """What both options have: where the bytes are (``storage_options``,
    whose ``enable_msc`` is read here too, as the shortcut keyword names it)."""

    storage_options: StorageOptions | None

    @property
    def enable_msc(self) -> bool:
        """Whether the storage is reached through MSC (``storage_options.enable_msc``)."""
        return self.storage_options is not None and self.storage_options.enable_msc


@dataclass(frozen=True)
class LoadOptions(_Where):
    """How a load reads: every option of :func:`dcpstore.load` as one value,
    validated when it is built (a bad value is an
    :class:`~dcpstore.InvalidArgument` naming it). Pass it whole as
    ``options=`` to :class:`dcpstore.StorageReader` (:func:`dcpstore.load`
    takes each option as a keyword).

    Attributes:
        workers: reader threads per rank (``None``: the backend's default).
        storage_options: where the bytes are: the client (``enable_msc``)
            and its tuning (:class:`~dcpstore.StorageOptions`).
        process_group: the ranks that load together (default: all).
        planner: a DCP ``LoadPlanner`` (default: DCP's own).
        verify: check every item's CRC32C and every file's size.
        progress: a progress bar of this rank's bytes on stderr (rank 0).
        safe_globals: classes a non-tensor item may hold beyond the
            allowlist, kept as a tuple.
        trusted: unpickle anything (only for checkpoints trusted like code).
    """

    workers: int | None = None
    storage_options: StorageOptions | None = None
    process_group: dist.ProcessGroup | None = None
    planner: LoadPlanner | None = None
    verify: bool = True
    progress: bool = False
    safe_globals: Sequence[Any] = ()
    trusted: bool = False

    def __post_init__(self) -> None:
        check_workers(self.workers, 1)
        check_storage_options(self.storage_options)
        if (why := _planner_problem(self.planner, LoadPlanner)) is not None:
            raise InvalidOption("planner", why)
        _check_bool("verify", self.verify)
        _check_bool("progress", self.progress)
        _check_process_group(self.process_group)
        object.__setattr__(self, "safe_globals", check_safe_globals(self.safe_globals))  # frozen: set once, here
        check_trusted(self.trusted)


#: The form of a save id (:mod:`dcpstore._impl.format.layout` names files by it).
_SAVE_ID = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class SaveOptions(_Where):
    """How a save runs: every option of :func:`dcpstore.save` as one value,
    validated when it is built (a bad value is an
    :class:`~dcpstore.InvalidArgument` naming it) and handed down whole.
    Pass it as ``options=`` to :meth:`dcpstore.AsyncSaver.save`,
    :class:`dcpstore.CheckpointManager`, :class:`dcpstore.StorageWriter` or
    :class:`~dcpstore.adapters.megatron.CheckpointConfig`
    (:func:`dcpstore.save` takes each option as a keyword:
    ``save(state, uri, **options.as_kwargs())``)::

        options = dcpstore.SaveOptions(async_=True, engine="native", spread_prefixes=16,
                                       storage_options=dcpstore.StorageOptions(enable_msc=True))
        mgr = dcpstore.CheckpointManager("s3://bucket/run1", keep=3, options=options)

    Attributes:
        async_: save in the background once the state is staged.
        engine: what runs the background part (``"auto"``, ``"native"``,
            ``"nvrx"``, ``"process"``; :data:`ENGINES`).
        workers: writer threads per rank (``None``: the backend's default).
        storage_options: where the bytes go: the client (``enable_msc``)
            and its tuning (:class:`~dcpstore.StorageOptions`).
        process_group: the ranks that save together (default: all).
        planner: a DCP ``SavePlanner`` (default: DCP's own).
        max_in_flight: async saves pending at once (``None``: the saver's
            own limit, 1 for :func:`dcpstore.save`'s per-process saver).
        overwrite: ``False`` refuses a URI that holds a committed
            checkpoint (:class:`~dcpstore.CheckpointExists`).
        progress: a progress bar of this rank's bytes on stderr (rank 0).
        spread_prefixes: spread the ranks' data files over this many key
            prefixes (rank ``r`` writes under ``p{r mod N, hex digits
            reversed}/``; :mod:`dcpstore._impl.format.layout`), so that many ranks
            writing one checkpoint do not all hit one object-store
            partition's request limit (S3: about 3,500 PUT/s per prefix).
            ``"auto"`` (default): as many as the number of ranks needs, a
            power of two leaving at most 16 ranks on each prefix
            (:func:`~dcpstore._impl.storage.storage_options.auto_spread_prefixes`:
            1, stock DCP's flat layout, up to 16 ranks; 1,024 at 16,384);
            an int: that many (1: always the flat layout). Loads read
            either layout.
        save_id: the save id the commit records, 16 hex digits, for a
            caller that must know it before the save starts (a tiered
            manager with node-local directories); ``None``: a fresh one.
    """

    async_: bool = False
    engine: str = "auto"
    workers: int | None = None
    storage_options: StorageOptions | None = None
    process_group: dist.ProcessGroup | None = None
    planner: SavePlanner | None = None
    max_in_flight: int | None = None
    overwrite: bool = True
    progress: bool = False
    spread_prefixes: int | str = "auto"
    save_id: str | None = None

    def __post_init__(self) -> None:
        _check_bool("progress", self.progress)
        check_storage_options(self.storage_options)
        check_spread_prefixes(self.spread_prefixes)
        if self.save_id is not None and not (isinstance(self.save_id, str) and _SAVE_ID.fullmatch(self.save_id)):
            raise InvalidArgument(f"save_id must be None or 16 lowercase hex digits, got {self.save_id!r}")
        for problem in save_option_problems(
            async_=self.async_,
            engine=self.engine,
            workers=self.workers,
            planner=self.planner,
            max_in_flight=self.max_in_flight,
            overwrite=self.overwrite,
        ):
            raise problem.error()
        _check_process_group(self.process_group)

    @property
    def runs_in_background(self) -> bool:
        """Whether the save runs on an :class:`~dcpstore.AsyncSaver`: every
        async save, and a sync save that names an engine other than the
        native one (which then waits for it)."""
        return self.async_ or self.engine not in (AUTO, "native")

    def for_load(self, *, safe_globals: Sequence[Any] = (), trusted: bool = False) -> LoadOptions:
        """The options a load of what these options saved reads with.

        Args:
            safe_globals, trusted: as :class:`LoadOptions` takes them.

        Returns:
            The :class:`LoadOptions` with these options' I/O part.
        """
        return LoadOptions(
            workers=self.workers,
            storage_options=self.storage_options,
            process_group=self.process_group,
            progress=self.progress,
            safe_globals=safe_globals,
            trusted=trusted,
        )

    def as_kwargs(self) -> dict[str, Any]:
        """These options as :func:`dcpstore.save`'s keyword arguments (all
        but ``save_id``, which only a manager sets, per save).

        Returns:
            The keyword arguments, ``save(state, uri, **kwargs)``.
        """
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "save_id"}
        kwargs["enable_msc"] = self.enable_msc
        return kwargs


#: Each field's default, and ``enable_msc``'s (``storage_options.enable_msc``).
OPTION_DEFAULTS: dict[type, dict[str, Any]] = {
    kind: {"enable_msc": False, **{f.name: f.default for f in fields(kind)}} for kind in (SaveOptions, LoadOptions)
}
