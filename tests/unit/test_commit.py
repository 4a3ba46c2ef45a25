"""The commit protocol as one object: dcpstore._impl.dcp.commit.SaveSession.

Every writer (native, NVRx) runs a save through a session; these tests drive
one directly on a real local directory, with the storage calls recorded, so
the protocol's order is checked where it is written: claim before any data,
the manifest before ``.metadata``, ``.metadata`` (the commit point) before
any clean-up, and a save that lost its URI to a later one commits nothing.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import crc32c
import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

import dcpstore
from dcpstore._impl.dcp.commit import ItemRecord, SaveSession, read_checkpoint_metadata
from dcpstore._impl.dcp.liveness.alive_file import alive_name, is_alive_file
from dcpstore._impl.format.layout import INFLIGHT, MANIFEST, METADATA
from dcpstore._impl.tools.maintenance import gc
from tests.support import extras
from tests.support.faults import EventStorage, FailAt, Recorder, hook_all_storage


def _storage(path: Path) -> tuple[EventStorage, Recorder]:
    recorder = Recorder()
    return EventStorage(dcpstore.open_storage(str(path)), recorder), recorder


def _write(session: SaveSession, rank: int, payload: bytes) -> list[WriteResult]:
    """One data file of one item, as a writer would publish it."""
    name = session.data_file(f"__{rank}_", 0)
    session.check_owner()
    session.storage.put(name, payload)
    crc = crc32c.crc32c(payload)
    record = ItemRecord(name, 0, len(payload), crc, len(payload), crc)
    return [WriteResult(index=MetadataIndex(f"k{rank}"), size_in_bytes=len(payload), storage_data=record)]


def _publish(session: SaveSession, results: list[list[WriteResult]]) -> None:
    """Commit ``results`` with DCP's global metadata for them (one non-tensor key per item)."""
    keys = {wr.index.fqn: BytesStorageMetadata() for rank in results for wr in rank}
    session.publish(Metadata(state_dict_metadata=keys), results)


def test_claim_write_publish_in_order(tmp_path: Path) -> None:
    storage, events = _storage(tmp_path / "ck")
    coordinator = SaveSession(storage)
    coordinator.claim()
    follower = SaveSession(storage, coordinator.save_id)  # what rank 1 builds from the plan
    results = [_write(coordinator, 0, b"zero"), _write(follower, 1, b"one")]
    _publish(coordinator, results)

    puts = [e.split(":", 1)[1] for e in events.events if e.startswith("commit:")]
    alive = alive_name(coordinator.save_id)  # the claim's proof of life for gc, before the marker
    assert puts == [alive, INFLIGHT, "__0_0.distcp", "__1_0.distcp", MANIFEST, METADATA]
    assert events.events[-1].startswith("delete:") and INFLIGHT in events.events[-1] and alive in events.events[-1]
    metadata, manifest = read_checkpoint_metadata(storage)
    assert manifest is not None and sorted(manifest["files"]) == ["__0_0.distcp", "__1_0.distcp"]
    assert metadata.storage_meta is not None and metadata.storage_meta.save_id == coordinator.save_id
    assert not (tmp_path / "ck" / INFLIGHT).exists() and not (tmp_path / "ck" / alive).exists()


def _committed(storage: EventStorage) -> tuple[str, list[str]]:
    """The save id the URI's commit records, and the files its manifest lists."""
    metadata, manifest = read_checkpoint_metadata(storage)
    assert metadata.storage_meta is not None and manifest is not None
    return metadata.storage_meta.save_id, sorted(manifest["files"])


def test_an_overwrite_keeps_the_old_commit_until_its_own_then_removes_the_old_files(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    storage, _ = _storage(ck)
    first = SaveSession(storage)
    first.claim()
    _publish(first, [_write(first, 0, b"old0"), _write(first, 1, b"old1")])
    # A fresh URI: stock DCP's names.
    assert sorted(p.name for p in ck.iterdir()) == sorted([METADATA, MANIFEST, "__0_0.distcp", "__1_0.distcp"])

    second = SaveSession(storage)
    second.claim()
    follower = SaveSession(storage, *second.token)  # what rank 1 builds from the plan
    results = [_write(second, 0, b"new0"), _write(follower, 1, b"new1")]
    new_files = [f"__0_{second.tag}_0.distcp", f"__1_{second.tag}_0.distcp"]
    assert len(second.tag) == 8 and follower.tag == second.tag
    assert sorted(r[0].storage_data.relative_path for r in results) == new_files
    assert _committed(storage) == (first.save_id, ["__0_0.distcp", "__1_0.distcp"])  # until the commit: the old one
    _publish(second, results)
    assert _committed(storage) == (second.save_id, new_files)
    assert sorted(p.name for p in ck.iterdir()) == sorted([METADATA, f".dcpstore.{second.tag}.json", *new_files])
    assert (ck / new_files[0]).read_bytes() == b"new0"

    third = SaveSession(storage)  # and over that one again: a new tag, the old files go
    third.claim()
    assert third.tag not in ("", second.tag)
    _publish(third, [_write(third, 0, b"third")])
    assert sorted(p.name for p in ck.iterdir()) == sorted(
        [METADATA, f".dcpstore.{third.tag}.json", f"__0_{third.tag}_0.distcp"]
    )


def test_a_claim_with_overwrite_false_refuses_a_committed_uri(tmp_path: Path) -> None:
    storage, _ = _storage(tmp_path / "ck")
    fresh = SaveSession(storage)
    fresh.claim(overwrite=False)  # nothing committed there: fine
    fresh.release()
    first = SaveSession(storage)
    first.claim(overwrite=False)
    _publish(first, [_write(first, 0, b"old0")])
    before = sorted(os.listdir(tmp_path / "ck"))
    with pytest.raises(dcpstore.CheckpointExists, match="already exists") as info:
        SaveSession(storage).claim(overwrite=False)
    assert isinstance(info.value, FileExistsError) and str(tmp_path / "ck") in str(info.value)
    assert sorted(os.listdir(tmp_path / "ck")) == before  # nothing written, nothing removed


def test_a_save_that_lost_its_uri_commits_nothing(tmp_path: Path) -> None:
    storage, _ = _storage(tmp_path / "ck")
    early = SaveSession(storage)
    early.claim()
    results = [_write(early, 0, b"early")]
    late = SaveSession(storage)
    late.claim()  # a later save to the same URI
    with pytest.raises(dcpstore.SaveError, match="another save .* started while this one was writing"):
        _publish(early, results)
    with pytest.raises(dcpstore.SaveError, match="another save"):
        _write(early, 1, b"more")
    assert not (tmp_path / "ck" / METADATA).exists()
    _publish(late, [_write(late, 0, b"late")])
    assert pickle.loads((tmp_path / "ck" / METADATA).read_bytes()).storage_meta.save_id == late.save_id


def test_every_writer_commits_through_the_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Native sync, native async and (where installed) NVRx: each save claims
    and publishes exactly once, through SaveSession."""
    calls: list[str] = []
    for name in ("claim", "publish"):
        real = getattr(SaveSession, name)

        def spy(self: SaveSession, *args: object, _real: object = real, _name: str = name) -> None:
            calls.append(_name)
            _real(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(SaveSession, name, spy)
    state = {"w": torch.arange(8.0)}
    dcpstore.save(state, str(tmp_path / "sync"), engine="native")
    dcpstore.save(state, str(tmp_path / "async"), async_=True, engine="native").result()
    saves = 2
    if extras.missing(extras.NVRX) is None:
        dcpstore.save(state, str(tmp_path / "nvrx"), async_=True, engine="nvrx").result()
        saves += 1
    assert calls == ["claim", "publish"] * saves
    extras.skip_unless(extras.NVRX, "the NVRx engine's save was not checked (the others' were)")


@pytest.mark.parametrize("where", ["data", "commit"])
@pytest.mark.parametrize("engine, async_", [("native", False), ("native", True), ("nvrx", False), ("nvrx", True)])
def test_every_writer_releases_a_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, async_: bool, where: str
) -> None:
    """A save that fails -- writing (or, for NVRx, reading back) a data
    file, or publishing the manifest -- leaves no alive file: ``gc`` then
    collects what it left instead of keeping it as a running save."""
    if engine == "nvrx":
        extras.skip_unless(extras.NVRX)
    uri = tmp_path / "root" / "ck"
    at = ("commit:" + MANIFEST,) if where == "commit" else ("write:__0_", "read:__0_")
    fail = FailAt(lambda e: e.startswith(at), dcpstore.StorageError("disk on fire"))
    hook_all_storage({str(uri): fail}, monkeypatch.setattr)
    with pytest.raises(dcpstore.SaveError, match="disk on fire"):
        dcpstore.save({"w": torch.arange(8.0)}, str(uri), engine=engine, async_=async_).result()
    names = os.listdir(uri)
    assert INFLIGHT in names and not any(is_alive_file(n) for n in names), names
    assert gc(dcpstore.open_storage(str(tmp_path / "root")), older_than_s=0).removed == ["ck"]
