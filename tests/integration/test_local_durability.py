"""What a local save makes durable, and in which order, seen at the OS calls.

Every file a commit names (the data files, the manifest, ``.metadata``) is
fsynced under its temporary name before the rename that publishes it, and
the directory is fsynced after that rename; the data files and the manifest
are durable before ``.metadata`` is renamed into place, and ``.metadata``
itself before the save returns. The claim's alive file and in-flight
marker are not fsynced: a crash of the machine ends the save they speak
for, and the first data file's directory fsync persists their names anyway.
A large file's writeback starts while it is written, before its fsync.
"""

from __future__ import annotations

import os

import pytest
import torch

import dcpstore
from dcpstore._impl.storage import posix
from dcpstore._impl.storage.backends import local
from tests.support.helpers import assert_state_equal, sample_state, zeros_like_state


@pytest.mark.parametrize("over", [False, True], ids=["fresh", "over-a-commit"])
def test_a_local_save_fsyncs_what_it_commits_before_the_commit(tmp_path, monkeypatch, over: bool) -> None:
    uri = str(tmp_path / "ckpt")
    state = sample_state(3)
    if over:
        dcpstore.save(sample_state(4), uri).result()
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str, dst: str, **kwargs: object) -> None:
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]
        events.append(("replace", f"{os.fspath(src)} -> {os.fspath(dst)}"))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dcpstore.save(state, uri, workers=2).result()
    monkeypatch.undo()

    committed = sorted(f for f in os.listdir(uri) if f.endswith(".distcp") or f.endswith(".json") or f == ".metadata")
    data = [f for f in committed if f.endswith(".distcp")]
    assert len(data) == 2 and any(f.endswith(".json") for f in committed), committed
    published = {}
    for i, (kind, what) in enumerate(events):
        if kind == "replace":
            src, dst = what.split(" -> ")
            published[os.path.basename(dst)] = (i, src)
    metadata_at = published[".metadata"][0]
    for name in committed:
        at, src = published[name]
        assert ("fsync", src) in events[:at], f"{name} was renamed into place before its bytes were fsynced"
        dir_synced = [j for j, e in enumerate(events) if e == ("fsync", uri) and j > at]
        assert dir_synced, f"the directory was not fsynced after {name} was renamed into place"
        if name != ".metadata":
            assert dir_synced[0] < metadata_at, f"{name} was not durable before .metadata was published"
    claim = [what for kind, what in events if kind == "fsync" and (".dcpstore.alive" in what or "inflight" in what)]
    assert claim == [], claim
    loaded = zeros_like_state(state)
    dcpstore.load(loaded, uri)
    assert_state_equal(state, loaded)


def test_a_large_data_file_is_written_back_while_it_is_written(tmp_path, monkeypatch) -> None:
    """Writeback of a durable file starts every few MiB as it is written (the
    disk works during the writes, not only in the final fsync): the ranges
    follow each other from the file's start, and the file's bytes are
    still fsynced before it is published."""
    assert posix._sync_file_range() is not None  # Linux: libc's call is found
    kicked: list[tuple[str, int, int]] = []
    real = posix.start_writeback

    def start_writeback(fd: int, offset: int, length: int) -> None:
        kicked.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(posix, "start_writeback", start_writeback)
    monkeypatch.setattr(local, "start_writeback", start_writeback)
    state = {"big": torch.randn(6 << 20), "small": torch.randn(4)}  # 24 MiB and 16 bytes
    uri = str(tmp_path / "ckpt")
    dcpstore.save(state, uri, workers=1).result()
    files = {name for name, _, _ in kicked}
    assert len(files) == 1 and ".distcp" in next(iter(files)), kicked
    ranges = [(offset, length) for _, offset, length in kicked]
    assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:])), ranges
    assert sum(n for _, n in ranges) >= 16 << 20, ranges
    loaded = {"big": torch.zeros(6 << 20), "small": torch.zeros(4)}
    dcpstore.load(loaded, uri)
    assert torch.equal(loaded["big"], state["big"]) and torch.equal(loaded["small"], state["small"])
