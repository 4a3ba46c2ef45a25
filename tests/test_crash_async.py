"""SIGKILL an *async* save at >= 20 points, on both engines; nothing wrong ever loads.

Kill points span the whole save (see crashkit.py): staging (the caller's
thread, before ``save`` returns), the background write (each data file's
open, chunks, commit before and after its rename; NVRx's per-item writes),
the window between the last data file and the commit (manifest), and the
commit itself (``.metadata`` before and after it lands, marker removal).
The child mutates its state as soon as ``save`` returns, as training would.

The child saves step N through a ``CheckpointManager`` (so the kill points
also cover the ``latest`` pointer written after the commit). Afterwards: the
previous checkpoint loads exactly; each interrupted one loads exactly the
state at ``save`` time or is absent (never the mutated state, never a
mixture); ``CheckpointManager.all_steps()`` lists exactly the committed
steps and ``load()`` picks the newest; ``dcpstore ls``'s listing agrees; a
new save over a wreck commits cleanly; ``gc`` removes every leftover.
"""

from __future__ import annotations

import os
import signal

import pytest

import dcpstore
from crashkit import (
    commit_index,
    crash,
    crash_state,
    forkserver,
    instrument_nvrx,
    instrument_staging,
    kill_points,
    mutate,
    outcome,
)
from dcpstore.engines import nvrx as nvrx_adapter
from dcpstore.maintenance import gc, list_checkpoints
from dcpstore.manager import step_dir
from dcpstore.storage import open_storage
from dcpstore.format.layout import MANIFEST, METADATA
from faults import KillAt, Recorder, hook_all_storage
from helpers import assert_state_equal, zeros_like_state

needs_nvrx = pytest.mark.skipif(nvrx_adapter.import_error() is not None, reason="nvidia-resiliency-ext not installed")
#: engine -> kill-point budget (None: every point). The default run keeps
#: the native engine to 24 points; NVRx (every point) is in the slow run.
ENGINES = [
    pytest.param("native", 24, id="native"),
    pytest.param("nvrx", None, id="nvrx", marks=[needs_nvrx, pytest.mark.slow]),
    pytest.param("native", None, id="native-all", marks=pytest.mark.slow),
]
#: Always killed at, whatever the budget: staging, the gap between the data
#: and the commit (the manifest), and both sides of the commit.
KEEP = ("stage:", "open:.dcpstore.json", "commit:.metadata", "committed:.metadata")


def _save(root: str, step: int, seed: int, engine: str, hook) -> None:
    """One async save of step ``step`` through a CheckpointManager (which
    writes the ``latest`` pointer after the commit: kill points too)."""
    instrument_staging(hook)
    hook_all_storage(hook)
    if engine == "nvrx":
        instrument_nvrx(hook)
    state = crash_state(seed)
    manager = dcpstore.CheckpointManager(root, engine=engine, workers=3)
    manager.save(state, step)
    mutate(state)  # training goes on; the checkpoint must not see this
    manager.wait(timeout=120)


def _child(root: str, step: int, seed: int, engine: str, kill_at: int) -> None:
    _save(root, step, seed, engine, KillAt(kill_at))


def _probe(root: str, engine: str, events) -> None:
    recorder = Recorder()
    _save(root, 1, 2, engine, recorder)
    events.put(recorder.events)


@pytest.fixture(scope="module")
def ctx():
    return forkserver()


def _events(ctx, tmp_path, engine: str) -> list[str]:
    queue = ctx.Queue()
    assert crash(ctx, _probe, str(tmp_path / "probe"), engine, queue) == 0
    return queue.get(timeout=30)


@pytest.mark.parametrize(("engine", "budget"), ENGINES)
def test_kill_anywhere_in_an_async_save(tmp_path, ctx, engine: str, budget: int | None) -> None:
    root = tmp_path / "root"
    manager = dcpstore.CheckpointManager(str(root))
    previous = manager.step_uri(1)
    dcpstore.save(crash_state(1), previous)
    events = _events(ctx, tmp_path, engine)
    points = kill_points(events, total=budget, keep=KEEP)
    assert len(points) >= 20, events
    killed = [events[k] for k in points]
    assert any(e.startswith("stage:") for e in killed), "no kill point during staging"
    assert f"open:{MANIFEST}" in killed and f"commit:{METADATA}" in killed and f"committed:{METADATA}" in killed
    landed = commit_index(events)
    assert points[0] < landed <= points[-1]
    step = {k: 100 + k for k in points}  # kill point -> the step its child saves
    for k in points:
        code = crash(ctx, _child, str(root), step[k], 2, engine, k)
        assert code == -signal.SIGKILL, f"kill point {k} ({events[k]}): exit code {code}"
        # Exactly the state at save() time once .metadata has landed; before, nothing.
        expected = "complete" if k >= landed else "absent"
        assert outcome(manager.step_uri(step[k]), crash_state(2)) == expected, f"kill point {k} ({events[k]})"
        assert outcome(previous, crash_state(1)) == "complete"
    # The manager lists exactly the committed steps (never by the pointer).
    committed = [1] + [step[k] for k in points if k >= landed]
    assert manager.all_steps() == committed
    restored = zeros_like_state(crash_state(2))
    assert manager.load(restored) == committed[-1]
    assert_state_equal(crash_state(2), restored)
    storage = open_storage(str(root))
    listed = {e.path: e.committed for e in list_checkpoints(storage)}
    for k in points:
        assert listed.get(step_dir(step[k]), False) == (k >= landed), step_dir(step[k])
    # A new save over a wreck commits, and leaves no stray data file of the crash.
    for name in [n for n, committed_ in listed.items() if not committed_][:3]:
        uri = str(root / name)
        dcpstore.save(crash_state(3), uri, workers=2)
        assert outcome(uri, crash_state(3)) == "complete"
        manifest_files = set(dcpstore.maintenance.inspect_checkpoint(open_storage(uri))["files"])
        assert {o["path"] for o in open_storage(uri).list()} == manifest_files | {METADATA, MANIFEST}
    # gc removes every leftover (temp files, uncommitted directories), nothing else.
    gc(storage, older_than_s=0)
    assert list(storage.list_incomplete()) == []
    assert all(e.committed for e in list_checkpoints(storage))
    assert not any(".dcpstore-tmp-" in f for _, _, files in os.walk(root) for f in files)
    assert outcome(previous, crash_state(1)) == "complete"
