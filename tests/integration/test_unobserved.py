"""An async save's failure is never lost, even when nobody asks its handle.

A failure is *observed* when ``handle.result()`` or ``handle.exception()``
reports it. One that is not is raised, once, by the next save (of
``dcpstore.save``, ``AsyncSaver.save`` and ``CheckpointManager.save``) before
that save starts, and by ``close()``; at interpreter exit it is logged at
ERROR with its traceback, and the exit status is left alone (docs/usage.md, "Async
saves"). The exit-time cases run in real subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dcpstore
from dcpstore._impl.util.errors import SaveError

#: The engines these run on: the native one (NVRx's failures reach the saver
#: the same way) and the process engine, whose failures come from another
#: process; a sample of the latter is quick.
ENGINES = ["native", "process"]
SLOW_PROCESS = ["native", pytest.param("process", marks=pytest.mark.slow)]


def _unwritable(tmp_path: Path) -> str:
    """A URI whose save fails in the background: its parent is a regular
    file, so creating the checkpoint directory fails after staging."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    return str(blocker / "ckpt")


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(100, dtype=torch.float32)}


def _wait_done(handle: dcpstore.SaveHandle) -> None:
    """Wait for the save without observing its outcome."""
    assert handle.wait_bounded()


@pytest.mark.parametrize("engine", SLOW_PROCESS)
def test_next_save_raises_an_unobserved_failure_chained_and_naming_its_uri(tmp_path: Path, engine: str) -> None:
    bad, good = _unwritable(tmp_path), str(tmp_path / "good")
    with dcpstore.AsyncSaver() as saver:
        first = saver.save(_state(), bad, options=dcpstore.SaveOptions(engine=engine))
        _wait_done(first)
        with pytest.raises(SaveError) as info:
            saver.save(_state(), good, options=dcpstore.SaveOptions(engine=engine))
        message = str(info.value)
        assert bad in message and "was not started" in message and good in message
        assert isinstance(info.value.__cause__, SaveError) and bad in str(info.value.__cause__)
        assert not os.path.exists(good)  # the refused save wrote nothing
        # Raised once: the next save runs, and the first handle still reports.
        saver.save(_state(), good, options=dcpstore.SaveOptions(engine=engine)).result(timeout=60)
        with pytest.raises(SaveError):
            first.result()
    assert os.path.exists(os.path.join(good, ".metadata"))


@pytest.mark.parametrize("observe", ["result", "exception"])
def test_an_observed_failure_is_not_raised_again(tmp_path: Path, observe: str) -> None:
    bad, good = _unwritable(tmp_path), str(tmp_path / "good")
    with dcpstore.AsyncSaver() as saver:
        first = saver.save(_state(), bad, options=dcpstore.SaveOptions(engine="native"))
        if observe == "result":
            with pytest.raises(SaveError):
                first.result(timeout=60)
        else:
            assert isinstance(first.exception(timeout=60), SaveError)
        saver.save(_state(), good, options=dcpstore.SaveOptions(engine="native")).result(timeout=60)


@pytest.mark.parametrize("engine", ENGINES)
def test_close_raises_an_unobserved_failure(tmp_path: Path, engine: str) -> None:
    bad = _unwritable(tmp_path)
    saver = dcpstore.AsyncSaver()
    saver.save(_state(), bad, options=dcpstore.SaveOptions(engine=engine))
    with pytest.raises(SaveError, match="the saver is closed") as info:
        saver.close()
    assert bad in str(info.value)
    saver.close()  # idempotent: nothing left to report


def test_with_two_in_flight_the_failure_is_raised_by_the_save_after_it(tmp_path: Path) -> None:
    bad = _unwritable(tmp_path)
    with dcpstore.AsyncSaver(max_in_flight=2) as saver:
        first = saver.save(_state(), bad, options=dcpstore.SaveOptions(engine="native"))
        _wait_done(first)
        with pytest.raises(SaveError, match="failed and its handle never reported it"):
            saver.save(_state(), str(tmp_path / "b"), options=dcpstore.SaveOptions(engine="native"))


def test_module_level_async_save_raises_it_from_the_next_save(tmp_path: Path) -> None:
    bad = _unwritable(tmp_path)
    first = dcpstore.save(_state(), bad, async_=True, engine="native")
    _wait_done(first)
    with pytest.raises(SaveError) as info:
        dcpstore.save(_state(), str(tmp_path / "next"), async_=True, engine="native")
    assert bad in str(info.value)
    dcpstore.save(_state(), str(tmp_path / "next"), async_=True, engine="native").result(timeout=60)


def test_a_manager_save_raises_an_unobserved_async_failure(tmp_path: Path) -> None:
    bad = _unwritable(tmp_path)
    _wait_done(dcpstore.save(_state(), bad, async_=True, engine="native"))
    with dcpstore.CheckpointManager(
        str(tmp_path / "run"), options=dcpstore.SaveOptions(async_=True, engine="native")
    ) as mgr:
        with pytest.raises(SaveError) as info:
            mgr.save(_state(), 1)
        assert bad in str(info.value) and mgr.all_steps() == []
        mgr.save(_state(), 1).result(timeout=60)


@pytest.mark.parametrize("engine", SLOW_PROCESS)
def test_a_manager_raises_its_own_failed_save_from_the_next_one(tmp_path: Path, engine: str) -> None:
    root = tmp_path / "run"
    root.mkdir()
    with dcpstore.CheckpointManager(str(root), options=dcpstore.SaveOptions(async_=True, engine=engine)) as mgr:
        (root / "step_00000001").write_text("a file where the step's directory goes")
        handle = mgr.save(_state(), 1)
        _wait_done(handle)
        with pytest.raises(SaveError, match="step_00000001"):
            mgr.save(_state(), 2)
        mgr.save(_state(), 2).result(timeout=60)
        assert mgr.all_steps() == [2]


def _run(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("engine", SLOW_PROCESS)
def test_at_exit_an_unobserved_failure_is_reported_loudly_and_the_status_kept(tmp_path: Path, engine: str) -> None:
    bad = _unwritable(tmp_path)
    out = _run(
        f"""
        import torch, dcpstore
        dcpstore.save({{"w": torch.ones(10)}}, {bad!r}, async_=True, engine={engine!r})
        print("training done")
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "training done" in out.stdout
    report = out.stderr[out.stderr.index("at interpreter exit") :]
    assert bad in report and "FAILED" in report and "nobody asked for its result" in report
    # the traceback, down to the cause on the failed rank
    assert "Traceback" in report and "StorageNotFound: cannot create directory" in report


@pytest.mark.slow  # a fresh interpreter each; one such exit runs quick
def test_at_exit_an_observed_failure_is_not_reported_again(tmp_path: Path) -> None:
    bad = _unwritable(tmp_path)
    out = _run(
        f"""
        import torch, dcpstore
        h = dcpstore.save({{"w": torch.ones(10)}}, {bad!r}, async_=True, engine="native")
        try:
            h.result()
        except dcpstore.SaveError:
            print("handled")
        """,
        tmp_path,
    )
    assert out.returncode == 0 and "handled" in out.stdout, out.stderr
    assert "at interpreter exit" not in out.stderr


@pytest.mark.slow  # a fresh interpreter each; one such exit runs quick
def test_at_exit_a_managers_failed_last_save_is_reported_loudly(tmp_path: Path) -> None:
    root = tmp_path / "run"
    out = _run(
        f"""
        import os, torch, dcpstore
        mgr = dcpstore.CheckpointManager({str(root)!r}, options=dcpstore.SaveOptions(async_=True, engine="native"))
        mgr.save({{"w": torch.ones(10)}}, 1).result()
        open(os.path.join({str(root)!r}, "step_00000002"), "w").close()
        mgr.save({{"w": torch.ones(10)}}, 2)   # fails in the background; no wait(), no close()
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    report = out.stderr[out.stderr.index("at interpreter exit") :]
    assert "step_00000002" in report and "FAILED" in report and "Traceback" in report
    assert str(root) in report
