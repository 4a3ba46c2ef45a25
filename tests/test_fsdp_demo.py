"""The FSDP2 demo runs end to end (fast mode), as CI and the README run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import dcpstore
from asyncprobe import requires_async

REPO = Path(__file__).parents[1]


@pytest.mark.parametrize("flags", [[], pytest.param(["--async"], marks=requires_async)], ids=["sync", "async"])
def test_demo_trains_crashes_and_resumes_on_another_world_size(tmp_path: Path, flags: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "fsdp_demo.py"), "--fast", "--root", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "rank 1 was killed at step 8" in out and "committed steps left: [4, 6]" in out, out
    assert "local" in out and " match" in out and "demo passed" in out, out
    # The resumed run (1 rank) continued from step 6 and committed step 8; keep=2.
    mgr = dcpstore.CheckpointManager(str(tmp_path / "ckpt"), async_=False)
    assert mgr.all_steps() == [6, 8] and mgr.read_pointer() == 8
    mgr.close()
