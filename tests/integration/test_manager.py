"""CheckpointManager: listing, pointer, retention, crashes, lifetime.

The listing/retention suites run on every backend target; the crash suites
SIGKILL a child process (tests/support/manager_child.py) on the local backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
import dcpstore.storage
import dcpstore.tools
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager import parse_step_dir, step_dir
from dcpstore._impl.tools.maintenance import list_checkpoints
from tests.support import killcount
from tests.support.async_helpers import engine_params, skip_unless_engine_serves
from tests.support.backends import Target
from tests.support.faults import BlockAt, hook_all_storage
from tests.support.manager_child import state as child_state

CHILD = "tests.support.manager_child"  # run with -m from the repository root


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64,), float(step)), "step": step}


def _open(target: Target) -> dcpstore.storage.Storage:
    """The target's storage, opened with the same keywords save/load take."""
    return dcpstore.open_storage(target.uri, **target.kwargs)


def _manager(target: Target, **kwargs: Any) -> dcpstore.CheckpointManager:
    kwargs.setdefault("async_", False)
    return dcpstore.CheckpointManager(target.uri, options=target.save_options(), **kwargs)


def _loaded_step(
    mgr: dcpstore.CheckpointManager, step: int | None = None, like: dict[str, Any] | None = None
) -> tuple[int, float, int]:
    """(step loaded, the value its tensors hold, its "step" entry)."""
    dest = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in (like or _state(0)).items()}
    got = mgr.load(dest, step)
    tensors = [v for v in dest.values() if isinstance(v, torch.Tensor)]
    assert all(torch.all(t == tensors[0][0]) for t in tensors), "a step mixes values of several saves"
    return got, float(tensors[0][0]), dest["step"]


# -- naming ------------------------------------------------------------------


def test_step_directory_names_round_trip() -> None:
    assert step_dir(100) == "step_00000100" and step_dir(0) == "step_00000000"
    assert step_dir(10**9) == "step_1000000000"
    for step in (0, 7, 12_345_678, 10**9, 10**12):
        assert parse_step_dir(step_dir(step)) == step
    for foreign in ("step_100", "step_000000100", "step_00000100.bak", "Step_00000100", "step_-0000001", "latest", ""):
        assert parse_step_dir(foreign) is None, foreign


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None, "../x"])
def test_steps_must_be_non_negative_ints(local_target: Target, bad: Any) -> None:
    mgr = _manager(local_target)
    with pytest.raises(dcpstore.InvalidArgument, match="step must be a non-negative int"):
        mgr.save(_state(0), bad)
    with pytest.raises(dcpstore.InvalidArgument, match="step must be a non-negative int"):
        mgr.step_uri(bad)
    assert not os.path.exists(local_target.uri) or not os.listdir(local_target.uri)
    mgr.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"keep": 0}, "keep"), ({"keep": True}, "keep"), ({"async_": 1}, "^CheckpointManager: async_ must be a bool")],
)
def test_bad_options_fail_at_construction(local_target: Target, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=match):
        _manager(local_target, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "instead"),
    [
        ({"engine": "native"}, "options=dcpstore.SaveOptions(async_=True, engine=...)"),
        ({"workers": 2}, "options=dcpstore.SaveOptions(async_=True, workers=...)"),
        (
            {"enable_msc": True},
            "options=dcpstore.SaveOptions(async_=True, storage_options=dcpstore.StorageOptions(enable_msc=...))",
        ),
        ({"dist_ckpt_workers": 2}, "'dist_ckpt_workers' is dcpstore's 'workers' (its name in Megatron-Bridge's"),
    ],
)
def test_a_save_option_goes_in_the_options(local_target: Target, kwargs: dict[str, Any], instead: str) -> None:
    """The manager takes its save options whole: a keyword for one is a
    TypeError saying how to pass it (keeping the manager async, as options
    passed whole are used as they are)."""
    with pytest.raises(
        TypeError, match=rf"^CheckpointManager\.__init__\(\) got an unexpected keyword argument '{next(iter(kwargs))}'"
    ) as info:
        dcpstore.CheckpointManager(local_target.uri, **kwargs)
    assert instead in str(info.value), str(info.value)


def test_async_is_the_default(local_target: Target) -> None:
    mgr = dcpstore.CheckpointManager(local_target.uri, **local_target.kwargs)
    assert mgr.async_ is True
    handle = mgr.save(_state(1), 1)
    mgr.wait()  # None if the save had already finished inside save()
    assert handle.done() and handle.result().engine != "sync" and mgr.all_steps() == [1]
    mgr.close()


# -- listing and the pointer ----------------------------------------------------


def test_only_committed_canonical_steps_are_listed(target: Target) -> None:
    mgr = _manager(target)
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    for step in (1, 5, 3):
        mgr.save(_state(step), step)
    storage = _open(target)
    for foreign in (
        "step_5/.metadata",
        "step_00000007.bak/.metadata",
        "other/.metadata",
        "step_00000011/nested/.metadata",
    ):
        storage.put(foreign, b"not a checkpoint")
    storage.put("step_00000009/__0_0.distcp", b"data of an interrupted save")
    assert mgr.all_steps() == [1, 3, 5] and mgr.latest_step() == 5
    assert mgr.read_pointer() == 3  # the step this job committed last
    assert _loaded_step(mgr) == (5, 5.0, 5)
    assert _loaded_step(mgr, 1) == (1, 1.0, 1)
    mgr.close()


def test_the_listing_wins_over_the_pointer(target: Target) -> None:
    mgr = _manager(target)
    mgr.save(_state(1), 1)
    mgr.save(_state(2), 2)
    storage = _open(target)
    storage.put("latest", b"99\n")  # a stale or foreign pointer
    assert mgr.latest_step() == 2 and _loaded_step(mgr)[0] == 2
    storage.delete([f"{step_dir(2)}/.metadata"])  # step 2 un-committed behind our back
    assert mgr.all_steps() == [1] and _loaded_step(mgr) == (1, 1.0, 1)
    mgr.close()


def test_load_without_any_committed_step_names_the_root(target: Target) -> None:
    mgr = _manager(target)
    with pytest.raises(dcpstore.CheckpointNotFound, match="no committed checkpoint under"):
        mgr.load(_state(0))
    mgr.save(_state(4), 4)
    with pytest.raises(dcpstore.CheckpointNotFound):
        mgr.load(_state(0), step=3)
    mgr.close()


def test_committed_steps_are_not_overwritten_unless_asked(target: Target) -> None:
    mgr = _manager(target)
    mgr.save(_state(7), 7)
    with pytest.raises(dcpstore.CheckpointExists, match="already exists: step 7 is committed.*overwrite=True") as info:
        mgr.save(_state(70), 7)
    assert isinstance(info.value, FileExistsError)
    assert _loaded_step(mgr) == (7, 7.0, 7)
    mgr.save(_state(70), 7, overwrite=True)
    assert _loaded_step(mgr) == (7, 70.0, 70)
    mgr.close()


# -- retention -------------------------------------------------------------------


def test_retention_keeps_the_newest_k_committed_steps(target: Target) -> None:
    mgr = _manager(target, keep=2)
    for step in range(1, 6):
        mgr.save(_state(step), step)
        assert mgr.all_steps() == list(range(max(1, step - 1), step + 1))
    paths = {o["path"] for o in _open(target).list()}
    assert not any(p.startswith(("step_00000001/", "step_00000002/", "step_00000003/")) for p in paths), paths
    assert [h.step for h in mgr.history] == [1, 2, 3, 4, 5] and mgr.history[-1].info.bytes_written > 0
    mgr.close()


def test_retention_never_touches_newer_or_uncommitted_steps(target: Target) -> None:
    mgr = _manager(target, keep=1)
    # Another timeline's step 10 (committed) and an interrupted step 2.
    dcpstore.save(_state(10), mgr.step_uri(10), **target.kwargs).result()
    storage = _open(target)
    storage.put("step_00000002/__0_0.distcp", b"partial")
    mgr.save(_state(1), 1)
    mgr.save(_state(3), 3)
    assert mgr.all_steps() == [3, 10]  # 1 retired after 3 committed; 10 is newer than 3: untouched
    assert storage.exists("step_00000002/__0_0.distcp")  # gc's job, not retention's
    assert mgr.latest_step() == 10 and mgr.read_pointer() == 3
    mgr.close()


# -- lifetime ----------------------------------------------------------------------


def test_close_is_idempotent_and_final(local_target: Target) -> None:
    with _manager(local_target) as mgr:
        mgr.save(_state(1), 1)
    mgr.close()
    with pytest.raises(dcpstore.InvalidArgument, match="closed"):
        mgr.save(_state(2), 2)
    with _manager(local_target) as again:
        assert again.all_steps() == [1]


# -- crashes ----------------------------------------------------------------------


def _child(mode: str, root: str, keep: int, async_: bool = False) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", CHILD, mode, root, str(keep), "1" if async_ else "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_kill_between_data_and_commit_keeps_the_newest_committed_step(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    child = _child("commit-kill", root, keep=1)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, (child.returncode, out, err)
    killcount.record(1, 1, 1)
    assert "committed 2" in out
    step3 = Path(root, step_dir(3))
    assert any(p.name.endswith(".distcp") for p in step3.iterdir()), "the kill came before the data was written"
    mgr = dcpstore.CheckpointManager(root, keep=1, async_=False)
    assert mgr.all_steps() == [2], "keep=1 must not retire step 2 before step 3 commits"
    assert mgr.read_pointer() == 2
    assert _loaded_step(mgr, like=child_state(0)) == (2, 2.0, 2)
    # The resumed run saves step 3 over the leftovers; only now does 2 go.
    mgr.save(_state(3), 3)
    assert mgr.all_steps() == [3] and _loaded_step(mgr) == (3, 3.0, 3)
    mgr.close()


def _writing_step(root: str) -> int | None:
    """The step >= 3 whose data files are being written now, if any (retention may delete dirs under us)."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            step = parse_step_dir(entry.name)
            if step is None or step < 3:
                continue
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                if any(".dcpstore-tmp-" in name for name in os.listdir(entry.path)):
                    return step
    return None


def _kill_mid_write(root: str, async_: bool) -> tuple[int, int]:
    """Run the loop child; SIGKILL it while the data files of some step >= 3 are being written.

    Any step from 3 on will do: a write window is milliseconds, and a loaded machine's poll can miss
    one step's, never every step's. Returns the child's exit status and the step it was killed in.
    """
    child = _child("loop", root, keep=2, async_=async_)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if (step := _writing_step(root)) is not None:
                child.send_signal(signal.SIGKILL)
                child.communicate(timeout=60)
                return child.returncode, step
            time.sleep(0.001)
        child.kill()
        pytest.fail(f"the child never started writing a step >= 3: {child.communicate(timeout=60)}")
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=60)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_sigkill_mid_save_leaves_only_loadable_committed_steps(tmp_path: Path, async_: bool) -> None:
    root = str(tmp_path / "run")
    returncode, killed = _kill_mid_write(root, async_)
    assert returncode == -signal.SIGKILL
    killcount.record(1, 1, 1)
    mgr = dcpstore.CheckpointManager(root, keep=2, async_=False)
    steps = mgr.all_steps()
    assert steps and steps[-1] >= killed - 1 and len(steps) <= 3, (killed, steps)  # keep=2, plus one awaiting retention
    for step in steps:
        assert _loaded_step(mgr, step, like=child_state(0)) == (step, float(step), step)
    if killed not in steps:  # killed before its commit: what it left is no checkpoint
        assert Path(root, step_dir(killed)).is_dir() and not Path(root, step_dir(killed), ".metadata").exists()
        assert all(
            e.committed == (parse_step_dir(e.path) in steps) for e in list_checkpoints(dcpstore.open_storage(root))
        )
    mgr.close()


# -- async ------------------------------------------------------------------------


def test_async_step_is_listed_only_after_commit_and_retention_waits_for_it(
    local_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = _manager(local_target, keep=1, async_=True)
    mgr.save(_state(1), 1)
    mgr.wait()
    # Step 2's data files are durable; its commit is held until released.
    held = BlockAt(lambda e: e == f"commit:{METADATA}")
    hook_all_storage({mgr.step_uri(2): held}, monkeypatch.setattr)
    state = _state(2)
    handle = mgr.save(state, 2)
    try:
        state["w"].fill_(-1.0)  # after save returns: must not reach storage
        assert held.reached.wait(60), "step 2 never reached its commit"
        assert not handle.done() and mgr.all_steps() == [1], (
            "step 2 listed, or step 1 retired, before step 2 was committed"
        )
        reader = _manager(local_target)  # another process's view; mgr.load would wait for step 2
        assert _loaded_step(reader) == (1, 1.0, 1)
    finally:
        held.release()  # never leave a held save for the exit hook to wait on
    handle.result(timeout=60)
    # Committed, and retention (keep=1) has not run: it runs when the manager
    # finishes the save (the next save, wait, load or close), not in the background.
    assert mgr.all_steps() == [1, 2]
    info = mgr.wait()
    assert info is not None and mgr.all_steps() == [2] and mgr.read_pointer() == 2
    assert _loaded_step(mgr) == (2, 2.0, 2)
    mgr.close()


def test_async_save_pending_at_exit_is_finished_by_atexit(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    child = _child("exit", root, keep=1, async_=True)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert dcpstore.CheckpointManager(root, async_=False).all_steps() == [1]


# -- files of the caller's in a step's commit ------------------------------------


@pytest.mark.parametrize("engine", engine_params(quick=("native", "nvrx", "process")))
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_commit_files_land_in_the_step_commit_on_every_engine(target: Target, engine: str, async_: bool) -> None:
    """A framework's own small files (Bridge's ``train_state.pt``, its
    ``run_config.yaml``) go into the step's commit: under their own names in
    the step, recorded in the manifest, read back checked; the bytes given
    are the bytes taken at ``save`` (the caller may reuse its buffers)."""
    skip_unless_engine_serves(engine, target)
    options = dataclasses.replace(target.save_options(), engine=engine, async_=async_)
    mgr = dcpstore.CheckpointManager(target.uri, options=options, layout="bridge")
    files = {"train_state.pt": bytearray(b"\x80state of step 5"), "run_config.yaml": b"model: {}\n"}
    mgr.save(_state(5), 5, commit_files=files)
    files["train_state.pt"][:] = b"changed after save"
    mgr.wait()
    step_uri, where = mgr.step_uri(5), options.storage_options
    assert dcpstore.tools.commit_file(step_uri, "train_state.pt", storage_options=where) == b"\x80state of step 5"
    assert dcpstore.tools.commit_file(step_uri, "run_config.yaml", storage_options=where) == b"model: {}\n"
    storage = dcpstore.open_storage(step_uri, **target.kwargs)
    assert storage.read("run_config.yaml") == b"model: {}\n"  # where Bridge looks for it
    storage.close()
    assert _loaded_step(mgr) == (5, 5.0, 5)
    with pytest.raises(dcpstore.InvalidArgument, match="commit file"):
        mgr.save(_state(6), 6, commit_files={"../escape": b""})
    mgr.close()
