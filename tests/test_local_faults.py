"""Local storage failures (ENOSPC, EIO, EACCES) fail a save cleanly.

The failures are injected at the OS boundary the local backend uses (so its
error mapping and abort path run for real) and at the storage interface.
Every case checks the same promises: a SaveError naming the URI and the
cause, no .metadata, no temporary files left, the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from dcpstore.errors import StorageError
from dcpstore.storage import open_storage
from dcpstore.dcp.writer import DcpStorageWriter
from faults import EventStorage, FailAt
from helpers import assert_state_equal, sample_state, zeros_like_state


def _is_tmp_fd(fd: int) -> bool:
    try:
        return ".dcpstore-tmp-" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


def _failing(real, code: int, after: int):
    """Wrap an os function: the ``after``-th call on a dcpstore temp file fails."""
    calls = {"n": 0}

    def fake(fd, *args, **kwargs):
        if _is_tmp_fd(fd):
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(code, os.strerror(code))
        return real(fd, *args, **kwargs)

    return fake


@pytest.fixture
def previous(tmp_path) -> tuple[str, dict]:
    state = sample_state(7)
    uri = str(tmp_path / "step_1")
    dcpstore.save(state, uri).result()
    return uri, state


def _next_state() -> dict:
    """Small values plus tensors large enough to be written unbuffered."""
    return {**sample_state(8), **{f"big{i}": torch.randn(1 << 18) for i in range(3)}}


def _assert_clean_failure(uri: str, previous: tuple[str, dict], cause: str) -> None:
    with pytest.raises(dcpstore.SaveError) as info:
        dcpstore.save(_next_state(), uri, workers=3)
    message = str(info.value)
    assert uri in message and cause in message, message
    assert not os.path.exists(os.path.join(uri, ".metadata"))
    assert not any(".dcpstore-tmp-" in f for f in os.listdir(uri)) if os.path.isdir(uri) else True
    prev_uri, prev_state = previous
    restored = zeros_like_state(prev_state)
    dcpstore.load(restored, prev_uri)
    assert_state_equal(prev_state, restored)


@pytest.mark.parametrize("after", [0, 1, 3])
def test_enospc_mid_write(tmp_path, monkeypatch, previous, after: int) -> None:
    monkeypatch.setattr(os, "write", _failing(os.write, errno.ENOSPC, after))
    _assert_clean_failure(str(tmp_path / "step_2"), previous, "ENOSPC")


def test_eio_on_fsync(tmp_path, monkeypatch, previous) -> None:
    monkeypatch.setattr(os, "fsync", _failing(os.fsync, errno.EIO, 1))
    _assert_clean_failure(str(tmp_path / "step_2"), previous, "EIO")


def test_eacces_on_open(tmp_path, monkeypatch, previous) -> None:
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if ".metadata" in str(path) and ".dcpstore-tmp-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    _assert_clean_failure(str(tmp_path / "step_2"), previous, "permission denied")


@pytest.mark.parametrize("event", ["commit:.metadata", "commit:.dcpstore.json", "open:__0_1.distcp", "write:__0_2.distcp"])
def test_interface_failure_commits_nothing(tmp_path, previous, event: str) -> None:
    uri = str(tmp_path / "step_2")
    storage = EventStorage(open_storage(uri), FailAt(lambda e: e.startswith(event), StorageError(f"injected at {event}")))
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException, a BaseException
        dcp_save(sample_state(8), storage_writer=DcpStorageWriter(storage, workers=3), no_dist=True)
    assert "injected" in str(info.value)
    assert not os.path.exists(os.path.join(uri, ".metadata"))
    assert not any(".dcpstore-tmp-" in f for f in os.listdir(uri))
    with pytest.raises(dcpstore.CheckpointNotFound, match="interrupted save"):
        dcpstore.load(zeros_like_state(sample_state(8)), uri)
