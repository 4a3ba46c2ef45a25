"""DCP's call patterns for ``dcp.async_save``, run against any writer.

A :class:`Pattern` is one way DCP lets a training loop call
``dcp.async_save``: one writer kept for the run or a fresh one per call,
either executor, with or without ``cache_staged_state_dict``, each call with
its own ``checkpoint_id`` (re-pointing the writer) or all at the writer's one
URI, waiting for each save before the next call or not. After every call the
state changes in place, as the next optimizer step changes it.

:func:`run_pattern` runs a pattern with dcpstore's writer or with stock
``FileSystemWriter`` (the oracle, local paths only) and judges every call:

* ``ok``: the future reported success and the checkpoint loads exactly the
  state as it was when that ``async_save`` returned;
* ``raised``: the future raised (an honest failure);
* ``WRONG``: the future reported success, but the checkpoint does not load,
  or loads other values: the one outcome never allowed.

Where every call saves to the same URI, only the last commit can be read
back: a call that succeeded and was superseded counts as ``ok``, and the URI
must hold the state of a call that succeeded (with ``wait``, of the last
call, checked after each call too).

Every check loads through one ``dcpstore.StorageReader`` re-pointed by
``checkpoint_id`` (``dcp.load`` repeated on one reader), and on local paths
through stock ``FileSystemReader`` as well. On several ranks every rank runs
the same pattern and loads every call's checkpoint, whatever its future
said, so that the ranks' collectives stay in step.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import dcpstore
from tests.support.backends import load_options, save_options


@dataclass(frozen=True)
class Pattern:
    #: "one": one writer for every call (docs/dropin.md's "kept for the run"); "fresh": a new one per call.
    writer: str = "one"
    #: DCP's executor: "thread" or "process" (AsyncCheckpointerType's
    #: values); "sync": ``dcp.save`` itself, the call returning once committed.
    executor: str = "thread"
    cache: bool = False
    #: True: each call its own checkpoint_id (a URI of its own); False: no
    #: checkpoint_id, every call to the writer's one URI.
    repoint: bool = True
    #: Wait for each save's future before the next call.
    wait: bool = False
    calls: int = 3

    def __str__(self) -> str:
        return "-".join(
            [
                self.writer,
                self.executor,
                "cache" if self.cache else "nocache",
                "repoint" if self.repoint else "oneuri",
                "wait" if self.wait else "nowait",
            ]
        )


#: The full cross product (the slow suites run all of it), but for calls
#: that overlap on the process executor: DCP's own executor breaks there,
#: whatever the writer. Each overlapping call's thread sends its request down
#: the one pipe to DCP's checkpoint process and waits on it for a reply
#: (``_AsyncCheckpointProcess.save``), unsynchronised: two such threads
#: interleave their bytes, the checkpoint process dies ("UnpicklingError:
#: invalid load key") and every later save through that executor fails or
#: hangs. Stock FileSystemWriter does exactly that on torch 2.13.
ALL_PATTERNS = [
    Pattern(writer, executor, cache, repoint, wait)
    for writer, executor, cache, repoint, wait in itertools.product(
        ("one", "fresh"), ("thread", "process"), (False, True), (True, False), (False, True)
    )
    if wait or executor == "thread"
]
#: ``dcp.save`` repeated on one writer (or a fresh one per call).
SYNC_PATTERNS = [
    Pattern(writer, "sync", False, repoint, True) for writer in ("one", "fresh") for repoint in (True, False)
]


def pattern_state(rank: int = 0) -> dict[str, Any]:
    """What a rank saves: 4 MiB (writing it outlasts staging the next call,
    so saves overlap), several dtypes, tied tensors, a plain value. Every key
    but ``rank{rank}`` holds the same values on every rank (DCP saves a key
    that several ranks hold once)."""
    g = torch.Generator().manual_seed(0)
    tied = torch.randn(1000, generator=g)
    return {
        "big": torch.randn(1 << 20, generator=g),
        "half": torch.randn(4096, generator=g).half(),
        "ids": torch.arange(5000, dtype=torch.int64),
        f"rank{rank}": torch.full((100,), float(rank)),
        "nested": {"m": torch.randn(64, 64, generator=g), "tied_a": tied, "tied_b": tied},
        "step": 0,
    }


def advance(state: dict[str, Any]) -> None:
    """The next optimizer step: every tensor changes in place, the step too."""
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                obj.add_(1)
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)

    walk(state)
    state["step"] += 1


def snapshot(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    return obj


def destination(obj: Any) -> Any:
    """Where to load: the same structure, values that match no save."""
    if isinstance(obj, torch.Tensor):
        return torch.full_like(obj, -7)
    if isinstance(obj, dict):
        return {k: destination(v) for k, v in obj.items()}
    return None


def difference(got: Any, want: Any, path: str = "") -> str | None:
    """Where ``got`` differs from ``want`` (None: bitwise the same)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: not a {want.dtype} tensor of shape {tuple(want.shape)}"
        if not torch.equal(got, want):
            return f"{path}: values differ (first element {got.flatten()[:1].tolist()}, want {want.flatten()[:1].tolist()})"
        return None
    if isinstance(want, dict):
        for key, value in want.items():
            found = difference(got.get(key) if isinstance(got, dict) else None, value, f"{path}.{key}")
            if found:
                return found
        return None
    return None if got == want else f"{path}: {got!r}, want {want!r}"


@dataclass
class Call:
    index: int
    uri: str
    expected: dict[str, Any]
    future: Any
    #: "ok", "raised: ..." or "WRONG: ..." once judged.
    outcome: str = ""
    succeeded: bool = False


def make_writer(kind: str, uri: str, cache: bool, kwargs: dict[str, Any]) -> Any:
    if kind == "stock":
        # Stock's cached staging pins its buffers, which needs an accelerator.
        return FileSystemWriter(uri, cache_staged_state_dict=cache and torch.cuda.is_available())
    return dcpstore.StorageWriter(uri, cache_staged_state_dict=cache, options=save_options(kwargs))


class _Loader:
    """Loads checkpoints for the checks: one dcpstore reader re-pointed by
    ``checkpoint_id`` (and stock's reader too, on local paths)."""

    def __init__(self, kind: str, kwargs: dict[str, Any], local: bool, first_uri: str) -> None:
        self.reader = None if kind == "stock" else dcpstore.StorageReader(first_uri, options=load_options(kwargs))
        self.local = local

    def difference(self, uri: str, want: dict[str, Any]) -> str | None:
        readers: list[tuple[str, Any]] = []
        if self.reader is not None:
            readers.append(("dcpstore reader", self.reader))
        if self.local:
            readers.append(("stock reader", None))
        for name, reader in readers:
            got = destination(want)
            try:
                if reader is None:
                    dcp.load(got, storage_reader=FileSystemReader(uri))
                else:
                    dcp.load(got, storage_reader=reader, checkpoint_id=uri)
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                return f"{name} cannot load {uri}: {_last_line(e)}"
            found = difference(got, want)
            if found:
                return f"{name} reads other values from {uri}: {found}"
        return None


def _last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]


def _settle(call: Call) -> None:
    try:
        call.future.result(timeout=300)
        call.succeeded = True
    except BaseException as e:
        call.outcome = f"raised: {_last_line(e)}"


def run_pattern(
    kind: str, base: str, pattern: Pattern, kwargs: dict[str, Any] | None = None, rank: int = 0, local: bool = True
) -> list[Call]:
    """Run ``pattern`` with ``kind`` ("dcpstore" or "stock") under ``base``
    and judge every call (see the module docstring). ``kwargs``: the
    writer's and reader's backend arguments; ``local``: ``base`` is a local
    path (stock's reader checks too)."""
    kwargs = kwargs or {}
    base = base.rstrip("/")
    state = pattern_state(rank)
    loader = _Loader(kind, kwargs, local, base)
    shared = make_writer(kind, f"{base}/c0" if pattern.repoint else base, pattern.cache, kwargs)
    calls: list[Call] = []
    for i in range(pattern.calls):
        uri = f"{base}/c{i}" if pattern.repoint else base
        writer = (
            shared
            if pattern.writer == "one"
            else make_writer(kind, base if pattern.repoint else uri, pattern.cache, kwargs)
        )
        call = Call(i, uri, snapshot(state), _save(pattern, state, writer, uri if pattern.repoint else None))
        advance(state)  # training goes on: the checkpoint must not see this
        calls.append(call)
        if pattern.wait:
            _settle(call)
            _judge(call, loader)
    if not pattern.wait:
        for call in calls:
            _settle(call)
        if pattern.repoint:
            for call in calls:
                _judge(call, loader)
        else:
            _judge_one_uri(calls, loader)
    if hasattr(shared, "close"):
        shared.close()
    return calls


def _save(pattern: Pattern, state: dict[str, Any], writer: Any, checkpoint_id: str | None) -> Future[Any]:
    """Start one call's save: ``dcp.async_save``'s future, or a done one for ``dcp.save``."""
    if pattern.executor != "sync":
        executor = AsyncCheckpointerType(pattern.executor)
        return dcp.async_save(
            state, storage_writer=writer, checkpoint_id=checkpoint_id, async_checkpointer_type=executor
        )
    done: Future[Any] = Future()
    try:
        done.set_result(dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        done.set_exception(e)
    return done


def _judge(call: Call, loader: _Loader) -> None:
    """A call whose checkpoint must hold its own state now."""
    found = loader.difference(call.uri, call.expected)  # every rank loads, whatever its future said
    if call.succeeded:
        call.outcome = f"WRONG: reported success, but {found}" if found else "ok"


def _judge_one_uri(calls: list[Call], loader: _Loader) -> None:
    """Every call saved to one URI: it must hold the state of a call that
    succeeded (which one commits last is the executor's timing)."""
    uri = calls[0].uri
    verdicts = [loader.difference(uri, call.expected) for call in calls]
    holds = [call.index for call, found in zip(calls, verdicts) if found is None]
    for call in calls:
        if call.succeeded:
            call.outcome = "ok"
    if not any(calls[i].succeeded for i in holds):
        last = max((c for c in calls if c.succeeded), key=lambda c: c.index, default=None)
        why = verdicts[last.index] if last is not None else "no call succeeded"
        for call in calls:
            if call.succeeded:
                call.outcome = f"WRONG: {uri} holds no succeeded call's state ({why})"


def describe(calls: list[Call]) -> str:
    return "; ".join(f"call {c.index} {c.outcome}" for c in calls)


def wrong(calls: list[Call]) -> list[Call]:
    return [c for c in calls if c.outcome.startswith("WRONG")]


def check(calls: list[Call], pattern: Pattern, label: str) -> None:
    """dcpstore's floor for ``pattern``: no silent success ever; every call
    succeeds where the calls cannot contend (each its own URI, or each
    waited for); at the one URI, at least the call that claimed it last."""
    assert not wrong(calls), f"{label} {pattern}: {describe(calls)}"
    if pattern.repoint or pattern.wait:
        assert all(c.outcome == "ok" for c in calls), f"{label} {pattern}: {describe(calls)}"
    else:
        assert any(c.outcome == "ok" for c in calls), f"{label} {pattern}: {describe(calls)}"
