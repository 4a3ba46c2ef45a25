"""A hung storage call is bounded by a timeout, never a hang (Megatron-LM #2422).

A write that never returns is simulated with :class:`faults.BlockAt` inside
an async save. Then ``handle.result(timeout=...)`` raises ``TimeoutError``
promptly; a next save refuses to wait past ``hang_timeout``; ``close()``
too; and the process can still exit: at interpreter exit the saver waits at
most ``hang_timeout`` and logs which save it gave up on. A slow but healthy
save is still finished (and committed) at exit. The S3 side (a stalled
endpoint bounded by botocore's read timeout) is in test_s3_faults.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import dcpstore
from dcpstore._impl.util.errors import SaveError, StorageError
from tests.support.faults import BlockAt, hook_all_storage
from tests.support.helpers import assert_state_equal

REPO = Path(__file__).resolve().parents[2]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(1 << 16, generator=g), "b": torch.randn(1 << 16, generator=g)}


def test_hung_write_bounds_result_next_save_and_close(tmp_path, monkeypatch) -> None:
    hook = BlockAt(lambda e: e.startswith("write:__0_"), then=StorageError("the hung call finally failed"))
    hook_all_storage(hook, monkeypatch.setattr)
    saver = dcpstore.AsyncSaver(hang_timeout=1.0)
    uri = str(tmp_path / "hung")
    handle = saver.save(_state(), uri, options=dcpstore.SaveOptions(engine="native", workers=2))
    assert hook.reached.wait(60), "the save never reached its first write"
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="still running after 0.2 s") as info:
            handle.result(timeout=0.2)
        assert uri in str(info.value)
        assert time.monotonic() - t0 < 10  # prompt, even on a loaded box
        # The next save does not wait forever for the hung one: it refuses, clearly.
        t0 = time.monotonic()
        with pytest.raises(SaveError, match="presumed hung") as info:
            saver.save(_state(), str(tmp_path / "next"), options=dcpstore.SaveOptions(engine="native"))
        assert uri in str(info.value) and "hang_timeout=1" in str(info.value)
        assert time.monotonic() - t0 < 30
        assert not os.path.exists(tmp_path / "next" / ".metadata")
        with pytest.raises(SaveError, match="close\\(\\) stopped waiting"):
            saver.close()
    finally:
        hook.release()
    with pytest.raises(SaveError, match="the hung call finally failed"):
        handle.result(timeout=60)
    assert not os.path.exists(os.path.join(uri, ".metadata"))


def test_manager_next_save_and_close_do_not_wait_forever_for_a_hung_save(tmp_path, monkeypatch) -> None:
    """CheckpointManager.save() first finishes the previous save: with that
    one hung it must refuse after hang_timeout, not block (Megatron-LM #2422)."""
    from dcpstore._impl.engines import saver as async_engine

    monkeypatch.setattr(async_engine, "_default_saver", dcpstore.AsyncSaver(hang_timeout=1.0))
    hook = BlockAt(lambda e: e.startswith("write:__0_"), then=StorageError("the hung call finally failed"))
    hook_all_storage({str(tmp_path / "root" / "step_00000001"): hook}, monkeypatch.setattr)
    manager = dcpstore.CheckpointManager(
        str(tmp_path / "root"), keep=2, options=dcpstore.SaveOptions(async_=True, engine="native")
    )
    manager.save(_state(), 1)
    assert hook.reached.wait(60)
    try:
        with pytest.raises(TimeoutError):
            manager.wait(timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(SaveError, match="step 1 .*presumed hung"):
            manager.save(_state(), 2)
        assert time.monotonic() - t0 < 30
        assert manager.all_steps() == []
        with pytest.raises(SaveError, match="presumed hung"):
            manager.close()
    finally:
        hook.release()
    async_engine._default_saver.wait(timeout=60)
    # Its late failure was reported to nobody (the manager gave up on it as
    # hung): closing the saver raises it.
    with pytest.raises(SaveError, match="the hung call finally failed"):
        async_engine._default_saver.close()
    assert dcpstore.CheckpointManager(str(tmp_path / "root")).all_steps() == []


def _run_script(tmp_path: Path, body: str, timeout: float) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )


def test_exit_finishes_healthy_saves_and_gives_up_on_hung_ones(tmp_path) -> None:
    """One process, three async saves pending at exit: a slow healthy one is
    waited for and committed; a hung one on its own saver and a hung
    CheckpointManager step (hang_timeout=2 for both) are given up on with
    errors naming them, and the process exits. Before the fixes, exit joined
    the hung thread forever (ThreadPoolExecutor), and the manager's exit hook
    waited on the hung step forever."""
    slow, hung, root = tmp_path / "slow", tmp_path / "hung", tmp_path / "root"
    step = root / "step_00000001"
    out = _run_script(
        tmp_path,
        f"""
        import dataclasses, time, torch
        import dcpstore
        from dcpstore._impl.engines import saver as async_engine
        from tests.support.faults import BlockAt, hook_all_storage
        hook_all_storage({{
            {str(slow)!r}: lambda e: time.sleep(0.3) if e.startswith("write:") else None,
            {str(hung)!r}: BlockAt(lambda e: e.startswith("write:__0_")),
            {str(step)!r}: BlockAt(lambda e: e.startswith("write:__0_")),
        }})
        state = {{"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(1 << 16)}}
        async_engine._default_saver = dcpstore.AsyncSaver(hang_timeout=2)  # the manager's saver
        options = dcpstore.SaveOptions(engine="native", workers=2)
        dcpstore.CheckpointManager({str(root)!r}, keep=2, options=dataclasses.replace(options, async_=True)).save(state, 1)
        h = dcpstore.AsyncSaver(hang_timeout=2).save(state, {str(hung)!r}, options=options)
        slow = dcpstore.AsyncSaver()
        slow.save(state, {str(slow)!r}, options=options)
        try:
            h.result(timeout=0.5)
        except TimeoutError:
            print("result timed out", flush=True)
        print("pending at exit:", slow.pending(), flush=True)
        """,
        timeout=240,  # interpreter start + hang_timeout + the slow save: far below "forever"
    )
    assert out.returncode == 0, out.stderr
    assert "result timed out" in out.stdout and "pending at exit: 1" in out.stdout
    assert "presumed hung" in out.stderr and str(hung) in out.stderr and "exit stopped waiting" in out.stderr
    assert str(step) in out.stderr and "step 1" in out.stderr
    assert str(slow) not in out.stderr
    assert not (hung / ".metadata").exists() and not (step / ".metadata").exists()
    restored = {"a": torch.zeros(1 << 16), "b": torch.zeros(1 << 16)}
    dcpstore.load(restored, str(slow))
    assert_state_equal({"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(1 << 16)}, restored)
