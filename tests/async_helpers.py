"""Shared pieces of the async-save suites (test_async.py, test_engines.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
import extras
from backends import Target
from dcpstore.engines import nvrx as nvrx_adapter

ENGINES = ("native", "nvrx")


def open_target(target: Target) -> dcpstore.storage.Storage:
    return dcpstore.open_storage(target.uri, **target.kwargs)


def skip_unless_engine_serves(engine: str, target: Target) -> None:
    """Skip NVRx cases on the targets NVRx cannot write (native S3, fsspec),
    as :data:`extras.NVRX_TARGETS` says, not as the engine does: the
    engine's own answer (``target_for``) must agree with the table."""
    if engine != "nvrx":
        return
    extras.skip_unless(extras.NVRX)
    assert nvrx_adapter.import_error() is None, nvrx_adapter.import_error()  # NVRx imports: the engine must see it
    storage = open_target(target)
    try:
        why = nvrx_adapter.target_for(storage)
    finally:
        storage.close()
    serves = target.name in extras.NVRX_TARGETS
    assert serves != isinstance(why, str), f"NVRx on {target.name}: the table says {serves}, the engine says {why!r}"
    if not serves:
        pytest.skip(f"NVRx writes only POSIX paths and MSC URLs, not the {target.name} target")


class GatedPlanner(DefaultSavePlanner):
    """DCP's default planner that holds the background save at a chosen point
    until the test opens the gate, so the test knows exactly what has run.

    ``at="setup"`` stops before planning (nothing written, nothing retracted);
    ``at="resolve"`` stops at the first data item, i.e. after the old commit
    was retracted and before any data file is written.
    """

    def __init__(self, at: str = "setup") -> None:
        super().__init__()
        self.at = at
        self.reached = threading.Event()
        self.gate = threading.Event()

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
