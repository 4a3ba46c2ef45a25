"""What engine="auto" chooses, from the storage's kind, the cores and CUDA.

The choice is a pure function (``auto_preference``), held here without
timing anything; the measurements it follows are BENCHMARKS.md's
interference runs. One real save checks that the choice and its reason
reach the CheckpointInfo and the save's INFO line.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.engines import selection
from dcpstore._impl.engines.process import ProcessEngine
from dcpstore._impl.engines.selection import (
    PROCESS_MIN_CORES,
    auto_preference,
    select_engine,
    storage_kind,
)
from dcpstore._impl.values.options import ENGINES


@pytest.mark.parametrize(
    "backend, uri, kind",
    [
        ("local", "/ckpt/step1", "local"),
        ("fsspec", "file:///ckpt/step1", "local"),
        ("fsspec", "memory://ckpt/step1", "local"),
        ("s3", "s3://bucket/step1", "object store"),
        ("msc", "msc://profile/step1", "object store"),
        ("msc", "s3://bucket/step1", "object store"),  # s3:// with enable_msc=True
        ("fsspec", "gs://bucket/step1", "object store"),
        ("fsspec", "az://container/step1", "object store"),
    ],
)
def test_storage_kind(backend: str, uri: str, kind: str) -> None:
    assert storage_kind(backend, uri) == kind


@pytest.mark.parametrize(
    "kind, cores, cuda, engine",
    [
        # Object stores: the checkpoint process where the host has the cores for it.
        ("object store", 16, True, "process"),
        ("object store", 2, True, "process"),  # CUDA: the training step is GIL-bound dispatch
        ("object store", PROCESS_MIN_CORES, False, "process"),
        ("object store", 64, False, "process"),
        ("object store", PROCESS_MIN_CORES - 1, False, "native"),
        ("object store", 2, False, "native"),  # the 2-core run: the process lost more step time
        ("object store", 1, False, "native"),
        # Local storage: threads, whatever the host.
        ("local", 2, False, "native"),
        ("local", 16, True, "native"),
        ("local", 128, False, "native"),
    ],
)
def test_auto_preference(kind: Any, cores: int, cuda: bool, engine: str) -> None:
    order, reason = auto_preference(kind, cores, cuda)
    assert order[0] == engine
    assert order[-1] == "native"  # the last resort writes every backend
    assert set(order) <= set(ENGINES)
    assert kind in reason
    if kind == "object store":  # the reason names what decided it
        assert ("CUDA" in reason) if cuda else (f"{cores} core" in reason)


def _fake_storage(backend: str, uri: str) -> Any:
    return SimpleNamespace(backend=backend, uri=uri)


def _host(monkeypatch: pytest.MonkeyPatch, cores: int, cuda: bool) -> None:
    monkeypatch.setattr(selection, "usable_cores", lambda: cores)
    monkeypatch.setattr(selection, "cuda_in_use", lambda: cuda)


@pytest.mark.parametrize("cores, cuda, engine", [(16, False, "process"), (2, True, "process"), (2, False, "native")])
def test_select_engine_follows_the_host(monkeypatch: pytest.MonkeyPatch, cores: int, cuda: bool, engine: str) -> None:
    _host(monkeypatch, cores, cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the preferred engine runs: no warning
        choice = select_engine("auto", _fake_storage("s3", "s3://bucket/step1"))
    assert choice.name == engine
    assert choice.reason.startswith("engine='auto': an object store")


def test_explicit_engine_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, 2, False)
    choice = select_engine("process", _fake_storage("s3", "s3://bucket/step1"))
    assert (choice.name, choice.reason) == ("process", "engine='process' was passed")


def test_auto_falls_back_from_the_process_engine_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    _host(monkeypatch, 16, True)
    monkeypatch.setattr(ProcessEngine, "unavailable", classmethod(lambda cls: "no checkpoint processes here"))
    with pytest.warns(dcpstore.EngineFallbackWarning) as record:
        choice = select_engine("auto", _fake_storage("s3", "s3://bucket/step1"))
    assert len(record) == 1
    message = str(record[0].message)
    assert "instead of process" in message and "no checkpoint processes here" in message
    assert choice.name == "native"
    assert "process preferred" in choice.reason and "no checkpoint processes here" in choice.reason


def test_async_save_reports_engine_and_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real background save to a local directory with the defaults: the
    native engine, for the reason auto gives, in the info and the log."""
    caplog.set_level(logging.INFO, logger="dcpstore")
    with warnings.catch_warnings():
        warnings.simplefilter("error", dcpstore.EngineFallbackWarning)
        handle = dcpstore.save({"w": torch.arange(4.0)}, str(tmp_path / "step1"), async_=True)
        info = handle.result(timeout=60)
    assert info.engine == "native" and handle.engine == "native"
    assert info.engine_reason == "engine='auto': local storage: threads cost the training loop least"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved ")]
    assert len(lines) == 1 and lines[0].endswith(f"[local, native: {info.engine_reason}]"), lines


def test_sync_save_reports_its_reason(tmp_path: Path) -> None:
    info = dcpstore.save({"w": torch.ones(2)}, str(tmp_path / "step1")).result()
    assert info.engine == "sync" and "synchronous" in info.engine_reason


def test_manager_saves_choose_as_save_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CheckpointManager's saves go through the same choice: with auto
    told the root is an object store on 2 cores, threads, saying why."""
    monkeypatch.setattr(selection, "storage_kind", lambda backend, uri: "object store")
    _host(monkeypatch, 2, False)
    with dcpstore.CheckpointManager(str(tmp_path / "run"), async_=True) as manager:
        info = manager.save({"w": torch.ones(2)}, 1).result(timeout=60)
    assert info.engine == "native"
    assert info.engine_reason.startswith("engine='auto': an object store on 2 core(s) (< 8) without CUDA")
