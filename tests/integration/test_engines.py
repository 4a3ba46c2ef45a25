"""Engine selection on every backend (auto / native / nvrx / process),
fallbacks and their warnings, and what the NVRx engine writes: stock layout,
dcpstore's manifest, MSC. What auto prefers, per storage kind and host, is
tests/unit/test_engine_selection.py's."""

from __future__ import annotations

import gc
import io
import json
import multiprocessing
import os
import sys
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
from dcpstore._impl.engines import nvrx as nvrx_adapter
from dcpstore._impl.engines import selection
from dcpstore._impl.engines.engine import engine_class
from dcpstore._impl.engines.process import ProcessEngine
from dcpstore._impl.engines.selection import auto_engine
from dcpstore._impl.engines.staging import Stager
from dcpstore._impl.util.errors import BackendUnavailable, CheckpointCorrupt, EngineFallbackWarning, InvalidArgument
from dcpstore._impl.values.options import ENGINE_CHOICES, ENGINES
from tests.support.async_helpers import open_target
from tests.support.backends import Target, make_target
from tests.support.extras import NVRX, missing, needs_nvrx


@pytest.fixture
def no_nvrx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make nvidia-resiliency-ext unimportable, as if it were not installed
    (a None entry in sys.modules makes ``import`` raise ImportError)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "nvidia_resiliency_ext"] + ["nvidia_resiliency_ext"]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def process_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make engine="auto" prefer the process engine for every storage (as
    for an object store on a host with 16 cores)."""
    monkeypatch.setattr(selection, "storage_kind", lambda backend, uri: "object store")
    monkeypatch.setattr(selection, "usable_cores", lambda: 16)


def _fallback_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, EngineFallbackWarning)]


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_registry_row_names_an_engine_of_that_name(name: str) -> None:
    """The registry's rows each import a class that says it is that row and
    has every member of the Engine protocol."""
    cls = engine_class(name)
    assert cls.name == name
    assert isinstance(cls.shared_staging, bool)
    for member in ("unavailable", "target_problem", "save", "close"):
        assert callable(getattr(cls, member, None)), f"{cls.__qualname__} lacks {member}"
    reason = cls.unavailable()
    assert reason is None or (isinstance(reason, str) and reason), reason  # None, or a reason to show
    assert cls.target_problem("local", "/tmp/x") is None  # every engine writes local paths


def test_engine_choices_are_auto_and_the_registry_rows() -> None:
    assert ENGINE_CHOICES == ("auto", *ENGINES)


def test_unknown_engine_is_refused(local_target: Target) -> None:
    with pytest.raises(InvalidArgument, match="engine must be one of auto, native, nvrx"):
        dcpstore.save({"w": torch.ones(1)}, local_target.uri, async_=True, engine="turbo")


def test_explicit_nvrx_without_nvrx_raises_with_install_hint(local_target: Target, no_nvrx: None) -> None:
    with pytest.raises(BackendUnavailable, match=r"pip install 'dcpstore\[nvrx\]'"):
        dcpstore.save({"w": torch.ones(1)}, local_target.uri, async_=True, engine="nvrx")
    assert not os.path.exists(local_target.uri)  # nothing was written, sync or async


def test_auto_falls_back_to_native_with_one_warning(
    local_target: Target, monkeypatch: pytest.MonkeyPatch, process_preferred: None
) -> None:
    monkeypatch.setattr(ProcessEngine, "unavailable", classmethod(lambda cls: "no checkpoint processes here"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = dcpstore.save({"w": torch.ones(3)}, local_target.uri, async_=True)
        info = handle.result(timeout=60)
    messages = _fallback_warnings(record)
    assert len(messages) == 1, messages
    assert "no checkpoint processes here" in messages[0] and "engine='native'" in messages[0]
    assert record[0].filename == __file__  # points at the caller's line
    assert info.engine == "native" and handle.engine == "native"
    assert "no checkpoint processes here" in info.engine_reason
    loaded = {"w": torch.zeros(3)}
    dcpstore.load(loaded, local_target.uri)
    assert torch.equal(loaded["w"], torch.ones(3))


def test_explicit_native_never_warns(local_target: Target) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dcpstore.save({"w": torch.ones(3)}, local_target.uri, async_=True, engine="native").result(timeout=60)
    assert _fallback_warnings(record) == []


@needs_nvrx
def test_auto_uses_native_threads_on_a_local_path_even_with_nvrx(local_target: Target) -> None:
    """NVRx's threads cost a training step more than the native engine's on
    both measured hosts (BENCHMARKS.md): auto leaves NVRx to an explicit
    engine='nvrx'."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handle = dcpstore.save({"w": torch.ones(3)}, local_target.uri, async_=True)
        assert handle.result(timeout=60).engine == "native"
    assert _fallback_warnings(record) == []


def test_engine_choice_on_every_backend(target: Target) -> None:
    """auto saves with the engine it prefers for the backend on this host,
    silently; explicit nvrx is refused where NVRx cannot write (naming
    enable_msc and engine='native') before anything is written."""
    storage = open_target(target)
    order, _ = auto_engine(storage.backend, storage.uri)
    reason = nvrx_adapter.target_for(storage)
    storage.close()
    state = {"w": torch.arange(6.0)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        info = dcpstore.save(state, target.uri, async_=True, **target.kwargs).result(timeout=120)
    assert info.engine == order[0] and info.engine_reason.startswith("engine='auto': ")
    assert _fallback_warnings(record) == []
    if not isinstance(reason, str) or missing(NVRX) is not None:
        return
    other = target.child("refused")
    with pytest.raises(InvalidArgument, match=r"enable_msc=True.*engine='native'"):
        dcpstore.save(state, other.uri, async_=True, engine="nvrx", **other.kwargs)
    with pytest.raises(dcpstore.CheckpointNotFound):
        dcpstore.load({"w": torch.zeros(6)}, other.uri, **other.kwargs)


def test_auto_saves_to_s3_through_a_checkpoint_process_on_a_large_host(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a host with the cores for it (16 here, as on the measured GPU
    machine), auto writes an object store from a checkpoint process, and
    what it wrote loads back."""
    target = make_target("s3", request)
    monkeypatch.setattr(selection, "usable_cores", lambda: 16)
    state = {"w": torch.arange(6.0)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with dcpstore.AsyncSaver() as saver:
            info = saver.save(state, target.uri, options=target.save_options()).result(timeout=180)
    assert _fallback_warnings(record) == []
    assert info.engine == "process", info
    assert info.engine_reason.startswith("engine='auto': an object store with 16 cores")
    loaded = {"w": torch.zeros(6)}
    dcpstore.load(loaded, target.uri, **target.kwargs)
    assert torch.equal(loaded["w"], state["w"])


@needs_nvrx
def test_nvrx_refuses_native_s3_naming_the_alternatives() -> None:
    pytest.importorskip(
        "dcpstore._impl.storage.backends.s3.storage", reason="the native S3 backend is not in this tree"
    )
    with pytest.raises(InvalidArgument, match=r"s3.*enable_msc=True.*engine='native'"):
        dcpstore.save({"w": torch.ones(1)}, "s3://some-bucket/ckpt", async_=True, engine="nvrx")


@needs_nvrx
def test_nvrx_checkpoint_is_stock_dcp_with_a_verified_manifest(local_target: Target) -> None:
    uri = local_target.uri
    state = {"a": torch.randn(128, 64), "b": torch.arange(500), "meta": {"step": 5}}
    info = dcpstore.save(state, uri, async_=True, engine="nvrx", workers=2).result(timeout=60)
    manifest = json.loads(open(os.path.join(uri, ".dcpstore.json")).read())
    assert set(manifest["files"]) == set(info.files) == {"__0_0.distcp", "__0_1.distcp"}
    for name, entry in manifest["files"].items():
        assert entry["size"] == os.path.getsize(os.path.join(uri, name))
    # Stock DCP reads it.
    plain = {"a": torch.zeros(128, 64), "b": torch.zeros(500, dtype=torch.long)}
    dcp.load(plain, checkpoint_id=uri)
    assert torch.equal(plain["a"], state["a"]) and torch.equal(plain["b"], state["b"])
    # dcpstore verifies it: one flipped byte in a data file is caught.
    victim = os.path.join(uri, "__0_0.distcp")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="__0_0.distcp"):
        dcpstore.load({"a": torch.zeros(128, 64), "b": torch.zeros(500, dtype=torch.long), "meta": {"step": 0}}, uri)


@needs_nvrx
def test_nvrx_writes_through_msc_when_asked(local_target: Target) -> None:
    """NVRx's use_msc path (msc.open + stream.fsync) end to end, on MSC's
    POSIX profile; dcpstore's commit and manifest stay the same."""
    pytest.importorskip("multistorageclient")
    from dcpstore._impl.engines.nvrx import nvrx_save

    storage = dcpstore.open_storage(local_target.uri)
    state = {"a": torch.randn(40, 40), "b": torch.ones(7)}
    staged = Stager().stage(state)
    stats = nvrx_save(
        staged.state_dict,
        storage,
        workers=2,
        process_group=None,
        planner=None,
        cache=None,
        target=nvrx_adapter.NvrxTarget(storage.url.path, use_msc=True),
    )
    assert stats.bytes_written > 0 and len(stats.files) == 2
    loaded: dict[str, Any] = {"a": torch.zeros(40, 40), "b": torch.zeros(7)}
    dcpstore.load(loaded, local_target.uri)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])


class _ProbeBytes(io.BytesIO):
    """A byte item that records, while NVRx writes it, whether the garbage
    collector is enabled."""

    seen: list[bool] = []

    def getbuffer(self) -> memoryview:
        self.seen.append(gc.isenabled())
        return super().getbuffer()


class _ProbePlanner(DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        return _ProbeBytes(data.getvalue()) if isinstance(data, io.BytesIO) else data


@needs_nvrx
def test_nvrx_runs_without_forks_or_gc_switches(local_target: Target) -> None:
    """The NVRx engine must not fork, start NVRx's spawn Manager, or switch
    off the process-wide garbage collector from its writer threads (NVRx
    wraps its writer in gc.disable() for forked children)."""
    before = set(multiprocessing.active_children())
    _ProbeBytes.seen.clear()
    assert gc.isenabled()
    state = {"w": torch.ones(1000), "meta": {"step": 1}}
    dcpstore.save(state, local_target.uri, async_=True, engine="nvrx", workers=3, planner=_ProbePlanner()).result(
        timeout=60
    )
    assert _ProbeBytes.seen == [True]  # written by NVRx's writer, with GC left on
    assert set(multiprocessing.active_children()) == before


def test_auto_fallback_warning_is_shown_once_per_call_site(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, process_preferred: None
) -> None:
    """Saving every N steps to new URIs must not repeat the warning: its text
    names the reason, not the URI, so the default filter shows it once."""
    monkeypatch.setattr(ProcessEngine, "unavailable", classmethod(lambda cls: "no checkpoint processes here"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for step in range(3):
            dcpstore.save({"w": torch.ones(2)}, str(tmp_path / f"step{step}"), async_=True).result(timeout=60)
    assert len(_fallback_warnings(record)) == 1
