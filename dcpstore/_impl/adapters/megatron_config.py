"""Megatron-Bridge's checkpoint fields mapped onto dcpstore: ``CheckpointConfig``.

State-dict formats (:data:`FORMATS`, Megatron-Bridge's ``ckpt_format``
values, ``torch_dist`` and ``fsdp_dtensor``): :mod:`.megatron_formats`.

``CheckpointConfig``. Megatron-Bridge's fields under Bridge 0.6.2's (and
megatron-core 0.19.2's) names (:data:`BRIDGE_FIELDS`, their rows in
:data:`dcpstore._impl.util.keyword_hints.FRAMEWORK_NAMES`: ``save``, ``load``,
``save_interval``, ``async_save``, ``ckpt_format``, ``dist_ckpt_workers``,
``most_recent_k``, ``ckpt_assume_constant_structure``, ``ckpt_step``), plus
dcpstore's own (:data:`DCPSTORE_FIELDS`: ``layout``, and ``options``, the
:class:`~dcpstore.SaveOptions` every save runs with, passed whole: the
engine, and where the bytes go -- MSC, in Megatron the process-global
``--enable-msc``, is its ``storage_options.enable_msc``). Bridge's
``async_save`` and ``dist_ckpt_workers`` are the options' ``async_`` and
``workers``, under Bridge's names. :meth:`CheckpointConfig.from_bridge`
builds one from a Bridge (or megatron-core) ``CheckpointConfig``, reading
Bridge's fields by name, MSC from Megatron's ``MultiStorageClientFeature``
and the layout Bridge writes (``iter_0000100/`` and
``latest_checkpointed_iteration.txt``). The config is validated once, in
``__post_init__``, without opening any storage, and keeps **no rules of its
own** about which combinations work. It asks the tables the writers ask:

===================================  =========================================
field                                validated by
===================================  =========================================
``ckpt_format``                      :data:`FORMATS`
``async_save``,                      :func:`dcpstore._impl.values.options.save_option_problems`
``dist_ckpt_workers``, ``options``   (what :func:`dcpstore.save` checks) and, for
                                     the engine x ``save``, the NVRx engine's own
                                     backend check (NVRx writes POSIX/MSC only)
``save``, ``load``, MSC              URI parsing + the backend registry, as
                                     ``open_storage`` resolves them
``layout``                           the manager's step layouts
                                     (:data:`dcpstore._impl.manager.LAYOUTS`)
===================================  =========================================

So a format can never be refused async while the writer would save it
(the seed PR's bug: async allowed only for ``torch_dist``), and an engine or
worker count the writer rejects fails here, naming the field, instead of at
the first save hours into a run.

``ckpt_assume_constant_structure`` is accepted either way and never needed
for a correct save: every save that plans through NVRx (the NVRx engine,
and :class:`FileSystemWriterAsync` under Bridge) reuses NVRx's plans while
the structure is unchanged and checks each save against them, and the
native engine plans every save (DCP's own plan cache would replay the
per-save claim token the native writer puts in its plans:
:data:`dcpstore._impl.values.options.PLAN_CACHING_WHY`; ``dcpstore.save`` refuses a
caching planner for that reason, :func:`plan_caching_supported`).

Mapping: :meth:`CheckpointConfig.save_options` is the one
:class:`~dcpstore.SaveOptions` the config stands for;
:meth:`~CheckpointConfig.manager` builds the
:class:`~dcpstore.CheckpointManager` for ``save`` with it (``most_recent_k``
-> ``keep``, ``-1`` keeps all; ``layout``); :meth:`~CheckpointConfig.save_kwargs` /
:meth:`~CheckpointConfig.load_kwargs` are the same as keyword arguments for
:func:`dcpstore.save` / :func:`dcpstore.load`.

:class:`FileSystemWriterAsync` (:mod:`.megatron_async`): the drop-in for
NVRx's writer of Bridge's async ``fsdp_dtensor`` saves;
:func:`install_in_bridge` (:mod:`.megatron_bridge`) puts it, and dcpstore's
sync writer and reader, beneath Bridge in one call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn

import torch.distributed as dist

from dcpstore._impl.adapters.megatron_bridge import megatron_msc_enabled
from dcpstore._impl.adapters.megatron_formats import FORMATS
from dcpstore._impl.engines.selection import engine_problem
from dcpstore._impl.manager import LAYOUTS, CheckpointManager, check_step
from dcpstore._impl.manager.roots import coordinator_rank, group_rank
from dcpstore._impl.storage import StorageOptions, backend_class, backend_name, parse_uri, with_msc
from dcpstore._impl.util.distributed import is_distributed
from dcpstore._impl.util.errors import CheckpointError, CheckpointNotFound, InvalidArgument
from dcpstore._impl.util.keyword_hints import FRAMEWORK_NAMES, foreign_names, hint_keywords, hint_keywords_with
from dcpstore._impl.values.keywords import pass_whole, resolve_options
from dcpstore._impl.values.options import OPTION_DEFAULTS, SaveOptions, save_option_problems

#: The options Bridge's fields stand for (option -> Bridge's field:
#: ``FRAMEWORK_NAMES``' rows), and the fields' defaults.
_BRIDGE_NAME = {
    ours: theirs for theirs, ours in foreign_names("CheckpointConfig").items() if ours in OPTION_DEFAULTS[SaveOptions]
}
_BRIDGE_DEFAULTS = {"async_save": False, "dist_ckpt_workers": None}


def plan_caching_supported() -> bool:
    """Whether dcpstore's native writer can run from DCP's save-plan cache
    (``DefaultSavePlanner(enable_plan_caching=True)``): no, it would replay
    the per-save claim token (:data:`dcpstore._impl.values.options.PLAN_CACHING_WHY`);
    ``dcpstore.save`` refuses such planners. NVRx's plan cache is another
    matter: see ``ckpt_assume_constant_structure`` in the module docstring."""
    return False


#: The fields of :class:`CheckpointConfig` that are Megatron-Bridge's (0.6.2)
#: and megatron-core's (0.19.2), under their names and with their meaning
#: (their rows in ``FRAMEWORK_NAMES``).
BRIDGE_FIELDS = tuple(name for name, f in FRAMEWORK_NAMES.items() if "CheckpointConfig" in f.taken_by)
#: dcpstore's own fields (Bridge has none of these).
DCPSTORE_FIELDS = ("options", "layout")


@dataclass
class CheckpointConfig:
    """Checkpointing options: Megatron-Bridge's under its names
    (:data:`BRIDGE_FIELDS`) and dcpstore's own (:data:`DCPSTORE_FIELDS`);
    see the module docstring for how each maps onto dcpstore, and
    :meth:`from_bridge` to build one from Bridge's config.

    Args:
        save, load, save_interval, async_save, ckpt_format,
            dist_ckpt_workers, most_recent_k,
            ckpt_assume_constant_structure, ckpt_step, layout, options:
            the fields below, each with its meaning in its comment. The
            engine and MSC are the options': ``options=SaveOptions(engine=...,
            storage_options=StorageOptions(enable_msc=...))``.

    Raises:
        InvalidArgument: a field the writers would refuse, named as
            ``CheckpointConfig.<field>`` with the reason; ``async_save`` or
            ``dist_ckpt_workers`` disagreeing with ``options``.
    """

    #: Root to save step checkpoints under (``layout``'s step directories); ``None``: no saving.
    save: str | None = None
    #: Root to resume from; ``None``: do not resume.
    load: str | None = None
    #: Save every this many steps; ``None``: only when asked.
    save_interval: int | None = None
    async_save: bool = False
    #: ``torch_dist`` or ``fsdp_dtensor`` (:data:`FORMATS`).
    ckpt_format: str = "torch_dist"
    #: Writer threads per rank; ``None``: dcpstore's default.
    dist_ckpt_workers: int | None = None
    #: Keep the newest K committed steps; ``-1`` (or megatron-core's ``None``) keeps all.
    most_recent_k: int | None = -1
    #: Model/optimizer structure is the same at every save (see the module docstring).
    ckpt_assume_constant_structure: bool = False
    #: Resume from this step instead of the newest committed one: the
    #: manager :meth:`load_manager` returns loads exactly it (a step that is
    #: not committed there is an error, never the newest instead, as in Bridge).
    ckpt_step: int | None = None
    #: How steps are named (not a Megatron field): ``"dcpstore"``
    #: (``step_00000100/``, ``latest``) or ``"bridge"`` (``iter_0000100/``,
    #: ``latest_checkpointed_iteration.txt``: what Bridge writes and resumes from).
    layout: str = "dcpstore"
    #: How every save runs (not a Megatron field), passed whole: the engine,
    #: where the bytes go (``storage_options``; MSC is its ``enable_msc``)
    #: and the rest of :class:`~dcpstore.SaveOptions`; its ``async_`` and
    #: ``workers`` are ``async_save`` and ``dist_ckpt_workers`` (set either).
    #: ``None``: the defaults; after construction, always the options.
    options: SaveOptions | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.ckpt_format not in FORMATS:
            self._fail("ckpt_format", f"must be one of {', '.join(FORMATS)}, got {self.ckpt_format!r}")
        for problem in save_option_problems(async_=self.async_save, workers=self.dist_ckpt_workers):
            self._fail(_BRIDGE_NAME.get(problem.option, problem.option), problem.why)
        self.options = self._resolve_options()
        # Bridge's fields read what the saves run with.
        self.async_save, self.dist_ckpt_workers = self.options.async_, self.options.workers
        for name in ("save", "load"):
            self._check_root(name)
        self._check_engine_target()
        if not isinstance(self.layout, str) or self.layout not in LAYOUTS:
            self._fail("layout", f"must be one of {', '.join(map(repr, LAYOUTS))}, got {self.layout!r}")

    def _resolve_options(self) -> SaveOptions:
        """``options`` with Bridge's fields applied."""
        given = {
            option: getattr(self, field)
            for option, field in _BRIDGE_NAME.items()
            if getattr(self, field) != _BRIDGE_DEFAULTS[field]
        }
        try:
            return resolve_options(CheckpointConfig, self.options, base=SaveOptions(), given=given)
        except InvalidArgument as e:
            self._fail("options", str(e).removeprefix("CheckpointConfig: "), cause=e)

    def _check_types(self) -> None:
        for name in ("async_save", "ckpt_assume_constant_structure"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("save", "load"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                self._fail(name, f"must be a URI string or None, got {value!r}")
        interval = self.save_interval
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            self._fail("save_interval", f"must be None or an int >= 1, got {interval!r}")
        if self.most_recent_k is None:  # megatron-core's spelling of "keep all"
            self.most_recent_k = -1
        k = self.most_recent_k
        if isinstance(k, bool) or not isinstance(k, int) or (k != -1 and k < 1):
            why = " (0 would delete the checkpoint just written)" if k == 0 else ""
            self._fail("most_recent_k", f"must be -1 (keep all) or an int >= 1, got {k!r}{why}")
        if self.ckpt_step is not None:
            try:
                check_step(self.ckpt_step)
            except InvalidArgument as e:
                self._fail("ckpt_step", str(e))

    def _check_root(self, name: str) -> None:
        """The URI parses and its backend (as open_storage would pick it) imports."""
        value = getattr(self, name)
        if value is None:
            return
        try:
            backend_class(backend_name(parse_uri(value), enable_msc=self.save_options().enable_msc))
        except CheckpointError as e:
            self._fail(name, str(e), cause=e)

    def _check_engine_target(self) -> None:
        """The engine can write where ``save`` points (NVRx: POSIX or MSC only),
        asked of the same NVRx checks the engine makes at save time, without
        opening the storage."""
        if self.save is None:
            return
        url = parse_uri(self.save)
        options = self.save_options()
        problem = engine_problem(options.engine, backend_name(url, enable_msc=options.enable_msc), str(url))
        if problem:
            self._fail("options.engine", problem)

    @staticmethod
    def _fail(name: str, message: str, cause: BaseException | None = None) -> NoReturn:
        raise InvalidArgument(f"CheckpointConfig.{name}: {message}") from cause

    # -- mapping onto dcpstore ----------------------------------------------
    @property
    def keep(self) -> int | None:
        """``most_recent_k`` as :class:`~dcpstore.CheckpointManager`'s ``keep``."""
        return None if self.most_recent_k == -1 else self.most_recent_k

    def save_options(
        self, *, process_group: dist.ProcessGroup | None = None, storage_options: StorageOptions | None = None
    ) -> SaveOptions:
        """The options of every save this config asks for: ``options``, with
        what only the caller knows (a process group exists only once
        torch.distributed is up, after the config is made).

        Args:
            process_group: the ranks that save together (default: all).
            storage_options: the storage's tuning, where ``options`` sets
                none (the config's MSC choice is kept).

        Returns:
            One validated :class:`~dcpstore.SaveOptions`.

        Raises:
            InvalidArgument: ``options`` already sets a different one.
        """
        options = self.options
        assert options is not None  # set in __post_init__
        given: dict[str, Any] = {"process_group": process_group} if process_group is not None else {}
        if storage_options is not None:
            given["storage_options"] = with_msc(storage_options, options.enable_msc)
            if options.storage_options == StorageOptions(enable_msc=options.enable_msc):  # the MSC choice only
                options = dataclasses.replace(options, storage_options=None)
        return resolve_options(CheckpointConfig.save_options, options, base=options, given=given)

    def save_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`dcpstore.save`: the engine, threads,
        mode and MSC choice, and whatever else ``options`` sets."""
        options = self.save_options()
        kwargs = {k: v for k, v in options.as_kwargs().items() if v != getattr(SaveOptions(), k, None)}
        return {
            "async_": options.async_,
            "workers": options.workers,
            "enable_msc": options.enable_msc,
            "engine": options.engine,
            **kwargs,
        }

    def load_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`dcpstore.load`."""
        options = self.save_options().for_load()
        where = {"storage_options": options.storage_options} if options.storage_options is not None else {}
        return {"workers": options.workers, "enable_msc": options.enable_msc, **where}

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a ``save_interval`` step."""
        return self.save is not None and self.save_interval is not None and step > 0 and step % self.save_interval == 0

    def manager(
        self, *, process_group: dist.ProcessGroup | None = None, storage_options: StorageOptions | None = None
    ) -> CheckpointManager:
        """The manager that saves (and resumes) under ``save``.

        Args:
            process_group, storage_options: as for :meth:`save_options`.

        Returns:
            A :class:`~dcpstore.CheckpointManager` with ``keep`` from
            ``most_recent_k``.

        Raises:
            InvalidArgument: ``save`` is ``None``.
        """
        if self.save is None:
            self._fail("save", "is None: there is no root to save under")
        assert self.save is not None
        options = self.save_options(process_group=process_group, storage_options=storage_options)
        return CheckpointManager(self.save, keep=self.keep, options=options, layout=self.layout)

    def load_manager(
        self, *, process_group: dist.ProcessGroup | None = None, storage_options: StorageOptions | None = None
    ) -> CheckpointManager | None:
        """A manager to resume from ``load``: its ``load(state)`` and
        ``resolve_step()`` without a step (and so
        :func:`dcpstore.adapters.fsdp.load_app_state` with it) resume
        ``ckpt_step`` if set, else the newest committed step; a ``step=``
        passed to them still wins.

        Args:
            process_group, storage_options: as for :meth:`save_options`.

        Returns:
            A load-only :class:`~dcpstore.CheckpointManager`, or ``None``
            when ``load`` is ``None`` (not resuming).

        Its ``load`` / ``resolve_step`` raise:
            CheckpointNotFound: ``ckpt_step`` is set and that step is not
                committed under ``load`` (naming ``ckpt_step``, the step's
                URI and the steps that are), on every rank; never the
                newest step instead (Bridge's ``ckpt_step`` refuses a
                missing step too).
        """
        if self.load is None:
            return None
        options = self.save_options(process_group=process_group, storage_options=storage_options)
        # It only loads: no background saver to start.
        options = dataclasses.replace(options, async_=False)
        if self.ckpt_step is None:
            return CheckpointManager(self.load, options=options, layout=self.layout)
        return _ResumeManager(self.load, ckpt_step=self.ckpt_step, options=options, layout=self.layout)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields to set."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    @hint_keywords_with(pass_whole(SaveOptions()))
    def from_bridge(
        cls,
        cfg: Any,
        *,
        options: SaveOptions | None = None,
        layout: str = "bridge",
    ) -> CheckpointConfig:
        """The config for a Megatron-Bridge (or megatron-core)
        ``CheckpointConfig`` ``cfg`` (or a mapping with its field names).

        Reads :data:`BRIDGE_FIELDS` by name (a field ``cfg`` lacks keeps
        its default here). Bridge's other fields say what goes into the
        state dict (``save_optim``, ``save_rng``), how Bridge's own worker
        runs (``async_strategy``, ``use_persistent_ckpt_worker``) or what
        dcpstore does not manage (non-persistent and local checkpoints):
        none of them changes where or how the bytes go.

        Args:
            cfg: Bridge's ``ConfigContainer.checkpoint``.
            options: the :class:`~dcpstore.SaveOptions` field (the engine,
                the storage options, ...); MSC is on where Megatron's
                process-global ``--enable-msc`` says
                (``megatron.core.msc_utils.MultiStorageClientFeature``; off
                where megatron-core is not installed), or where
                ``options.storage_options.enable_msc`` says.
            layout: ``"bridge"`` (default): the manager reads and writes
                Bridge's ``iter_NNNNNNN/`` steps and tracker; ``"dcpstore"``.

        Returns:
            The validated config.

        Raises:
            InvalidArgument: a Bridge setting dcpstore cannot honour (say, a
                ``ckpt_format`` other than ``torch_dist`` / ``fsdp_dtensor``),
                naming the field.
            TypeError: a keyword it does not take (an option goes in ``options``).
        """
        defaults = {f.name: f.default for f in fields(cls)}
        if isinstance(cfg, Mapping):
            values = {name: cfg.get(name, defaults[name]) for name in BRIDGE_FIELDS}
        else:
            values = {name: getattr(cfg, name, defaults[name]) for name in BRIDGE_FIELDS}
        if megatron_msc_enabled():
            base = options or SaveOptions()
            options = dataclasses.replace(base, storage_options=with_msc(base.storage_options, True))
        return cls(**values, options=options, layout=layout)


class _ResumeManager(CheckpointManager):
    """:meth:`CheckpointConfig.load_manager`'s manager with ``ckpt_step``
    set: a load or ``resolve_step`` that names no step resumes exactly
    ``ckpt_step``."""

    def __init__(self, root_uri: str, *, ckpt_step: int, **kwargs: Any) -> None:
        super().__init__(root_uri, **kwargs)
        self.ckpt_step = ckpt_step

    def resolve_step(self, step: int | None = None) -> int:
        return super().resolve_step(self._resumed(step))

    @hint_keywords
    def load(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        *,
        safe_globals: Sequence[Any] | None = None,
        trusted: bool = False,
    ) -> int:
        return super().load(state_dict, self._resumed(step), safe_globals=safe_globals, trusted=trusted)

    def _resumed(self, step: int | None) -> int:
        """``step`` if given, else ``ckpt_step`` once it is known committed.
        Rank 0 looks and broadcasts, so every rank loads it or every rank
        raises (a rank that raised alone would leave the others in the
        load's collectives)."""
        if step is not None:
            return step
        self._check_open()
        group = self.options.process_group
        found: list[Any] = [None]
        if group_rank(group) == 0:
            found = [(self._roots.is_committed(self.ckpt_step), self.all_steps())]
        if is_distributed():
            dist.broadcast_object_list(found, src=coordinator_rank(group), group=group)
        committed, steps = found[0]
        if not committed:
            shown = ", ".join(map(str, steps[-_STEPS_SHOWN:])) or "none"
            more = f" (newest {_STEPS_SHOWN} of {len(steps)})" if len(steps) > _STEPS_SHOWN else ""
            raise CheckpointNotFound(
                f"CheckpointConfig.ckpt_step={self.ckpt_step}: no committed checkpoint at "
                f"{self.step_uri(self.ckpt_step)}; committed steps under {self.uri}{more}: {shown}. Set ckpt_step "
                "to one of them, or to None to resume the newest"
            )
        return self.ckpt_step

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, ckpt_step={self.ckpt_step})"


#: How many committed steps a missing ``ckpt_step``'s error lists.
_STEPS_SHOWN = 10
