"""Which engine runs a save: chosen per call, never silently.

``native`` writes every backend; ``nvrx`` needs nvidia-resiliency-ext and a
backend NVRx can write (POSIX or MSC); ``auto`` picks NVRx where it can and
otherwise native with one :class:`~dcpstore.EngineFallbackWarning` naming
why. :func:`engine_problem` is the same decision without a storage instance,
for configuration layers that validate before anything is opened
(:class:`~dcpstore.CheckpointManager`,
:class:`~dcpstore.adapters.megatron.CheckpointConfig`).

Layer: engines. Imports :mod:`.nvrx`, the value objects and the foundation.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..errors import CheckpointError, EngineFallbackWarning, InvalidArgument, SaveError
from ..options import ENGINES
from ..quiet import user_stacklevel
from ..storage import Storage
from . import nvrx


def select_engine(engine: str, storage: Storage) -> str:
    """Resolve ``engine`` for ``storage`` to ``"native"`` or ``"nvrx"``.

    Explicit choices are honoured or refused with the reason; ``"auto"``
    falls back to native with one warning that says why, pointed at the
    user's line.
    """
    if engine not in ENGINES:
        raise InvalidArgument(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "native":
        return "native"
    if engine == "nvrx":
        nvrx.require()
        nvrx.check_target(storage)
        return "nvrx"
    reason = nvrx.import_error()
    if reason is None:
        target = nvrx.target_for(storage)
        if not isinstance(target, str):
            return "nvrx"
        reason = target
    warnings.warn(
        f"engine='auto' uses dcpstore's native async engine: {reason} "
        "(pass engine='native' to choose it explicitly)",
        EngineFallbackWarning,
        stacklevel=user_stacklevel(),
    )
    return "native"


def engine_problem(engine: str, backend: str, uri: str) -> str | None:
    """Why ``engine`` cannot save through ``backend`` (``None``: it can), by
    the same NVRx checks :func:`select_engine` makes; ``uri`` names the
    target in the message."""
    if engine != "nvrx":
        return None
    try:
        nvrx.require()
    except CheckpointError as e:
        return str(e)
    problem = nvrx.backend_problem(backend)
    return None if problem is None else f"engine='nvrx' cannot save to {uri}: {problem}"


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
