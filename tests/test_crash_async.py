"""SIGKILL an *async* save at >= 20 points, on both engines; nothing wrong ever loads.

Kill points span the whole save (see crashkit.py): staging (the caller's
thread, before ``save`` returns), the background write (each data file's
open, chunks, commit before and after its rename; NVRx's per-item writes),
the window between the last data file and the commit (manifest), and the
commit itself (``.metadata`` before and after it lands, marker removal).
The child mutates its state as soon as ``save`` returns, as training would.

Afterwards: the previous checkpoint loads exactly; each interrupted one
loads exactly the state at ``save`` time or is absent (never the mutated
state, never a mixture); the listing agrees; a new save over a wreck commits
cleanly; ``gc`` removes every leftover.
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
from dcpstore.adapters import nvrx as nvrx_adapter
from dcpstore.maintenance import gc, list_checkpoints
from dcpstore.storage import open_storage
from dcpstore.writers.layout import MANIFEST, METADATA
from faults import KillAt, Recorder, hook_all_storage

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


def _save(uri: str, seed: int, engine: str, hook) -> None:
    instrument_staging(hook)
    hook_all_storage(hook)
    if engine == "nvrx":
        instrument_nvrx(hook)
    state = crash_state(seed)
    with dcpstore.AsyncSaver() as saver:
        handle = saver.save(state, uri, engine=engine, workers=3)
        mutate(state)  # training goes on; the checkpoint must not see this
        handle.result(timeout=120)


def _child(uri: str, seed: int, engine: str, kill_at: int) -> None:
    _save(uri, seed, engine, KillAt(kill_at))


def _probe(uri: str, engine: str, events) -> None:
    recorder = Recorder()
    _save(uri, 2, engine, recorder)
    events.put(recorder.events)


@pytest.fixture(scope="module")
def ctx():
    return forkserver("test_crash_async")


def _events(ctx, tmp_path, engine: str) -> list[str]:
    queue = ctx.Queue()
    assert crash(ctx, _probe, str(tmp_path / "probe"), engine, queue) == 0
    return queue.get(timeout=30)


@pytest.mark.parametrize(("engine", "budget"), ENGINES)
def test_kill_anywhere_in_an_async_save(tmp_path, ctx, engine: str, budget: int | None) -> None:
    root = tmp_path / "root"
    previous = str(root / "step_1")
    dcpstore.save(crash_state(1), previous)
    events = _events(ctx, tmp_path, engine)
    points = kill_points(events, total=budget, keep=KEEP)
    assert len(points) >= 20, events
    killed = [events[k] for k in points]
    assert any(e.startswith("stage:") for e in killed), "no kill point during staging"
    assert f"open:{MANIFEST}" in killed and f"commit:{METADATA}" in killed and f"committed:{METADATA}" in killed
    landed = commit_index(events)
    for k in points:
        uri = str(root / f"crash_{k:03d}")
        code = crash(ctx, _child, uri, 2, engine, k)
        assert code == -signal.SIGKILL, f"kill point {k} ({events[k]}): exit code {code}"
        # Exactly the state at save() time once .metadata has landed; before, nothing.
        expected = "complete" if k >= landed else "absent"
        assert outcome(uri, crash_state(2)) == expected, f"kill point {k} ({events[k]})"
        assert outcome(previous, crash_state(1)) == "complete"
    assert points[0] < landed <= points[-1]
    storage = open_storage(str(root))
    listed = {e.path: e.committed for e in list_checkpoints(storage)}
    for k in points:
        name = f"crash_{k:03d}"
        assert listed.get(name, False) == (k >= landed), name
    # A new save over a wreck commits, and leaves no stray data file of the crash.
    for name in [n for n, committed in listed.items() if not committed][:3]:
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
