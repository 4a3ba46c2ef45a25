"""Local storage failures (ENOSPC, EIO, EACCES) fail a save cleanly.

The failures are injected at the OS boundary the local backend uses (so its
error mapping and abort path run for real) and at the storage interface.
Every case saves through ``CheckpointManager(keep=1)`` next to a committed
step 1, or over it (the same URI), and checks the same promises: a SaveError
naming the URI and the real cause (not torch's "unexpected pos"), no
.metadata of the failed save, no temporary files left; step 1 untouched by
the failure, whether the save went to the next step (retention never runs
for a failed save) or over step 1 itself (the overwrite-safe commit).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.util.errors import StorageError
from dcpstore.storage import open_storage
from tests.support.crashkit import which_state
from tests.support.faults import EventStorage, FailAt
from tests.support.helpers import sample_state, zeros_like_state


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
    """A manager root whose step 1 is committed: the checkpoint to keep."""
    state = sample_state(7)
    root = str(tmp_path / "run")
    with dcpstore.CheckpointManager(root, async_=False) as manager:
        manager.save(state, 1)
    return root, state


def _next_state() -> dict:
    """Small values plus tensors large enough to be written unbuffered."""
    return {**sample_state(8), **{f"big{i}": torch.randn(1 << 18) for i in range(3)}}


#: Where the failing save goes: the next step (retention, keep=1, must not
#: run for a failed save) or over step 1 itself (the same URI).
SCENARIOS = {"next": 2, "overwrite": 1}


@pytest.fixture(params=list(SCENARIOS))
def scenario(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _failed_save_uri(previous: tuple[str, dict], scenario: str) -> str:
    return dcpstore.CheckpointManager(previous[0]).step_uri(SCENARIOS[scenario])


def _assert_clean_failure(previous: tuple[str, dict], scenario: str, cause: str, *, direct_io: bool = False) -> None:
    """A failing save through CheckpointManager(keep=1): a SaveError naming
    the URI and the real cause; nothing half-written; step 1 as it was."""
    uri = _failed_save_uri(previous, scenario)
    options = dcpstore.SaveOptions(workers=3, storage_options=dcpstore.StorageOptions(direct_io=direct_io))
    manager = dcpstore.CheckpointManager(previous[0], keep=1, async_=False, options=options)
    with pytest.raises(dcpstore.SaveError) as info:
        manager.save(_next_state(), SCENARIOS[scenario], overwrite=scenario == "overwrite")
    message = str(info.value)
    assert uri in message and cause in message, message
    assert "unexpected pos" not in message, message  # torch's stream error, not the storage's
    _assert_nothing_half_written(uri, scenario)
    _assert_previous(previous, manager)


def _assert_nothing_half_written(uri: str, scenario: str) -> None:
    # Over step 1, its .metadata stays: _assert_previous checks it is the old one.
    assert scenario == "overwrite" or not os.path.exists(os.path.join(uri, ".metadata"))
    assert not any(".dcpstore-tmp-" in f for f in os.listdir(uri)) if os.path.isdir(uri) else True


def _assert_previous(previous: tuple[str, dict], manager: dcpstore.CheckpointManager) -> None:
    """Step 1 loads exactly, in both scenarios: a failed save over it never
    touches it."""
    _, prev_state = previous
    assert which_state(manager.step_uri(1), {"old": prev_state}) == "old"
    assert manager.all_steps() == [1]


@pytest.mark.parametrize("after", [0, 1, 3])
def test_enospc_mid_write(monkeypatch, previous, scenario, after: int) -> None:
    monkeypatch.setattr(os, "write", _failing(os.write, errno.ENOSPC, after))
    _assert_clean_failure(previous, scenario, "ENOSPC")


def test_enospc_on_a_direct_write(monkeypatch, previous, scenario) -> None:
    """A direct write (``direct_io``: a large tensor's pages) that runs out
    of space fails the save as a buffered one does."""
    real = os.pwrite

    def pwrite(fd: int, data, offset: int) -> int:
        if _is_tmp_fd(fd) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    _assert_clean_failure(previous, scenario, "ENOSPC", direct_io=True)


def test_eio_on_fsync(monkeypatch, previous, scenario) -> None:
    monkeypatch.setattr(os, "fsync", _failing(os.fsync, errno.EIO, 1))
    _assert_clean_failure(previous, scenario, "EIO")


def test_eacces_on_open(monkeypatch, previous, scenario) -> None:
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if ".metadata" in str(path) and ".dcpstore-tmp-" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)
    _assert_clean_failure(previous, scenario, "permission denied")


#: Events to fail at (over a committed step the names carry the save's tag).
EVENTS = {
    "commit:.metadata": r"commit:\.metadata",
    "commit:manifest": r"commit:\.dcpstore(\.[0-9a-f]{8})?\.json",
    "open:__0_1.distcp": r"open:__0_([0-9a-f]{8}_)?1\.distcp",
    "write:__0_2.distcp": r"write:__0_([0-9a-f]{8}_)?2\.distcp",
}


@pytest.mark.parametrize("event", list(EVENTS))
def test_interface_failure_commits_nothing(previous, scenario, event: str) -> None:
    uri = _failed_save_uri(previous, scenario)
    storage = EventStorage(
        open_storage(uri),
        FailAt(lambda e: re.match(EVENTS[event], e) is not None, StorageError(f"injected at {event}")),
    )
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException, a BaseException
        dcp_save(_next_state(), storage_writer=DcpStorageWriter(storage, workers=3), no_dist=True)
    assert "injected" in str(info.value)
    _assert_nothing_half_written(uri, scenario)
    if scenario == "next":
        with pytest.raises(dcpstore.CheckpointNotFound, match="interrupted save"):
            dcpstore.load(zeros_like_state(_next_state()), uri)
    _assert_previous(previous, dcpstore.CheckpointManager(previous[0]))
