"""Checkpoints written by every peer's own DCP writer load with no opt-in.

Each peer writes with its real writer, as its users call it: stock
``FileSystemWriter`` and fsspec's ``FsspecWriter`` (``dcp.save``), MSC's
``MultiStorageFileSystemWriter`` on its POSIX profile and on S3 (moto),
s3torchconnector's ``S3StorageWriter`` (moto), and NVRx's
``FileSystemWriterAsync`` driven as Megatron drives it
(``save_state_dict_async_plan``, ``get_save_function_and_args``, an
``AsyncRequest``, ``save_state_dict_async_finalize``) on two gloo ranks.
``dcpstore.load`` then reads every value exactly and ``dcpstore verify``
says OK, neither with ``safe_globals`` or ``trusted``: whatever a peer's
writer records in ``.metadata`` (its path classes in ``storage_meta``) is
data, read without running its code.
"""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import dcpstore
from dcpstore._impl.format.peer_paths import PeerPath
from dcpstore._impl.format.safe_pickle import TOOLS, load_metadata
from dcpstore._impl.util.errors import CheckpointCorrupt
from tests.support.cli_run import run_cli
from tests.support.dist_utils import run_ranks
from tests.support.helpers import assert_state_equal, zeros_like_state


def _state(rank: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 33, generator=g),
        "h": torch.randn(17, 5, generator=g).bfloat16(),
        "i": torch.arange(50, dtype=torch.int64),
        "nested": {"b": torch.ones(3, dtype=torch.bool)},
        "step": 1234,
        "lr": [0.1, 0.01],
        f"rank{rank}": torch.full((4,), float(rank)),
    }


def _expected(ranks: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in range(ranks):
        out.update(_state(r))
    return out


#: A written checkpoint: the URI dcpstore reads it at, and how many ranks wrote it.
Written = tuple[str, int]


def _stock_local(request: pytest.FixtureRequest, tmp_path: Path) -> Written:
    uri = str(tmp_path / "stock")
    dcp.save(_state(), storage_writer=FileSystemWriter(uri), no_dist=True)
    return uri, 1


def _stock_fsspec(request: pytest.FixtureRequest, tmp_path: Path) -> Written:
    import fsspec
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    name = f"peer-{uuid.uuid4().hex[:8]}"
    request.addfinalizer(lambda: fsspec.filesystem("memory").rm(f"/{name}", recursive=True))
    uri = f"memory://{name}"
    dcp.save(_state(), storage_writer=FsspecWriter(uri), no_dist=True)
    return uri, 1


def _stock_fsspec_local(request: pytest.FixtureRequest, tmp_path: Path) -> Written:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    path = tmp_path / "fsspec"
    dcp.save(_state(), storage_writer=FsspecWriter(f"file://{path}"), no_dist=True)
    return str(path), 1


def _msc_writer(uri: str) -> Any:
    from multistorageclient.contrib.torch.filesystem import MultiStorageFileSystemWriter

    return MultiStorageFileSystemWriter(uri)


def _msc_posix(request: pytest.FixtureRequest, tmp_path: Path) -> Written:
    uri = str(tmp_path / "msc")
    dcp.save(_state(), storage_writer=_msc_writer(uri), no_dist=True)
    return uri, 1


def _s3_key(request: pytest.FixtureRequest) -> tuple[Any, str]:
    """The session's S3 endpoint and a fresh key prefix, deleted when the test ends."""
    endpoint = request.getfixturevalue("s3_endpoint")
    key = f"peer-{uuid.uuid4().hex[:8]}"
    request.addfinalizer(lambda: endpoint.delete_prefix(f"{key}/"))
    return endpoint, key


def _msc_s3(request: pytest.FixtureRequest, tmp_path: Path) -> Written:
    profile = request.getfixturevalue("msc_config")
    _, key = _s3_key(request)
    uri = f"msc://{profile}/{key}"
    dcp.save(_state(), storage_writer=_msc_writer(uri), no_dist=True)
    return uri, 1


def _s3torchconnector(request: pytest.FixtureRequest, tmp_path: Path) -> Written:
    s3_dcp = pytest.importorskip("s3torchconnector.dcp")
    from s3torchconnector._s3client import S3Client, S3ClientConfig
    from s3torchconnector.dcp.s3_file_system import S3FileSystem

    endpoint, key = _s3_key(request)
    uri = f"s3://{endpoint.bucket}/{key}"
    region = os.environ["AWS_REGION"]
    writer = s3_dcp.S3StorageWriter(region, uri)
    # S3StorageWriter takes no endpoint; its file system takes a client that does.
    client = S3Client(region, endpoint=endpoint.url, s3client_config=S3ClientConfig(force_path_style=True))
    writer.fs = S3FileSystem(region, s3_client=client)
    dcp.save(_state(), storage_writer=writer, no_dist=True)
    return uri, 1


def _nvrx_rank(rank: int, world: int, uri: str, use_msc: bool) -> None:
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )

    # Megatron's TorchDistSaveShardedStrategy.async_save, then its sync path
    # (AsyncRequest.execute_sync); the preload copies without non_blocking,
    # which would wait on CUDA.
    writer = FileSystemWriterAsync(uri, thread_count=2, use_msc=use_msc)
    plan = save_state_dict_async_plan(_state(rank), writer, None, 0)
    save_fn, _, save_args = writer.get_save_function_and_args()
    preload = functools.partial(writer.preload_tensors, writer.write_buckets, False)
    finalize = functools.partial(save_state_dict_async_finalize, *plan)
    AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload).execute_sync()
    dist.barrier()


def _nvrx(request: pytest.FixtureRequest, tmp_path: Path, use_msc: bool = False) -> Written:
    pytest.importorskip("nvidia_resiliency_ext")
    uri = str(tmp_path / "nvrx")
    run_ranks(_nvrx_rank, 2, uri, use_msc)
    return uri, 2


#: peer -> writes ``_state`` with that peer's writer; returns where and on how many ranks.
PEERS: dict[str, Callable[[pytest.FixtureRequest, Path], Written]] = {
    "stock-local": _stock_local,
    "stock-fsspec-memory": _stock_fsspec,
    "stock-fsspec-local": _stock_fsspec_local,
    "msc-posix": _msc_posix,
    "msc-s3": _msc_s3,
    "s3torchconnector": _s3torchconnector,
    "nvrx-megatron": _nvrx,
    "nvrx-megatron-msc": functools.partial(_nvrx, use_msc=True),  # Megatron's --enable-msc
}


#: Peers whose writer another quick peer already reads through: Megatron's
#: --enable-msc writes what NVRx's POSIX writer does, through MSC (read
#: through MSC quick as msc-posix and msc-s3).
SLOW_PEERS = {"nvrx-megatron-msc"}


@pytest.fixture(
    scope="module", params=[pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PEERS else p for p in PEERS]
)
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Written:
    """Each peer's checkpoint, written once for the tests that only read it."""
    return PEERS[request.param](request, tmp_path_factory.mktemp(request.param))


def test_a_peers_checkpoint_loads_exactly_with_no_opt_in(written: Written) -> None:
    uri, ranks = written
    want = _expected(ranks)
    got = zeros_like_state(want)
    dcpstore.load(got, uri)
    assert_state_equal(want, got)


def test_verify_passes_a_peers_checkpoint(written: Written) -> None:
    uri, _ = written
    out = run_cli("verify", uri, "-q")
    assert out.returncode == 0 and out.stdout.startswith("OK"), out.stdout + out.stderr
    assert run_cli("inspect", uri, "--json").returncode == 0


def _msc_metadata(tmp_path: Path, protocol: int | None = None) -> tuple[str, bytes]:
    uri = str(tmp_path / "msc")
    dcp.save(_state(), storage_writer=_msc_writer(uri), no_dist=True)
    blob = (tmp_path / "msc" / ".metadata").read_bytes()
    if protocol is not None:
        blob = pickle.dumps(pickle.loads(blob), protocol=protocol)
    return uri, blob


def test_a_peers_path_reads_as_inert_data(tmp_path: Path) -> None:
    """MSC's path is read without MSC: in a fresh process the load imports
    no ``multistorageclient`` module (its class's ``__setstate__`` would
    resolve a storage client); the stand-in gives the path and names the class."""
    uri, blob = _msc_metadata(tmp_path)
    (tmp_path / "blob").write_bytes(blob)
    probe = (
        "import sys, os; from dcpstore._impl.format.safe_pickle import load_metadata\n"
        f"md, _ = load_metadata(open({str(tmp_path / 'blob')!r}, 'rb').read(), '.metadata')\n"
        "cid = md.storage_meta.checkpoint_id\n"
        "assert not [m for m in sys.modules if m.startswith('multistorageclient')], 'MSC was imported'\n"
        "print(os.fspath(cid)); print(repr(cid))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [uri, f"PeerPath(multistorageclient.pathlib.MultiStoragePath, {uri!r})"]
    # In a process that has MSC, the stand-in is no MultiStoragePath, and it
    # goes to the other ranks as itself.
    from multistorageclient.pathlib import MultiStoragePath

    metadata, _ = load_metadata(blob, ".metadata", TOOLS)
    cid = metadata.storage_meta.checkpoint_id  # type: ignore[union-attr]
    assert isinstance(cid, PeerPath) and not isinstance(cid, MultiStoragePath)
    assert pickle.loads(pickle.dumps(cid)) == cid == PeerPath("multistorageclient.pathlib.MultiStoragePath", uri)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param((b")\x81", b"K\x05\x85\x81"), id="constructor-args"),  # NEWOBJ with an argument
        pytest.param((b"X\x05\x00\x00\x00_path", b"X\x05\x00\x00\x00_pbth"), id="no-path-field"),
    ],
)
def test_a_crafted_peer_path_is_damage_not_code(tmp_path: Path, edit: tuple[bytes, bytes]) -> None:
    _, blob = _msc_metadata(tmp_path, protocol=2)  # no frames: a byte edit keeps the pickle parseable
    at = blob.index(b"MultiStoragePath\n")
    old, new = edit
    assert old in blob[at:]
    bad = blob[:at] + blob[at:].replace(old, new, 1)
    with pytest.raises(CheckpointCorrupt, match="cannot be unpickled.*MultiStoragePath"):
        load_metadata(bad, ".metadata", TOOLS)


def test_a_peer_path_holding_a_non_str_is_damage(tmp_path: Path) -> None:
    from multistorageclient.pathlib import MultiStoragePath

    uri, blob = _msc_metadata(tmp_path)
    metadata = pickle.loads(blob)
    path = MultiStoragePath(uri)
    path._path = ["not", "text"]  # type: ignore[assignment]
    metadata.storage_meta.checkpoint_id = path
    with pytest.raises(CheckpointCorrupt, match="no path text"):
        load_metadata(pickle.dumps(metadata), ".metadata", TOOLS)
