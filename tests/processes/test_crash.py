"""SIGKILL a saving process at >= 20 points; nothing wrong ever loads.

Each crash runs in a child forked from a forkserver that has torch and
dcpstore imported, so a kill costs milliseconds, not an interpreter start
(crashkit.py; the async and S3 variants are test_crash_async.py and
test_crash_s3.py). The child saves through :class:`faults.EventStorage`, which SIGKILLs it at
the n-th storage event: open, each chunk written, each commit (before and
after the rename), the manifest, ``.metadata``, deletes and listings.

Two suites: a plain DCP save to a fresh URI (the previous checkpoint beside
it), and a save through ``CheckpointManager(keep=1)`` whose retention races
the kill, or which saves over the committed checkpoint at the same URI
(crashkit.run_managed_crashes, shared with the async and S3 suites).
"""

from __future__ import annotations

import os
import signal

import pytest
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.tools.maintenance import gc, list_checkpoints
from dcpstore.storage import open_storage
from tests.support import killcount
from tests.support.crashkit import (
    Managed,
    age_temp_files,
    commit_index,
    crash,
    crash_state,
    forkserver,
    kill_points,
    run_managed_crashes,
)
from tests.support.crashkit import outcome as _outcome_of
from tests.support.faults import EventStorage, KillAt, Recorder

#: Kill-point budget of the quick run (None: every point, in the slow run).
BUDGETS = [pytest.param(24, id="sampled"), pytest.param(None, id="all", marks=pytest.mark.slow)]


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


@pytest.mark.parametrize("budget", BUDGETS)
def test_kill_anywhere_in_a_save(tmp_path, ctx, budget: int | None) -> None:
    root = tmp_path / "root"
    dcpstore.save(crash_state(1), str(root / "step_1")).result()
    events = _count_events(tmp_path)
    landed = commit_index(events)
    points = kill_points(events, total=budget, always=(landed - 1, landed))
    assert len(points) >= 20, f"only {len(events)} storage events to kill at"
    assert points[0] < landed <= points[-1]
    for k in points:
        uri = str(root / f"crash_{k}")
        code = _crash(ctx, uri, 2, k)
        assert code == -signal.SIGKILL, f"kill point {k} ({events[k]}): exit code {code}"
        # Absent until .metadata has landed, exactly the saved state from then on
        # (the marker removal and stale-file cleanup after it change nothing).
        expected = "complete" if k >= landed else "absent"
        assert _outcome(uri, 2) == expected, f"kill point {k} ({events[k]})"
    assert _outcome(str(root / "step_1"), 1) == "complete"  # the previous one, untouched
    committed = {"step_1"} | {f"crash_{k}" for k in points if k >= landed}
    storage = open_storage(str(root))
    listed = list_checkpoints(storage)
    assert {e.path for e in listed if e.committed} == committed
    assert {e.path for e in listed if not e.committed} <= {f"crash_{k}" for k in points if k < landed}
    # gc removes every leftover of the interrupted saves and nothing else
    # (found later: their temporary files are past the lease).
    age_temp_files(str(root))
    gc(storage, older_than_s=0)
    assert list(storage.list_incomplete()) == []
    after = list_checkpoints(storage)
    assert all(e.committed for e in after) and {e.path for e in after} == committed
    assert not any(".dcpstore-tmp-" in f for _, _, files in os.walk(root) for f in files)
    for name in sorted(committed):
        assert _outcome(str(root / name), 1 if name == "step_1" else 2) == "complete", name
    killcount.record(len(points), len(points), len(points))  # each one was asserted to kill


@pytest.mark.parametrize("scenario", ["next", pytest.param("overwrite", marks=pytest.mark.slow)])
def test_kill_anywhere_in_a_managed_sync_save(tmp_path, ctx, scenario: str) -> None:
    """keep=1: retention deletes step 1 once step 2 is committed ("next"), or
    step 1 is saved again over itself ("overwrite"); see run_managed_crashes."""
    how = Managed({"async_": False, "workers": 3})
    run_managed_crashes(ctx, str(tmp_path / "runs"), scenario, how, budget=20)


def test_kill_anywhere_in_a_managed_direct_save(tmp_path, ctx) -> None:
    """The same with direct I/O (``StorageOptions(direct_io=True)``): the
    big tensor's pages go past the page cache, the fsync and the commit
    are as buffered."""
    how = Managed({"async_": False, "workers": 3, "storage_options": dcpstore.StorageOptions(direct_io=True)})
    run_managed_crashes(ctx, str(tmp_path / "runs"), "next", how, budget=20)


def test_temp_files_never_listed(tmp_path, ctx) -> None:
    events = _count_events(tmp_path)
    mid = next(i for i, e in enumerate(events) if e.startswith("wrote:__0_"))
    uri = str(tmp_path / "mid")
    assert _crash(ctx, uri, 2, mid) == -signal.SIGKILL
    killcount.record(1, 1, 1)
    on_disk = os.listdir(uri)
    assert any(".dcpstore-tmp-" in f for f in on_disk)
    storage = open_storage(uri)
    assert all(".dcpstore-tmp-" not in o["path"] for o in storage.list())
    assert storage.cleanup_incomplete(0) >= 1
    assert not any(".dcpstore-tmp-" in f for f in os.listdir(uri))
