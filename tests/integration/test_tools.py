"""The supported surface beyond ``dcpstore``: ``dcpstore.tools`` (ls,
inspect, verify, gc and commit files as functions of a URI) and
``dcpstore.storage.register_backend`` (a URI scheme served by a backend of
the user's own), each through every path a user takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore import tools
from dcpstore._impl.storage import backend_registry as registry
from dcpstore.storage import Storage, open_storage, register_backend
from tests.support.dist_utils import run_ranks
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.user_backend import ROOT_VARIABLE, MirrorStorage


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10)}


# -- dcpstore.tools ------------------------------------------------------------------


def test_ls_and_gc_never_import_torch(tmp_path: Path) -> None:
    dcpstore.save(_state(), str(tmp_path / "run" / "step1"))
    (tmp_path / "run" / "step2").mkdir()
    (tmp_path / "run" / "step2" / "__0_0.distcp").write_bytes(b"half a save")
    code = (
        "import sys; from dcpstore import tools\n"
        f"entries = tools.ls({str(tmp_path / 'run')!r})\n"
        "print(sorted((e.path, e.committed) for e in entries))\n"
        f"print(tools.gc({str(tmp_path / 'run')!r}, older_than_s=0).removed)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines() == ["[('step1', True), ('step2', False)]", "['step2']", "False"], (
        out.stdout + out.stderr
    )
    assert not (tmp_path / "run" / "step2").exists() and (tmp_path / "run" / "step1" / ".metadata").exists()


def test_inspect_verify_and_commit_file(tmp_path: Path) -> None:
    uri = str(tmp_path / "ck")
    dcp.save(_state(), storage_writer=dcpstore.StorageWriter(uri, commit_files={"meta.pt": b"lightning's meta"}))
    info = tools.inspect(uri)
    assert {"__0_0.distcp", "meta.pt"} <= set(info["files"]) and {"w", "b"} <= set(map(str, info["keys"]))
    report = tools.verify(uri)
    assert report.ok and report.files_checked == len(info["files"]) and report.checksums, report
    assert tools.commit_file(uri, "meta.pt") == b"lightning's meta"
    with pytest.raises(dcpstore.CheckpointNotFound, match="does not record"):
        tools.commit_file(uri, "other.pt")
    (Path(uri) / "meta.pt").write_bytes(b"lightning's meda")  # the recorded copy, changed
    with pytest.raises(dcpstore.CheckpointCorrupt, match="meta.pt"):
        tools.commit_file(uri, "meta.pt")
    data = Path(uri) / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    blob[-100] ^= 0xFF
    data.write_bytes(bytes(blob))
    assert not tools.verify(uri).ok


def test_tools_name_the_uri_they_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(dcpstore.CheckpointNotFound, match=str(tmp_path / "none")):
        tools.verify(str(tmp_path / "none"))
    with pytest.raises(dcpstore.InvalidURI, match="nosuchscheme"):
        tools.ls("nosuchscheme://x/y")


# -- register_backend ----------------------------------------------------------------


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """mirror:// registered for this test only, rooted in a fresh directory."""
    monkeypatch.setattr(registry, "_REGISTERED", {})
    monkeypatch.setattr(registry, "_CLASSES", {})
    monkeypatch.setenv(ROOT_VARIABLE, str(tmp_path / "mirror-root"))
    register_backend("mirror", MirrorStorage, summary="a test's own backend")
    return tmp_path / "mirror-root"


@pytest.mark.parametrize("engine", ["sync", "native", "process"])
def test_a_registered_scheme_serves_save_load_and_the_tools(mirror: Path, engine: str) -> None:
    """Every entry point opens the registered scheme with the user's class,
    the process engine's checkpoint process too (it is told the registrations)."""
    uri = "mirror://bucket/run/step1"
    storage = open_storage(uri)
    assert isinstance(storage, MirrorStorage) and isinstance(storage, Storage)
    state = _state(1)
    if engine == "sync":
        dcpstore.save(state, uri).result()
    else:
        dcpstore.save(state, uri, async_=True, engine=engine).result(timeout=120)
    assert (mirror / "bucket" / "run" / "step1" / ".metadata").exists()
    restored = zeros_like_state(state)
    dcpstore.load(restored, uri)
    assert_state_equal(state, restored)
    assert tools.verify(uri).ok
    assert [e.path for e in tools.ls("mirror://bucket/run")] == ["step1"]


def test_a_registered_scheme_under_dcps_process_executor(tmp_path: Path) -> None:
    """DCP's process executor unpickles the drop-in writer in a process of its
    own, which never registered anything: the registration travels with it."""
    run_ranks(_save_through_the_process_executor, 1, str(tmp_path / "mirror-root"), timeout=300)
    assert (tmp_path / "mirror-root" / "bucket" / "dcp" / ".metadata").exists()


def _save_through_the_process_executor(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ[ROOT_VARIABLE] = root
    register_backend("mirror", MirrorStorage)
    uri = "mirror://bucket/dcp"
    state = _state(2)
    writer = dcpstore.StorageWriter(uri)
    dcp.async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(
        timeout=240
    )
    restored = zeros_like_state(state)
    dcp.load(restored, storage_reader=dcpstore.StorageReader(uri))
    assert_state_equal(state, restored)


@pytest.mark.parametrize(
    "scheme, target, match",
    [
        ("s3", MirrorStorage, "built-in s3 backend"),
        ("file", MirrorStorage, "built-in local backend"),
        ("Mirror", MirrorStorage, "lower-case URI scheme"),
        ("", MirrorStorage, "lower-case URI scheme"),
        ("1x", MirrorStorage, "lower-case URI scheme"),
        ("mirror", object, "Storage subclass or 'module:Class'"),
        ("mirror", "no_colon", "Storage subclass or 'module:Class'"),
    ],
)
def test_register_backend_refuses_what_cannot_be_one(
    monkeypatch: pytest.MonkeyPatch, scheme: str, target: object, match: str
) -> None:
    monkeypatch.setattr(registry, "_REGISTERED", {})
    with pytest.raises(dcpstore.InvalidArgument, match=match):
        register_backend(scheme, target)  # type: ignore[arg-type]
    assert registry.registered_backends() == {}


def test_a_second_registration_needs_clobber_and_a_named_class_imports_at_first_use(
    mirror: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_backend("mirror", MirrorStorage)  # the same again: fine
    with pytest.raises(dcpstore.InvalidArgument, match="clobber=True"):
        register_backend("mirror", "tests.support.user_backend:Other")
    register_backend("mirror", "no_such_module_of_ours:Backend", clobber=True)
    with pytest.raises(dcpstore.BackendUnavailable, match="no_such_module_of_ours"):
        open_storage("mirror://bucket/x")
    register_backend("mirror", "tests.support.user_backend:MirrorStorage", clobber=True)
    assert isinstance(open_storage("mirror://bucket/x"), MirrorStorage)
