"""Which engine runs a save: chosen per call, never silently.

An explicit ``engine=`` is honoured or refused with the reason: an engine
that cannot run here (NVRx not installed) raises
:class:`~dcpstore.BackendUnavailable`, one that cannot write the storage
(NVRx on the native S3 backend) :class:`~dcpstore.InvalidArgument`.

``engine="auto"`` prefers what ``benchmarks/interference.py`` measured
costing the training loop least (BENCHMARKS.md, "What a background save
costs the training loop"), by :func:`auto_preference`, a pure function of
the storage's kind (:func:`storage_kind`), this process's cores and
whether it uses CUDA:

- an object store, from a process that uses CUDA or may run on at least
  :data:`PROCESS_MIN_CORES` cores:
  the checkpoint process (``"process"``). On threads, the object store's
  Python client (botocore, MSC, fsspec's event loop) holds the training
  process's GIL for most of a second per GB and stalls a training step
  beside it; on 16 cores with CUDA the checkpoint process about halved the
  lost step time and made the worst step a small multiple of the baseline
  instead of a stall;
- everything else (a local path, ``memory://``; an object store on fewer
  cores without CUDA): the native engine's threads. Locally they cost the
  least on both measured machines (NVRx's threads and the checkpoint
  process cost more), and on 2 cores the checkpoint process competes with
  training for them and lost more step time than threads.

An engine that cannot run here or cannot write the storage is skipped, and
one :class:`~dcpstore.EngineFallbackWarning` says why when the preference
is not what runs. The choice and its reason travel with the save
(:class:`EngineChoice`, :attr:`~dcpstore.CheckpointInfo.engine_reason`,
the save's INFO line).

:func:`engine_problem` is the same decision without a storage instance,
for configuration layers that validate before anything is opened
(:class:`~dcpstore.CheckpointManager`,
:class:`~dcpstore.adapters.megatron.CheckpointConfig`).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from dcpstore._impl.engines.engine import engine_class
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import BackendUnavailable, EngineFallbackWarning, InvalidArgument, SaveError
from dcpstore._impl.util.warning_filters import user_stacklevel
from dcpstore._impl.values.options import AUTO, ENGINE_CHOICES, ENGINES

#: What :func:`auto_preference` tells apart: a path this host writes
#: through its own filesystem or memory, or an object store reached through
#: a Python network client.
StorageKind = Literal["local", "object store"]

#: Cores (this process's CPU affinity) from which ``engine="auto"`` runs an
#: object-store save in a checkpoint process when it does not use CUDA. Measured:
#: 2 cores lose (the checkpoint process, seconds of CPU per GB of its own,
#: shares the one core training does not use), 16 win; 8 is the smallest
#: common host where training's thread, its intra-op threads and the
#: checkpoint process each keep a core, and the ``dcpstore default`` rows of
#: ``benchmarks/interference.py`` check it on the next machine measured.
PROCESS_MIN_CORES = 8

#: fsspec schemes that are not object stores: the host's own filesystem and
#: this process's memory (no network client holds the GIL for them).
_LOCAL_SCHEMES = frozenset({"file", "local", "memory"})


class AutoPreference(NamedTuple):
    """What ``engine="auto"`` prefers: the engines to try, in order (the
    last, native, writes every backend), and why the first, in words."""

    order: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class EngineChoice:
    """The engine a save runs (a name of
    :data:`~dcpstore._impl.values.options.ENGINES`) and why, in words."""

    name: str
    reason: str


def storage_kind(backend: str, uri: str) -> StorageKind:
    """``"local"`` for the local backend and fsspec's local and memory
    filesystems, else ``"object store"``: native S3, every other fsspec
    protocol, and MSC (a POSIX profile too: which provider a profile has
    is not known before it is opened)."""
    if backend == "local":
        return "local"
    if backend == "fsspec" and uri.partition("://")[0] in _LOCAL_SCHEMES:
        return "local"
    return "object store"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a job
    launcher may narrow per rank; the checkpoint process inherits it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # pragma: no cover - macOS, Windows


def auto_preference(kind: StorageKind, cores: int, cuda: bool) -> AutoPreference:
    """What ``engine="auto"`` prefers for a save to ``kind`` from a process
    that may run on ``cores`` cores and uses CUDA (``cuda``) or not. Pure:
    the module docstring says what it follows."""
    if kind == "object store" and (cuda or cores >= PROCESS_MIN_CORES):
        where = "CUDA in use" if cuda else f"{cores} cores (>= {PROCESS_MIN_CORES})"
        return AutoPreference(
            ("process", "native"),
            f"an object store with {where}: a checkpoint process keeps the storage client off the training GIL",
        )
    if kind == "object store":
        return AutoPreference(
            ("native",),
            f"an object store on {cores} core(s) (< {PROCESS_MIN_CORES}) without CUDA: "
            "a checkpoint process would compete with training for the cores",
        )
    return AutoPreference(("native",), "local storage: threads cost the training loop least")


def cuda_in_use() -> bool:
    """Whether this process has initialised CUDA (a GPU training process
    has by its first save). Asking the driver instead
    (``torch.cuda.is_available()``) would initialise it in a process that
    does not use it, which breaks CUDA in the children it forks later."""
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def auto_engine(backend: str, uri: str) -> AutoPreference:
    """:func:`auto_preference` for a save through ``backend`` to ``uri`` in
    this process, on this host."""
    return auto_preference(storage_kind(backend, uri), usable_cores(), cuda_in_use())


def select_engine(engine: str, storage: Storage) -> EngineChoice:
    """Resolve ``engine`` for ``storage`` to an engine of
    :data:`~dcpstore._impl.values.options.ENGINES` and the reason for it
    (see the module docstring)."""
    if engine not in ENGINE_CHOICES:
        raise InvalidArgument(f"engine must be one of {', '.join(ENGINE_CHOICES)}, got {engine!r}")
    if engine != AUTO:
        cls = engine_class(engine)
        why = cls.unavailable()
        if why is not None:
            raise BackendUnavailable(f"engine={engine!r} cannot run here: {why}")
        problem = cls.target_problem(storage.backend, storage.uri)
        if problem is not None:
            raise InvalidArgument(f"engine={engine!r} cannot save to {storage.uri}: {problem}")
        return EngineChoice(engine, f"engine={engine!r} was passed")
    order, preferred_because = auto_engine(storage.backend, storage.uri)
    reason = ""
    for name in order:
        cls = engine_class(name)
        why = cls.unavailable() or cls.target_problem(storage.backend, storage.uri)
        if why is None:
            if name == order[0]:
                return EngineChoice(name, f"engine='auto': {preferred_because}")
            warnings.warn(
                f"engine='auto' uses the {name} engine ({ENGINES[name].summary}) instead of {order[0]}: {reason} "
                f"(pass engine={name!r} to choose it explicitly)",
                EngineFallbackWarning,
                stacklevel=user_stacklevel(),
            )
            return EngineChoice(name, f"engine='auto': {order[0]} preferred ({preferred_because}), but {reason}")
        reason = reason or why  # the first preference's reason is the one that matters
    raise InvalidArgument(f"engine='auto' found no engine that can save to {storage.uri}: {reason}")


def engine_problem(engine: str, backend: str, uri: str) -> str | None:
    """Why ``engine`` cannot save through ``backend`` (``None``: it can), by
    the same checks :func:`select_engine` makes; ``uri`` names the target
    in the message. ``"auto"`` always can (its last choice writes every
    backend)."""
    if engine == AUTO or engine not in ENGINES:
        return None
    cls = engine_class(engine)
    why = cls.unavailable()
    if why is not None:
        return f"engine={engine!r} cannot run here: {why}"
    problem = cls.target_problem(backend, uri)
    return None if problem is None else f"engine={engine!r} cannot save to {uri}: {problem}"


def agree_on_engine(engine: str, group: dist.ProcessGroup | None) -> None:
    """Every rank must run the same engine (their collectives differ): with
    engine="auto" a rank whose CPU affinity or CUDA differs from the others'
    could choose otherwise and hang them. One tiny all-reduce on the
    background group checks it."""
    if group is None:
        return
    code = list(ENGINES).index(engine)
    votes = torch.tensor([code, -code], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    if int(votes[0]) != -int(votes[1]):
        raise SaveError(
            f"ranks chose different async engines (this one: {engine!r}); pass the same explicit "
            "engine= on every rank (engine='auto' chooses by the storage, each rank's cores and CUDA)"
        )
