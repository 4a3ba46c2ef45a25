"""``dcpstore gc --older-than 0`` racing every kind of running save (issue #29,
item 4, and its class).

A gc loop in a process of its own (tests/support/gc_loop.py) runs over the roots
while saves run: sync, async native, NVRx, to fresh directories and over a
committed checkpoint, local and S3 (moto), a tiered manager's local commit
and its replication (gc on both tiers). Held: no save fails, every
committed checkpoint loads exactly what was saved, and the leftovers of a
save that died (SIGKILLed mid-write, planted before the loop: its alive
file names a dead process, its temporary files are past the lease) are
removed by the same loop. The issue's numbers: 32 of 40 saves to
``/tmp/r/s{i}`` failed, and a tiered replication died ("cannot write
.../.dcpstore.alive.<id>").

Deterministic interleavings (the rule's parts, one at a time):

* the save's alive file lands before its in-flight marker, so a listing
  that shows the marker shows the proof of life;
* an alive file listed and gone when gc reads it means its save just ended
  (committed, or failed): gc keeps the directory this round, since the
  commit it read before may be the old one (deleting what that commit does
  not name would delete the new commit's files);
* in-progress writes are listed before the checkpoints (a write gc sees
  belongs to a save whose alive file it sees), removed by identity (an
  upload started later under the same key is another upload), and never
  while younger than the lease (the alive file's own write is one);
* a marker gc removed from an uncommitted directory (one it listed before
  a new save claimed it) is put back by the save, which commits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.dcp.liveness import alive_file
from dcpstore._impl.engines import nvrx as nvrx_engine
from dcpstore._impl.format.layout import INFLIGHT, METADATA
from dcpstore._impl.tools import listing
from dcpstore._impl.tools.maintenance import gc, list_checkpoints
from tests.support.backends import make_target
from tests.support.faults import BlockAt, hook_all_storage
from tests.support.gc_loop import gc_loop
from tests.support.helpers import assert_state_equal, zeros_like_state

ROOT = Path(__file__).resolve().parents[2]  # where tests.support imports from


def _state(i: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(1 << 14, generator=g), "b": torch.randn(300, generator=g), "i": i}


def _loads(uri: str, i: int, **kwargs: Any) -> None:
    out = zeros_like_state(_state(i))
    dcpstore.load(out, uri, **kwargs)
    assert_state_equal(_state(i), out)


def plant_wreck(uri: str, kwargs: dict[str, Any] | None = None) -> None:
    """What a save SIGKILLed mid-write leaves at ``uri``: its marker, its
    alive file (naming a process that is gone), data files, a temporary
    file or an open upload (``kwargs``: the object-store target's, whose
    options the child uses). Its files are made to look 10 minutes old where
    the backend lets us (local), past the lease."""
    code = textwrap.dedent(
        f"""
        import sys, torch, dcpstore
        sys.path.insert(0, {str(ROOT)!r})
        from tests.support.backends import OBJECT_STORE_OPTIONS
        from tests.support.faults import KillOn, hook_all_storage
        hook_all_storage(KillOn("wrote:__0_", prefix=True))
        options = {{"storage_options": OBJECT_STORE_OPTIONS}} if {bool(kwargs)!r} else {{}}
        dcpstore.save({{"w": torch.randn(1 << 16), "v": torch.randn(1 << 16)}}, {uri!r}, workers=2, **options)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    if "://" not in uri:
        past = time.time() - 600
        for path in Path(uri).rglob("*"):
            os.utime(path, (past, past))


def _leftovers(storage: dcpstore.storage.Storage) -> list[str]:
    return [e.path for e in list_checkpoints(storage) if not e.committed or e.leftovers or e.mixed]


# -- the case: sync saves to fresh directories -------------------------


def test_gc_loop_beside_saves_to_fresh_directories(tmp_path: Path) -> None:
    root = tmp_path / "r"
    plant_wreck(str(root / "dead"))
    with gc_loop([str(root)]) as loop:
        failures = []
        for i in range(40):
            try:
                dcpstore.save(_state(i), str(root / f"s{i}"), workers=2)
            except dcpstore.SaveError as e:
                failures.append(f"s{i}: {e}")
    assert not failures, f"{len(failures)} of 40 saves failed: {failures[:3]}"
    assert loop.rounds >= 3
    for i in range(40):
        _loads(str(root / f"s{i}"), i)
    assert not (root / "dead").exists(), os.listdir(root / "dead")  # the wreck went, in the loop


# -- every kind of save ----------------------------------------------------------

needs_nvrx = pytest.mark.skipif(nvrx_engine.import_error() is not None, reason="nvidia-resiliency-ext not installed")


@pytest.mark.parametrize(
    "how",
    [
        pytest.param({"async_": False}, id="sync"),
        pytest.param({"async_": True, "engine": "native"}, id="async-native"),
        pytest.param({"async_": True, "engine": "nvrx"}, id="async-nvrx", marks=[needs_nvrx, pytest.mark.slow]),
        pytest.param({"async_": False, "engine": "nvrx"}, id="sync-nvrx", marks=needs_nvrx),
    ],
)
@pytest.mark.parametrize("backend", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_gc_loop_beside_every_kind_of_save(request: pytest.FixtureRequest, backend: str, how: dict[str, Any]) -> None:
    """Fresh directories and overwrites of a committed checkpoint, alternating."""
    if backend != "local" and how.get("engine") == "nvrx":
        pytest.skip("NVRx writes local paths and MSC only")
    target = make_target(backend, request)
    plant_wreck(target.child("dead").uri, target.kwargs)
    handles = []
    with gc_loop([target.uri]):
        for i in range(12):
            uri = target.child(f"s{i}" if i % 2 else "over").uri  # odd: fresh; even: over the previous one
            handles.append((uri, i, dcpstore.save(_state(i), uri, workers=2, **how, **target.kwargs)))
            if how["async_"] and i % 3 == 2:
                handles[-1][2].result()
        errors = []
        for uri, _, handle in handles:
            try:
                handle.result()
            except dcpstore.SaveError as e:
                errors.append(f"{uri}: {e}")
    assert not errors, errors[:3]
    for uri, i, _ in handles:
        if uri.endswith("/over") and i != 10:
            continue  # replaced by the next even save
        _loads(uri, i, **target.kwargs)
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    if backend == "local":
        assert _leftovers(storage) == [], _leftovers(storage)  # the wreck went, in the loop


@pytest.mark.parametrize("durable_backend", ["local", "s3"])
def test_gc_loop_beside_a_tiered_manager(request: pytest.FixtureRequest, tmp_path: Path, durable_backend: str) -> None:
    """gc on the durable root and on the local tier while steps commit
    locally and replicate (overwrites included)."""
    durable = make_target(durable_backend, request)
    local = tmp_path / "nvme"
    with gc_loop([durable.uri, str(local)]):
        with dcpstore.CheckpointManager(
            durable.uri, local_dir=str(local), keep=3, local_keep=2, options=durable.save_options(async_=True)
        ) as mgr:
            for step in range(1, 9):
                mgr.save(_state(step), step, overwrite=step == 6)
                if step == 5:
                    mgr.save(_state(50), 5, overwrite=True)
            mgr.wait()
    assert dcpstore.CheckpointManager(durable.uri, options=durable.save_options(async_=True)).all_steps() == [6, 7, 8]
    for step in (6, 7, 8):
        _loads(f"{durable.uri}/step_{step:08d}", step, **durable.kwargs)


# -- the rule's parts, one interleaving each --------------------------------------


def test_an_alive_file_gone_before_gc_reads_it_keeps_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc lists an overwrite in flight, reads the commit there (the old
    one), and the overwrite then commits and cleans up before gc reads its
    alive file: the files the old commit does not name are the new
    commit's. gc must keep the directory this round (it deleted them)."""
    root, uri = tmp_path / "root", tmp_path / "root" / "ck"
    dcpstore.save(_state(1), str(uri), workers=2)
    gate = BlockAt(lambda e: e == f"open:{METADATA}")
    hook_all_storage({str(uri): gate}, monkeypatch.setattr)
    saver = dcpstore.AsyncSaver()
    handle = saver.save(_state(2), str(uri), options=dcpstore.SaveOptions(engine="native", workers=2))
    assert gate.reached.wait(60)
    real = listing._commit_files

    def then_commit(storage: Any, names: list[str]) -> Any:
        files = real(storage, names)  # the old commit's
        gate.release()
        handle.result(timeout=120)  # committed, marker and alive file removed
        return files

    monkeypatch.setattr(listing, "_commit_files", then_commit)
    report = gc(dcpstore.open_storage(str(root)), older_than_s=0)
    saver.close()
    assert report.kept_running == ["ck"] and not report.removed, report
    _loads(str(uri), 2)


def test_a_fresh_in_progress_write_is_kept_whatever_older_than_says(tmp_path: Path) -> None:
    """Before a save's alive file lands, the write of that file is all gc
    can see of the save (a temporary file in a fresh directory): kept for a
    lease; a stale one (its writer died) is removed."""
    fresh = tmp_path / "root" / "new" / f".{alive_file.ALIVE_PREFIX}0123456789abcdef.dcpstore-tmp-aaaaaaaaaaaa"
    stale = tmp_path / "root" / "old" / ".__0_0.distcp.dcpstore-tmp-bbbbbbbbbbbb"
    for path in (fresh, stale):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"{")
    past = time.time() - alive_file.LEASE_S - 60
    os.utime(stale, (past, past))
    report = gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=0)
    assert report.incomplete_uploads == 1 and fresh.exists() and not stale.exists()


def test_gc_aborts_the_upload_it_listed_not_a_later_one_of_the_same_key(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead save's open upload of ``ck/__0_0.distcp``; gc lists it, and a
    new save starts an upload of the same key before gc aborts: only the
    dead one goes (moto dates every upload 2010, so age cannot tell them apart)."""
    target = make_target("s3", request)
    root = dcpstore.open_storage(target.uri, **target.kwargs)
    client, bucket = root.client, root.bucket  # type: ignore[attr-defined]
    key = root.key("ck/__0_0.distcp")  # type: ignore[attr-defined]
    dead = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    later: list[str] = []
    real = type(root).incomplete_writes

    def then_a_new_upload(self: Any) -> Any:
        listed = real(self)
        if not later:
            later.append(client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"])
        return listed

    monkeypatch.setattr(type(root), "incomplete_writes", then_a_new_upload)
    assert gc(root, older_than_s=0).incomplete_uploads == 1
    open_ids = [u["UploadId"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])]
    assert open_ids == later and dead not in open_ids
    client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=later[0])


def test_a_dead_saves_marker_is_left_to_a_save_that_claimed_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside a commit, the marker of a killed overwrite; a new overwrite
    claims the directory right after gc listed it. The marker is the new
    save's now: gc removes the wreck's files but not it, and the save commits."""
    root, uri = tmp_path / "root", tmp_path / "root" / "ck"
    dcpstore.save(_state(1), str(uri), workers=2)
    plant_wreck(str(uri))  # an overwrite killed mid-write: marker, dead alive file, tagged data
    gate = BlockAt(lambda e: e.startswith("open:__0_"))  # the new save, after its claim
    hook_all_storage({str(uri): gate}, monkeypatch.setattr)
    saver = dcpstore.AsyncSaver()
    real = listing.list_checkpoints
    started: list[Any] = []

    def then_claim(storage: Any) -> Any:
        entries = real(storage)
        if not started:
            started.append(saver.save(_state(2), str(uri), options=dcpstore.SaveOptions(engine="native", workers=2)))
            assert gate.reached.wait(60)
        return entries

    monkeypatch.setattr(listing, "list_checkpoints", then_claim)
    report = gc(dcpstore.open_storage(str(root)), older_than_s=0)
    assert (uri / INFLIGHT).exists(), report
    gate.release()
    started[0].result(timeout=120)
    saver.close()
    _loads(str(uri), 2)


def test_a_directory_removed_under_a_new_save_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc deletes a dead save's files and the directory they emptied, just
    after a new save made it and before its first file: the save makes it
    again."""
    uri = tmp_path / "ck"

    def remove_dir(event: str) -> None:
        if event == "list" and uri.is_dir() and not os.listdir(uri):
            uri.rmdir()

    hook_all_storage({str(uri): remove_dir}, monkeypatch.setattr)
    dcpstore.save(_state(3), str(uri), workers=2)
    _loads(str(uri), 3)


# -- multi-rank tiered managers: node-local tiers, other ranks' replication -----


def _tiered_ranks(rank: int, world: int, durable: str, dirs: list[str]) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    with dcpstore.CheckpointManager(
        durable, local_dir=dirs[rank], keep=2, local_keep=2, async_=True, options=dcpstore.SaveOptions(engine="native")
    ) as mgr:
        for step in range(1, 6):
            full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + step
            mgr.save({"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}, step, overwrite=step == 4)
            if step == 3:
                mgr.save({"w": distribute_tensor(full * 0, mesh, [Shard(0)]), "step": -3}, 3, overwrite=True)
        mgr.wait()


@pytest.mark.parametrize("per_node", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["node-local", "one-dir"])
def test_gc_loop_beside_a_multi_rank_tiered_manager(tmp_path: Path, per_node: int) -> None:
    """Two ranks (two nodes of one, or one directory): every rank uploads
    its own files to the durable tier and the coordinator commits; each
    node's leader commits its directory's copy. gc on every directory
    breaks none of it."""
    from tests.support.dist_utils import run_ranks

    durable = tmp_path / "durable"
    dirs = [str(tmp_path / f"node{rank // per_node}") for rank in range(2)]
    with gc_loop([str(durable), *sorted(set(dirs))]):
        run_ranks(_tiered_ranks, 2, str(durable), dirs)
    assert dcpstore.CheckpointManager(str(durable)).all_steps() == [4, 5]
    for step in (4, 5):
        dest = {"w": torch.zeros(64, 8), "step": 0}
        dcpstore.load(dest, str(durable / f"step_{step:08d}"))
        assert (
            torch.equal(dest["w"], torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + step)
            and dest["step"] == step
        )
