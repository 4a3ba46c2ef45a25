"""A Megatron-Bridge-style ``CheckpointConfig`` mapped onto dcpstore.

Field names are Megatron-Bridge's (``save``, ``load``, ``save_interval``,
``async_save``, ``ckpt_format``, ``dist_ckpt_workers``, ``enable_msc``,
``most_recent_k``, ``ckpt_assume_constant_structure``, ``ckpt_step``), plus
dcpstore's ``engine``. The config is validated once, in ``__post_init__``,
and keeps **no rules of its own** about which combinations work. It asks
the tables the writers ask:

===================================  =========================================
field                                validated by
===================================  =========================================
``ckpt_format``                      :data:`dcpstore.adapters.fsdp.FORMATS`
``async_save``, ``engine``,          :func:`dcpstore.options.save_option_problems`
``dist_ckpt_workers``                (what :func:`dcpstore.save` checks) and, for
                                     ``engine`` x ``save``, the NVRx adapter's own
                                     target check (NVRx writes POSIX/MSC only)
``save``, ``load``, ``enable_msc``   URI parsing + the backend registry, as
                                     ``open_storage`` resolves them
``ckpt_assume_constant_structure``   :data:`dcpstore.options.PLAN_CACHING` (the writer
                                     cannot replay cached plans today) and torch's
                                     DCP plan caching being present
===================================  =========================================

So a format can never be refused async while the writer would save it
(the seed PR's bug: async allowed only for ``torch_dist``), and an engine or
worker count the writer rejects fails here, naming the field, instead of at
the first save hours into a run.

Mapping: :meth:`CheckpointConfig.manager` builds the
:class:`~dcpstore.CheckpointManager` for ``save`` (``most_recent_k`` ->
``keep``, ``-1`` keeps all); :meth:`~CheckpointConfig.save_kwargs` /
:meth:`~CheckpointConfig.load_kwargs` are the keyword arguments for
:func:`dcpstore.save` / :func:`dcpstore.load`; ``ckpt_format`` is the
``format`` of :func:`dcpstore.adapters.fsdp.save_app_state`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from ..errors import CheckpointError, InvalidArgument
from ..manager import CheckpointManager, check_step
from ..options import PLAN_CACHING, PLAN_CACHING_WHY, engine_problem, save_option_problems
from ..storage import StorageOptions, backend_class, backend_name, open_storage, parse_uri
from .fsdp import FORMATS

#: save()'s keyword -> the config field that feeds it, for error messages.
_FIELD_OF_OPTION = {"async_": "async_save", "engine": "engine", "workers": "dist_ckpt_workers"}


def plan_caching_supported() -> bool:
    """Whether this torch's DCP can cache save plans *and* the writer can
    use cached plans (:data:`dcpstore.options.PLAN_CACHING`)."""
    return PLAN_CACHING and "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters


@dataclass
class CheckpointConfig:
    """Checkpointing options under Megatron-Bridge's names; see the module docstring."""

    #: Root to save step checkpoints under (``step_00000100/`` ...); ``None``: no saving.
    save: str | None = None
    #: Root to resume from; ``None``: do not resume.
    load: str | None = None
    #: Save every this many steps; ``None``: only when asked.
    save_interval: int | None = None
    async_save: bool = False
    #: ``torch_dist`` or ``fsdp_dtensor`` (:data:`dcpstore.adapters.fsdp.FORMATS`).
    ckpt_format: str = "torch_dist"
    #: Writer threads per rank; ``None``: dcpstore's default.
    dist_ckpt_workers: int | None = None
    enable_msc: bool = False
    #: Keep the newest K committed steps; ``-1`` keeps all.
    most_recent_k: int = -1
    #: Model/optimizer structure is the same at every save: reuse DCP's plan.
    ckpt_assume_constant_structure: bool = False
    #: Resume from this step instead of the newest committed one.
    ckpt_step: int | None = None
    #: dcpstore's save engine (not a Megatron field): auto, native or nvrx.
    engine: str = "auto"

    def __post_init__(self) -> None:
        self._check_types()
        if self.ckpt_format not in FORMATS:
            self._fail("ckpt_format", f"must be one of {', '.join(FORMATS)}, got {self.ckpt_format!r}")
        for problem in save_option_problems(async_=self.async_save, engine=self.engine, workers=self.dist_ckpt_workers):
            self._fail(_FIELD_OF_OPTION.get(problem.option, problem.option), problem.message)
        for name in ("save", "load"):
            self._check_root(name)
        self._check_engine_target()
        if self.ckpt_assume_constant_structure and not plan_caching_supported():
            why = PLAN_CACHING_WHY if not PLAN_CACHING else "this torch's DCP has no save-plan caching"
            self._fail("ckpt_assume_constant_structure", f"True is not supported: {why}; leave it False")

    def _check_types(self) -> None:
        for name in ("async_save", "enable_msc", "ckpt_assume_constant_structure"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("save", "load"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                self._fail(name, f"must be a URI string or None, got {value!r}")
        interval = self.save_interval
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            self._fail("save_interval", f"must be None or an int >= 1, got {interval!r}")
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
            backend_class(backend_name(parse_uri(value), enable_msc=self.enable_msc))
        except CheckpointError as e:
            self._fail(name, str(e), cause=e)

    def _check_engine_target(self) -> None:
        """The engine can write where ``save`` points (NVRx: POSIX or MSC only),
        asked of the same adapter the engine asks at save time."""
        if self.save is None:
            return
        storage = open_storage(self.save, enable_msc=self.enable_msc)
        try:
            problem = engine_problem(self.engine, storage)
        finally:
            storage.close()
        if problem:
            self._fail("engine", problem)

    @staticmethod
    def _fail(name: str, message: str, cause: BaseException | None = None) -> None:
        raise InvalidArgument(f"CheckpointConfig.{name}: {message}") from cause

    # -- mapping onto dcpstore ----------------------------------------------
    @property
    def keep(self) -> int | None:
        """``most_recent_k`` as :class:`~dcpstore.CheckpointManager`'s ``keep``."""
        return None if self.most_recent_k == -1 else self.most_recent_k

    def planner(self) -> SavePlanner | None:
        """A save planner that caches its plan, if the structure is constant."""
        if not self.ckpt_assume_constant_structure:
            return None
        return DefaultSavePlanner(enable_plan_caching=True)  # type: ignore[call-arg,unused-ignore]

    def save_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`dcpstore.save`."""
        return {
            "async_": self.async_save,
            "workers": self.dist_ckpt_workers,
            "enable_msc": self.enable_msc,
            "engine": self.engine,
            "planner": self.planner(),
        }

    def load_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`dcpstore.load`."""
        return {"workers": self.dist_ckpt_workers, "enable_msc": self.enable_msc}

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is a ``save_interval`` step."""
        return self.save is not None and self.save_interval is not None and step > 0 and step % self.save_interval == 0

    def manager(
        self, *, process_group: dist.ProcessGroup | None = None, storage_options: StorageOptions | None = None
    ) -> CheckpointManager:
        """The manager that saves (and resumes) under ``save``."""
        if self.save is None:
            self._fail("save", "is None: there is no root to save under")
        assert self.save is not None
        return CheckpointManager(
            self.save,
            keep=self.keep,
            async_=self.async_save,
            workers=self.dist_ckpt_workers,
            enable_msc=self.enable_msc,
            engine=self.engine,
            process_group=process_group,
            planner=self.planner(),
            storage_options=storage_options,
        )

    def load_manager(
        self, *, process_group: dist.ProcessGroup | None = None, storage_options: StorageOptions | None = None
    ) -> CheckpointManager | None:
        """A manager to resume from ``load`` (``None`` when not resuming).
        Resume ``ckpt_step`` if set, else the newest committed step."""
        if self.load is None:
            return None
        return CheckpointManager(
            self.load,
            async_=False,  # it only loads
            workers=self.dist_ckpt_workers,
            enable_msc=self.enable_msc,
            engine=self.engine,
            process_group=process_group,
            storage_options=storage_options,
        )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
