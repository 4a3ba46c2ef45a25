"""A full disk fails a save cleanly on every engine: a real one.

A tmpfs of a few MiB is mounted in a private mount namespace (``unshare``;
as root, or through an unprivileged user namespace), and the scenario runs in
a child process inside it (tests/support/disk_full_child.py): a save larger than the
disk fails with a SaveError naming ENOSPC and the URI -- not torch's
"unexpected pos" -- leaves no data files behind, the previous checkpoint
still loads, and the next save succeeds. The NVRx engine writes in place, so
without its cleanup the failed save's files kept the space the next save
needed. tests/integration/test_local_faults.py injects ENOSPC at os.write instead, which
reaches the native writer only (NVRx writes through Python's open()).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.oracle import needs_nvrx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where tests.support imports from


def _run_in_small_tmpfs(mountpoint: str, engines: list[str]) -> subprocess.CompletedProcess[str]:
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare to mount a private tmpfs")
    probe = subprocess.run(
        ["unshare", "-rm", "--propagation", "private", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mountpoint}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.strip()}")
    script = f"mount -t tmpfs -o size=4m tmpfs {mountpoint} && exec {sys.executable} -m tests.support.disk_full_child {mountpoint} {' '.join(engines)}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        ["unshare", "-rm", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@needs_nvrx
def test_disk_full_fails_cleanly_and_the_next_save_succeeds(tmp_path) -> None:
    mountpoint = tmp_path / "small"
    mountpoint.mkdir()
    done = _run_in_small_tmpfs(str(mountpoint), ["nvrx", "native", "sync"])
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr
    assert "nvrx:" in done.stdout and "ENOSPC" in done.stdout
