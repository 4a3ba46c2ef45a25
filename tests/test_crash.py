"""SIGKILL a saving process at >= 20 points; nothing wrong ever loads.

Each crash runs in a child forked from a forkserver that has torch and
dcpstore imported, so a kill costs milliseconds, not an interpreter start
(crashkit.py; the async and S3 variants are test_crash_async.py and
test_crash_s3.py). The child saves through :class:`faults.EventStorage`, which SIGKILLs it at
the n-th storage event: open, each chunk written, each commit (before and
after the rename), the manifest, and ``.metadata``.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from crashkit import crash, crash_state, forkserver, kill_points
from crashkit import outcome as _outcome_of
from dcpstore.maintenance import gc, list_checkpoints
from dcpstore.storage import open_storage
from dcpstore.dcp.writer import DcpStorageWriter
from faults import EventStorage, KillAt, Recorder
from helpers import assert_state_equal, zeros_like_state


def _save(uri: str, seed: int, hook) -> None:
    storage = EventStorage(open_storage(uri), hook)
    dcp_save(crash_state(seed), storage_writer=DcpStorageWriter(storage, workers=3), no_dist=True)


def _child(uri: str, seed: int, kill_at: int) -> None:
    _save(uri, seed, KillAt(kill_at))


@pytest.fixture(scope="module")
def ctx():
    return forkserver()


def _crash(ctx, uri: str, seed: int, kill_at: int) -> int:
    return crash(ctx, _child, uri, seed, kill_at)


def _count_events(tmp_path) -> list[str]:
    recorder = Recorder()
    _save(str(tmp_path / "probe"), 2, recorder)
    return recorder.events


def _outcome(uri: str, seed: int) -> str:
    """'absent' or 'complete'; anything else fails the test."""
    return _outcome_of(uri, crash_state(seed))


def test_kill_anywhere_in_a_save(tmp_path, ctx) -> None:
    root = tmp_path / "root"
    dcpstore.save(crash_state(1), str(root / "step_1")).result()
    events = _count_events(tmp_path)
    points = kill_points(events)
    assert len(points) >= 20, f"only {len(events)} storage events to kill at"
    outcomes: dict[str, list[str]] = {"absent": [], "complete": []}
    for k in points:
        uri = str(root / f"crash_{k}")
        code = _crash(ctx, uri, 2, k)
        assert code == -signal.SIGKILL, f"kill point {k} ({events[k]}): exit code {code}"
        outcomes[_outcome(uri, 2)].append(events[k])
        assert _outcome(str(root / "step_1"), 1) == "complete"  # the previous one, untouched
    # Kills before the .metadata rename leave nothing loadable; after it, all.
    assert outcomes["absent"] and outcomes["complete"]
    assert all(not e.startswith("committed:.metadata") for e in outcomes["absent"])
    listed = {e.path: e.committed for e in list_checkpoints(open_storage(str(root)))}
    for k in points:
        loadable = _outcome(str(root / f"crash_{k}"), 2) == "complete"
        assert listed.get(f"crash_{k}", False) == loadable
    # gc removes every leftover of the interrupted saves and nothing else.
    storage = open_storage(str(root))
    gc(storage, older_than_s=0)
    assert list(storage.list_incomplete()) == []
    after = list_checkpoints(storage)
    assert all(e.committed for e in after)
    assert _outcome(str(root / "step_1"), 1) == "complete"


def test_kill_while_overwriting_never_mixes_old_and_new(tmp_path, ctx) -> None:
    """Re-saving over a committed checkpoint: old, new or absent, never a mixture."""
    events = _count_events(tmp_path)
    seen = set()
    points = kill_points(events)
    for k in sorted(set(points[::3] + points[-2:])):  # a sample, and after the commit
        uri = str(tmp_path / f"over_{k}")
        dcpstore.save(crash_state(3), uri, workers=3).result()
        assert _crash(ctx, uri, 2, k) == -signal.SIGKILL
        restored = zeros_like_state(crash_state(2))
        try:
            dcpstore.load(restored, uri)
        except dcpstore.CheckpointNotFound:
            seen.add("absent")
            continue
        if torch.equal(restored["big"], crash_state(3)["big"]):
            assert_state_equal(crash_state(3), restored)
            seen.add("old")
        else:
            assert_state_equal(crash_state(2), restored)
            seen.add("new")
    assert "absent" in seen and "new" in seen


def test_temp_files_never_listed(tmp_path, ctx) -> None:
    events = _count_events(tmp_path)
    mid = next(i for i, e in enumerate(events) if e.startswith("wrote:__0_"))
    uri = str(tmp_path / "mid")
    assert _crash(ctx, uri, 2, mid) == -signal.SIGKILL
    on_disk = os.listdir(uri)
    assert any(".dcpstore-tmp-" in f for f in on_disk)
    storage = open_storage(uri)
    assert all(".dcpstore-tmp-" not in o["path"] for o in storage.list())
    assert storage.cleanup_incomplete(0) >= 1
    assert not any(".dcpstore-tmp-" in f for f in os.listdir(uri))
