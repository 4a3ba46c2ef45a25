"""Crash injection shared by the crash suites (test_crash*.py).

A crash run is a child process, forked from a forkserver that has torch and
dcpstore imported (a kill costs milliseconds, not an interpreter start),
that saves with a :class:`faults.KillAt` hook and SIGKILLs itself at the
n-th *event*. Events come from every layer a save passes through:

* storage calls (:class:`faults.EventStorage`): open, each chunk written,
  each commit before and after it lands, deletes, lists, reads;
* staging of an async save (``stage:copy`` per tensor, ``stage:done``):
  instrumented by :func:`instrument_staging`;
* NVRx's own data-file writes (``nvrx:item`` / ``nvrx:item-done`` around
  each item; NVRx writes data files itself, not through our Storage):
  :func:`instrument_nvrx`;
* S3 requests (``s3:<Operation>`` before and ``s3:<Operation>-done`` after
  each botocore call, on whichever thread makes it, e.g. the part-upload
  pool): :func:`instrument_s3`.

A probe run records the events (:class:`faults.Recorder`) and
:func:`kill_points` picks where to kill: every structural event, plus a
spread over the repetitive ones (chunk writes, staging copies, NVRx items).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch

import dcpstore
from faults import Hook, spread
from helpers import assert_state_equal, zeros_like_state

#: Events that repeat per chunk / tensor: only a spread of them become kill points.
REPETITIVE = ("write:", "wrote:", "stage:copy", "nvrx:item")


def crash_state(seed: int, big: int = 256 * 1024) -> dict[str, Any]:
    """Ten layers, a nested bf16 optimizer entry, a plain int and one
    ``big``-element float32 tensor (several chunks / multipart parts)."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"layer{i}.w": torch.randn(128, 96 + i, generator=g) for i in range(10)}
    state["opt"] = {"m": torch.randn(300, generator=g).bfloat16(), "step": seed}
    state["big"] = torch.randn(big, generator=g)
    return state


def mutate(state: dict[str, Any]) -> None:
    """What training does right after an async save returns."""
    for value in state.values():
        if isinstance(value, torch.Tensor):
            value.add_(1)
    state["opt"]["m"].add_(1)
    state["opt"]["step"] = -1


def kill_points(
    events: list[str], repetitive: int = 12, total: int | None = None, keep: tuple[str, ...] = ()
) -> list[int]:
    """Every structural event plus ``repetitive`` spread over the repetitive
    ones. With ``total``: then thinned evenly to about that many, always
    keeping the events that start with one of ``keep``."""
    rep = [i for i, e in enumerate(events) if e.startswith(REPETITIVE)]
    structural = [i for i, e in enumerate(events) if not e.startswith(REPETITIVE)]
    points = sorted(structural + [rep[j] for j in spread(len(rep), repetitive)])
    if total is not None and len(points) > total:
        kept = [k for k in points if events[k].startswith(keep)] if keep else []
        rest = [k for k in points if k not in kept]
        points = sorted(kept + [rest[j] for j in spread(len(rest), max(0, total - len(kept)))])
    return points


def commit_index(events: list[str]) -> int:
    """The first event at which the checkpoint counts as committed: once
    ``.metadata`` has landed (renamed into place; on S3, its ``PutObject``
    answered, which comes before our writer's own ``committed:`` event)."""
    start, end = events.index("commit:.metadata"), events.index("committed:.metadata")
    for i in range(start, end):
        if events[i] == "s3:PutObject-done":
            return i
    return end


# -- instrumentation (runs in the crash child, or in a probe) ---------------


def instrument_staging(hook: Hook) -> None:
    """Report each tensor copy of async staging (on the caller's thread)."""
    from dcpstore.engines.staging import Stager

    real = Stager._copy

    def copy(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        for buf, src in zip(buffers, sources):
            hook("stage:copy")
            real([buf], [src])
        hook("stage:done")

    Stager._copy = staticmethod(copy)  # type: ignore[method-assign]


def instrument_nvrx(hook: Hook) -> None:
    """Report each item NVRx's per-bucket writer writes into a data file."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async as fa

    real = fa._write_item

    @functools.wraps(real)  # NVRx inspects its signature
    def write_item(*args: Any, **kwargs: Any) -> Any:
        hook("nvrx:item")
        result = real(*args, **kwargs)
        hook("nvrx:item-done")
        return result

    fa._write_item = write_item


def instrument_s3(hook: Hook, options: dcpstore.StorageOptions) -> None:
    """Report every S3 request the (per-process, cached) client makes."""
    from dcpstore.storage.s3 import s3_client

    events = s3_client(options).meta.events
    events.register("before-call.s3", lambda model, **_: hook(f"s3:{model.name}"))
    events.register("after-call.s3", lambda model, **_: hook(f"s3:{model.name}-done"))


# -- running and judging ------------------------------------------------------


def forkserver() -> mp.context.BaseContext:
    """The session's forkserver context, preloading dist_utils.PRELOAD
    (which names every crash suite, so their children import nothing)."""
    from dist_utils import PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def crash(ctx: mp.context.BaseContext, target: Callable[..., None], *args: Any, timeout: float = 120) -> int:
    """Run ``target(*args)`` in a child; its exit code (``-9``: SIGKILLed)."""
    proc = ctx.Process(target=target, args=args)
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError(f"crash child {target.__name__}{args} hung")
    return int(proc.exitcode)


def outcome(uri: str, expected: dict[str, Any], **load_kwargs: Any) -> str:
    """``"absent"`` (no committed checkpoint) or ``"complete"`` (loads
    exactly ``expected``); anything else fails the test."""
    restored = zeros_like_state(expected)
    try:
        dcpstore.load(restored, uri, **load_kwargs)
    except dcpstore.CheckpointNotFound:
        return "absent"
    assert_state_equal(expected, restored)
    return "complete"
