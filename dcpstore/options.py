"""What dcpstore's save path accepts, in one table.

:func:`dcpstore.save` validates its engine/async/workers arguments here, and
so do the layers that build those arguments from a configuration
(:class:`dcpstore.CheckpointManager` at construction,
:class:`dcpstore.adapters.megatron.CheckpointConfig` in ``__post_init__``).
No config layer keeps rules of its own about which combinations work: a
combination is valid exactly when :func:`save_option_problems` finds nothing,
so a config can never allow what the writer refuses, or refuse what it
supports (the seed PR's config allowed async only for ``torch_dist`` while
the writer handled ``fsdp_dtensor`` too).

The state-dict *format* (``fsdp_dtensor`` / ``torch_dist``) is deliberately
not a column here: every format reaches storage through the same DCP writer,
so sync/async and the engine are properties of the writer alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .adapters import nvrx as nvrx_adapter
from .errors import CheckpointError, InvalidArgument
from .storage import Storage
from .writers.async_engine import ENGINES as ENGINE_NAMES
from .writers.dcp import check_workers


@dataclass(frozen=True)
class EngineSpec:
    """One way of running a save."""

    name: str
    #: Whether ``save(..., async_=True, engine=name)`` works in this build.
    #: The async engines set this when they land; nothing else may decide it.
    supports_async: bool
    summary: str


_SUMMARIES = {
    "auto": "NVRx where it works, else native, with one warning naming why",
    "native": "dcpstore's own staging + thread pool",
    "nvrx": "NVIDIA Resiliency Extension's async writer",
}

#: The engines, by name. The names are the async engine's own list
#: (:data:`dcpstore.writers.async_engine.ENGINES`), so there is one list.
#: Every engine runs sync and async saves; whether NVRx is installed, and
#: whether it can write to a given backend, is asked of the NVRx adapter
#: (:func:`engine_problem`), again the writer's own function.
ENGINES: Mapping[str, EngineSpec] = {
    name: EngineSpec(name, True, _SUMMARIES.get(name, "")) for name in ENGINE_NAMES
}


def engine_problem(engine: str, storage: Storage) -> str | None:
    """Why ``engine`` cannot save to ``storage`` (``None``: it can), decided
    by the same NVRx adapter functions the engine itself calls."""
    if engine != "nvrx":
        return None
    try:
        nvrx_adapter.require()
        nvrx_adapter.check_target(storage)
    except CheckpointError as e:
        return str(e)
    return None


#: Whether the writer can run from a plan DCP replays out of its save-plan
#: cache (``DefaultSavePlanner(enable_plan_caching=True)``, what Megatron's
#: ``ckpt_assume_constant_structure`` asks for). It cannot: each save's plan
#: carries that save's token (the two-writers check in
#: :mod:`dcpstore.writers.dcp`), and a replayed plan carries the first save's.
PLAN_CACHING = False
PLAN_CACHING_WHY = (
    "DCP's save-plan cache replays the first save's plan, and dcpstore's writer puts a per-save token in "
    "every plan (so that a concurrent writer to the same URI is detected); a replayed token looks like such a writer"
)


def uses_plan_caching(planner: Any) -> bool:
    """Whether ``planner`` is a DCP planner with its plan cache switched on."""
    return bool(getattr(planner, "_enable_plan_caching", False))


@dataclass(frozen=True)
class OptionProblem:
    """Why one argument of a save is not accepted.

    ``option`` is the keyword of :func:`dcpstore.save` at fault, so callers
    that map their own field names onto save's arguments can name the field.
    ``unsupported`` marks a valid request this build cannot serve (raised by
    ``save`` as ``NotImplementedError``) as opposed to a bad value.
    """

    option: str
    message: str
    unsupported: bool = False


def save_option_problems(
    *, async_: bool, engine: str, workers: int | None, planner: Any = None
) -> list[OptionProblem]:
    """Everything wrong with this combination of save arguments (empty: fine)."""
    problems: list[OptionProblem] = []
    if uses_plan_caching(planner) and not PLAN_CACHING:
        problems.append(OptionProblem("planner", f"a planner with plan caching cannot be used: {PLAN_CACHING_WHY}"))
    if not isinstance(async_, bool):
        problems.append(OptionProblem("async_", f"async_ must be a bool, got {async_!r}"))
    spec = ENGINES.get(engine) if isinstance(engine, str) else None
    if spec is None:
        problems.append(OptionProblem("engine", f"engine must be one of {', '.join(ENGINES)}, got {engine!r}"))
    elif async_ is True and not spec.supports_async:
        problems.append(
            OptionProblem(
                "async_",
                f"async saves are not available with engine {engine!r} in this build "
                f"(engines that can run them: {', '.join(n for n, s in ENGINES.items() if s.supports_async) or 'none'})",
                unsupported=True,
            )
        )
    try:
        check_workers(workers, 1)
    except InvalidArgument as e:
        problems.append(OptionProblem("workers", str(e)))
    return problems


def check_save_options(*, async_: bool, engine: str, workers: int | None, planner: Any = None) -> None:
    """Raise for the first problem :func:`save_option_problems` finds.

    A bad value raises :class:`InvalidArgument`; a valid request this build
    cannot serve raises ``NotImplementedError``.
    """
    for problem in save_option_problems(async_=async_, engine=engine, workers=workers, planner=planner):
        if problem.unsupported:
            raise NotImplementedError(problem.message)
        raise InvalidArgument(problem.message)
