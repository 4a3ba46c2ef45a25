"""Shared pieces of the async-save suites (test_async.py, test_engines.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
from dcpstore._impl.engines import nvrx as nvrx_adapter
from dcpstore._impl.engines.engine import engine_class
from dcpstore._impl.values.options import ENGINES as ALL_ENGINES
from tests.support import extras
from tests.support.backends import Target

ENGINES = tuple(ALL_ENGINES)
#: Engines whose cases run in the quick suite wherever a suite runs every
#: engine; the process engine starts a checkpoint process per saver
#: (seconds each on a small box): a sample of its cases is quick (each
#: suite says which), the rest run in the slow run.
QUICK_ENGINES = ("native", "nvrx")


def engine_params(quick: tuple[str, ...] = QUICK_ENGINES) -> list[Any]:
    """:data:`ENGINES` for ``parametrize``: those not in ``quick`` marked slow."""
    return [e if e in quick else pytest.param(e, marks=pytest.mark.slow) for e in ENGINES]


def open_target(target: Target) -> dcpstore.storage.Storage:
    return dcpstore.open_storage(target.uri, **target.kwargs)


def skip_unless_engine_serves(engine: str, target: Target) -> None:
    """Skip the cases of an engine on the targets it cannot write (NVRx:
    native S3 and fsspec; the process engine: ``memory://``), as
    :mod:`extras`' tables say, not as the engine does: the engine's own
    answer must agree with the table."""
    if engine == "native":
        return
    if engine == "nvrx":
        extras.skip_unless(extras.NVRX)
        assert nvrx_adapter.import_error() is None, nvrx_adapter.import_error()  # NVRx imports: the engine must see it
        serves = target.name in extras.NVRX_TARGETS
    else:
        serves = target.name not in extras.PROCESS_REFUSED
    storage = open_target(target)
    try:
        why = engine_class(engine).target_problem(storage.backend, storage.uri)
    finally:
        storage.close()
    assert serves == (why is None), f"{engine} on {target.name}: the table says {serves}, the engine says {why!r}"
    if not serves:
        pytest.skip(f"the {engine} engine cannot write the {target.name} target: {why}")


class FileEvent:
    """``threading.Event``'s ``set`` / ``is_set`` / ``wait`` across processes:
    set once its file exists (pickled, it is the same event in the process
    engine's checkpoint process)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def set(self) -> None:
        open(self.path, "w").close()

    def is_set(self) -> bool:
        return os.path.exists(self.path)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


class GatedPlanner(DefaultSavePlanner):
    """DCP's default planner that holds the background save at a chosen point
    until the test opens the gate, so the test knows exactly what has run.

    ``at="setup"`` stops before planning (nothing written, nothing retracted);
    ``at="resolve"`` stops at the first data item, i.e. after the old commit
    was retracted and before any data file is written. Its events are
    files, so it holds a save in another process too (the process engine's).
    """

    def __init__(self, at: str = "setup") -> None:
        super().__init__()
        self.at = at
        where = tempfile.mkdtemp(prefix="dcpstore-gate-")
        weakref.finalize(self, shutil.rmtree, where, True)  # here only: a pickled copy runs no __init__
        self.reached = FileEvent(os.path.join(where, "reached"))
        self.gate = FileEvent(os.path.join(where, "gate"))

    def _stop(self, where: str) -> None:
        if where == self.at and not self.reached.is_set():
            self.reached.set()
            assert self.gate.wait(60), "test never opened the gate"

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        self._stop("setup")
        super().set_up_planner(*args, **kwargs)

    def resolve_data(self, write_item: Any) -> Any:
        self._stop("resolve")
        return super().resolve_data(write_item)


def mixed_state() -> dict[str, Any]:
    """Several dtypes, views of larger storages, a permuted tensor, a tied
    tensor, nested containers and plain values."""
    base = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    tied = torch.randn(33)
    return {
        "f32": torch.randn(256, 17),
        "bf16": torch.randn(128, 8).to(torch.bfloat16),
        "f16": torch.randn(7, 9).to(torch.float16),
        "i64": torch.arange(1000, dtype=torch.int64),
        "u8": torch.randint(0, 255, (513,), dtype=torch.uint8),
        "bool": torch.rand(77) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "slice_view": base[10:20],
        "strided_view": base[:, ::3],
        "transposed": torch.randn(12, 40).t(),
        "tied_a": tied,
        "tied_b": tied,
        "nested": {"inner": torch.ones(5, 5), "list": [torch.zeros(3), 4, "text"]},
        "meta": {"step": 10, "lr": 0.1, "name": "run"},
    }


def snapshot(obj: Any) -> Any:
    """An independent copy to compare against later."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    return obj


def mutate(state: dict[str, Any]) -> None:
    """What the next optimizer step does: change every tensor in place, and
    the plain values too."""
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) in seen or obj.numel() == 0:
                return
            seen.add(id(obj))
            if obj.dtype == torch.bool:
                obj.logical_not_()
            else:
                obj.add_(1)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(state)
    state["meta"]["step"] = 11
    state["nested"]["list"][1] = 5


def zeros_like_state(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return {k: zeros_like_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [zeros_like_state(v) for v in obj]
    return None


def assert_same(got: Any, want: Any, path: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.equal(got, want), path
    elif isinstance(want, dict):
        for k, v in want.items():
            assert_same(got[k], v, f"{path}.{k}")
    elif isinstance(want, list):
        for i, v in enumerate(want):
            assert_same(got[i], v, f"{path}[{i}]")
    else:
        assert got == want, path
