"""Which engine runs a save: chosen per call, never silently.

An explicit ``engine=`` is honoured or refused with the reason: an engine
that cannot run here (NVRx not installed) raises
:class:`~dcpstore.BackendUnavailable`, one that cannot write the storage
(NVRx on the native S3 backend) :class:`~dcpstore.InvalidArgument`.
``engine="auto"`` takes the first engine of
:data:`~dcpstore._impl.values.options.AUTO_ORDER` that can do both, and says why with
one :class:`~dcpstore.EngineFallbackWarning` when that is not the first.
:func:`engine_problem` is the same decision without a storage instance,
for configuration layers that validate before anything is opened
(:class:`~dcpstore.CheckpointManager`,
:class:`~dcpstore.adapters.megatron.CheckpointConfig`).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from dcpstore._impl.engines.engine import engine_class
from dcpstore._impl.storage import Storage
from dcpstore._impl.util.errors import BackendUnavailable, EngineFallbackWarning, InvalidArgument, SaveError
from dcpstore._impl.util.warning_filters import user_stacklevel
from dcpstore._impl.values.options import AUTO, AUTO_ORDER, ENGINE_CHOICES, ENGINES


def select_engine(engine: str, storage: Storage) -> str:
    """Resolve ``engine`` for ``storage`` to the name of an engine of
    :data:`~dcpstore._impl.values.options.ENGINES` (see the module docstring)."""
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
        return engine
    reason = ""
    for name in AUTO_ORDER:
        cls = engine_class(name)
        why = cls.unavailable() or cls.target_problem(storage.backend, storage.uri)
        if why is None:
            if name != AUTO_ORDER[0]:
                warnings.warn(
                    f"engine='auto' uses the {name} engine ({ENGINES[name].summary}): {reason} "
                    f"(pass engine={name!r} to choose it explicitly)",
                    EngineFallbackWarning,
                    stacklevel=user_stacklevel(),
                )
            return name
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
    engine="auto" a node without NVRx would otherwise pick native and hang
    the others. One tiny all-reduce on the background group checks it."""
    if group is None:
        return
    code = list(ENGINES).index(engine)
    votes = torch.tensor([code, -code], dtype=torch.int32)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    if int(votes[0]) != -int(votes[1]):
        raise SaveError(
            f"ranks chose different async engines (this one: {engine!r}); pass the same explicit "
            "engine= on every rank, or install nvidia-resiliency-ext on every node"
        )
