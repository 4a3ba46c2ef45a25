"""``ls`` and ``gc`` against every layout stock DCP commits, foreign files,
and saves that are still running.

``gc`` removes only what it understands as an interrupted save's leftovers:
a stock checkpoint committed through rank-local ``__{rank}.metadata``
(``use_collectives=False``) is committed, a directory holding files no DCP
save writes is left alone, and a running save is never collected -- not by
``gc --older-than 1`` from another process either (its alive file names a
live process, and is refreshed while the save runs). A save whose marker
was removed under it says so, instead of blaming "another save".
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dcpstore
from dcpstore._impl.dcp.liveness import alive_file
from dcpstore._impl.tools.maintenance import gc, list_checkpoints
from dcpstore._impl.util.errors import SaveError, StorageError
from tests.support.faults import BlockAt, FailAt, hook_all_storage
from tests.support.helpers import assert_state_equal
from tests.support.hostile_kit import cli

STATE = {"w": torch.arange(64.0).reshape(8, 8), "n": 3}


def _stock(path: Path, *, use_collectives: bool = True) -> Path:
    dcp.save(STATE, storage_writer=FileSystemWriter(str(path)), no_dist=True, use_collectives=use_collectives)
    return path


def test_rank_local_stock_checkpoint_is_committed_and_never_collected(tmp_path: Path) -> None:
    ckpt = _stock(tmp_path / "root" / "local", use_collectives=False)
    assert "__0.metadata" in os.listdir(ckpt) and ".metadata" not in os.listdir(ckpt)
    code, out, _ = cli("ls", str(tmp_path / "root"))
    assert code == 0 and out.splitlines()[1].split()[:2] == ["local", "committed"] and "rank-local" in out, out
    assert cli("gc", "--older-than", "0", str(tmp_path / "root")) == (0, "nothing to clean up\n", "")
    # Still whole: stock DCP loads it (the oracle); dcpstore says what it is.
    loaded = {"w": torch.zeros(8, 8), "n": 0}
    dcp.load(loaded, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    assert torch.equal(loaded["w"], STATE["w"]) and loaded["n"] == 3
    with pytest.raises(
        dcpstore.CheckpointNotFound, match=r"rank-local metadata \(__0\.metadata\).*use_collectives=False"
    ):
        dcpstore.load({"w": torch.zeros(8, 8)}, str(ckpt))


def test_interrupted_stock_commit_is_collected(tmp_path: Path) -> None:
    """What a stock save killed mid-commit leaves: data files and .metadata.tmp."""
    ckpt = _stock(tmp_path / "root" / "wreck")
    os.rename(ckpt / ".metadata", ckpt / ".metadata.tmp")
    (entry,) = list_checkpoints(dcpstore.open_storage(str(tmp_path / "root")))
    assert not entry.committed and not entry.unknown
    report = gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=0)
    assert report.removed == ["wreck"] and not ckpt.exists()


def test_foreign_files_keep_a_directory_from_gc(tmp_path: Path) -> None:
    ckpt = _stock(tmp_path / "root" / "mixed")
    (ckpt / ".metadata").unlink()
    (ckpt / "model.safetensors").write_bytes(b"someone's weights")
    (ckpt / "README").write_text("do not delete")
    code, out, _ = cli("gc", "--older-than", "0", str(tmp_path / "root"))
    assert code == 0 and "kept mixed: holds files no DCP save writes" in out and "README" in out, out
    assert sorted(os.listdir(ckpt)) == ["README", "__0_0.distcp", "model.safetensors"]
    code, out, _ = cli("ls", str(tmp_path / "root"))
    assert "incomplete" in out and "gc leaves it alone" in out


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)  # the same values every call: a load is compared with them
    return {"a": torch.randn(1 << 15, generator=g), "b": torch.randn(1 << 15, generator=g)}


def _refreshed_after(path: Path, mtime: float, timeout_s: float = 30.0) -> bool:
    """Whether ``path``'s modification time moves past ``mtime`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.stat(path).st_mtime > mtime:
            return True
        time.sleep(0.05)
    return False


def _gc_in_another_process(root: Path, older_than: str = "1") -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dcpstore._impl.cli", "gc", "--older-than", older_than, str(root)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_running_save_is_never_collected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gc --older-than 1`` from another process while a save waits in the
    middle of its writes, for longer than that: nothing of it goes."""
    monkeypatch.setattr(alive_file, "REFRESH_S", 0.3)  # refreshed many times during the test
    hook = BlockAt(lambda e: e.startswith("write:__0_"))
    root = tmp_path / "root"
    hook_all_storage({str(root / "ck"): hook}, monkeypatch.setattr)
    saver = dcpstore.AsyncSaver()
    handle = saver.save(_state(), str(root / "ck"), options=dcpstore.SaveOptions(engine="native", workers=2))
    try:
        assert hook.reached.wait(60)
        alive = [n for n in os.listdir(root / "ck") if alive_file.is_alive_file(n)]
        assert len(alive) == 1 and (root / "ck" / ".dcpstore.inflight").exists()
        alive_path = root / "ck" / alive[0]
        assert _refreshed_after(alive_path, os.stat(alive_path).st_mtime)  # refreshed while the save waits
        # Every file of the save older than --older-than (the alive file too,
        # until its next refresh): only its owner's liveness keeps it.
        old = time.time() - 60
        for name in os.listdir(root / "ck"):
            os.utime(root / "ck" / name, (old, old))
        out = _gc_in_another_process(root)
        assert "kept ck: a save is running there" in out, out
        assert (root / "ck" / ".dcpstore.inflight").exists() and alive_path.exists()
        assert _refreshed_after(alive_path, old)  # and still refreshed after gc
    finally:
        hook.release()
    handle.result(timeout=120)
    saver.close()
    assert sorted(os.listdir(root / "ck")) == [".dcpstore.json", ".metadata", "__0_0.distcp", "__0_1.distcp"]
    loaded = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcpstore.load(loaded, str(root / "ck"))
    assert_state_equal(_state(), loaded)  # the save gc let run committed exactly what it was given


def _alive(ckpt: Path, owner: alive_file.Owner, age_s: float) -> None:
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(b"partial")
    (ckpt / ".dcpstore.inflight").write_text("0123456789abcdef")
    (ckpt / ".dcpstore.alive.0123456789abcdef").write_bytes(alive_file.encode_alive("0123456789abcdef", owner))
    for name in os.listdir(ckpt):
        os.utime(ckpt / name, (time.time() - age_s, time.time() - age_s))


def test_alive_file_of_another_machine_counts_until_its_lease_ends(tmp_path: Path) -> None:
    elsewhere = alive_file.Owner(host="node7", boot="another-boot", pidns="pid:[1]", pid=1, start="1")
    _alive(tmp_path / "root" / "fresh", elsewhere, age_s=30)
    _alive(tmp_path / "root" / "stale", elsewhere, age_s=alive_file.LEASE_S + 60)
    report = gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=0)
    assert report.kept_running == ["fresh"] and report.removed == ["stale"]


def test_alive_file_of_a_dead_process_here_is_collected_at_once(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = alive_file.Owner.current()
    dead = alive_file.Owner(host=me.host, boot=me.boot, pidns=me.pidns, pid=child.pid, start="0")
    _alive(tmp_path / "root" / "dead", dead, age_s=0)
    _alive(tmp_path / "root" / "mine", me, age_s=0)
    report = gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=0)
    assert report.removed == ["dead"] and report.kept_running == ["mine"]
    assert dead.running() is False and me.running() is True


def test_failed_save_leaves_nothing_that_looks_alive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hook = FailAt(lambda e: e.startswith("write:__0_1"), StorageError("disk on fire"))
    hook_all_storage({str(tmp_path / "root" / "ck"): hook}, monkeypatch.setattr)
    with pytest.raises(SaveError, match="disk on fire"):
        dcpstore.save(_state(), str(tmp_path / "root" / "ck"), workers=2)
    assert not any(alive_file.is_alive_file(n) for n in os.listdir(tmp_path / "root" / "ck"))
    assert gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=0).removed == ["ck"]


def test_a_marker_removed_under_a_save_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Removed from a directory without a commit (what ``gc`` does to the
    marker of a dead save it listed just before a new save's claim replaced
    it): no other save has the URI, so the save puts it back and commits."""
    uri = tmp_path / "ck"

    def remove_marker(event: str) -> None:
        if event.startswith("commit:__0_0"):
            (uri / ".dcpstore.inflight").unlink(missing_ok=True)

    hook_all_storage({str(uri): remove_marker}, monkeypatch.setattr)
    state = _state()
    with caplog.at_level(logging.WARNING, logger="dcpstore"):
        dcpstore.save(state, str(uri), workers=1)
    assert "was removed while it was writing (by 'dcpstore gc' or by hand)" in caplog.text
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcpstore.load(loaded, str(uri))
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert sorted(os.listdir(uri)) == [".dcpstore.json", ".metadata", "__0_0.distcp"]


def test_save_whose_marker_was_removed_beside_a_commit_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside a commit, a missing marker may be another save's that
    committed and cleaned up: the save fails, and says both."""
    uri = tmp_path / "ck"
    dcpstore.save(_state(), str(uri), workers=1)

    def remove_marker(event: str) -> None:
        if event.startswith("commit:__0_"):
            (uri / ".dcpstore.inflight").unlink(missing_ok=True)

    hook_all_storage({str(uri): remove_marker}, monkeypatch.setattr)
    with pytest.raises(SaveError) as info:
        dcpstore.save(_state(), str(uri), workers=1)
    assert "another save to" in str(info.value) and "in-flight marker was removed by hand" in str(info.value)


def test_ls_json_reports_layout_and_liveness(tmp_path: Path) -> None:
    _stock(tmp_path / "root" / "local", use_collectives=False)
    _alive(tmp_path / "root" / "running", alive_file.Owner.current(), age_s=0)
    entries: list[dict[str, Any]] = json.loads(cli("ls", "--json", str(tmp_path / "root"))[1])
    by_path = {e["path"]: e for e in entries}
    assert by_path["local"]["committed"] and by_path["local"]["rank_local"]
    assert not by_path["running"]["committed"] and len(by_path["running"]["alive"]) == 1
    assert cli("ls", str(tmp_path / "root"))[1].splitlines()[2].split()[:2] == ["running", "saving"]
