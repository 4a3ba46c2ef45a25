"""Commit files: a caller's own small files (Lightning's ``meta.pt``) inside
dcpstore's commit.

A save hands them to the writer (``dcpstore.StorageWriter(uri,
commit_files={...})``); the coordinator writes them after every rank's data
and before the manifest, the manifest records each one's size and CRC32C,
``.metadata`` commits them with the rest. Over a committed checkpoint they go
under save-unique names and are copied to the plain name only after the new
``.metadata`` landed, so the checkpoint being replaced keeps its own until
then. Run on every backend, through ``dcp.save`` as the adapters call it.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcpstore
from dcpstore._impl.dcp.commit import read_checkpoint_metadata, read_commit_file
from dcpstore._impl.format.layout import MANIFEST, METADATA, commit_file_path, is_commit_side_file, is_manifest
from dcpstore._impl.tools.maintenance import gc, list_checkpoints, verify_checkpoint
from tests.support.backends import Target
from tests.support.helpers import assert_state_equal, sample_state, zeros_like_state

META = "meta.pt"


def _blob(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _save(target: Target, state: dict[str, Any], meta: Any) -> None:
    writer = dcpstore.StorageWriter(target.uri, commit_files={META: _blob(meta)}, options=target.save_options())
    dcp.save(state, storage_writer=writer)


def _commit_file(target: Target) -> Any:
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    try:
        _, manifest = read_checkpoint_metadata(storage)
        return torch.load(io.BytesIO(read_commit_file(storage, manifest, META)), weights_only=True)
    finally:
        storage.close()


def _names(target: Target) -> set[str]:
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    try:
        return {o["path"] for o in storage.list()}
    finally:
        storage.close()


def _plain(target: Target) -> Any:
    """What a reader that knows only the plain name (stock Lightning) reads."""
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    try:
        return torch.load(io.BytesIO(storage.read(META)), weights_only=True)
    finally:
        storage.close()


def test_fresh_save_commits_the_file_under_its_own_name(target: Target) -> None:
    state = sample_state(1)
    _save(target, state, {"epoch": 1})
    names = _names(target)
    assert META in names and not any(is_commit_side_file(n) for n in names)
    assert _commit_file(target) == {"epoch": 1} == _plain(target)
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    try:
        _, manifest = read_checkpoint_metadata(storage)
        assert manifest is not None and manifest["files"][META]["size"] == len(_blob({"epoch": 1}))
        assert verify_checkpoint(storage).ok
    finally:
        storage.close()
    loaded = zeros_like_state(state)
    dcpstore.load(loaded, target.uri, **target.kwargs)
    assert_state_equal(state, loaded)


def test_overwrite_keeps_the_old_file_until_the_commit_then_replaces_it(target: Target) -> None:
    _save(target, sample_state(1), {"epoch": 1})
    state = sample_state(2)
    _save(target, state, {"epoch": 2})
    names = _names(target)
    sides = [n for n in names if is_commit_side_file(n)]
    assert len(sides) == 1 and sides[0].endswith("." + META)
    assert _commit_file(target) == {"epoch": 2} == _plain(target)
    _save(target, sample_state(3), {"epoch": 3})  # the second save's side file goes with its other files
    sides3 = [n for n in _names(target) if is_commit_side_file(n)]
    assert len(sides3) == 1 and sides3 != sides
    assert _commit_file(target) == {"epoch": 3} == _plain(target)


def test_a_save_that_fails_before_its_commit_leaves_the_old_pair(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash window of an overwrite: the new commit file is written, the
    manifest and ``.metadata`` are not. The old checkpoint still loads, with
    the commit file that belongs to it, and ``gc`` removes what the failed
    save left."""
    old = sample_state(1)
    _save(target, old, {"epoch": 1})
    writer = dcpstore.StorageWriter(target.uri, commit_files={META: _blob({"epoch": 2})}, options=target.save_options())
    real_put = writer.storage.put

    def put(path: str, data: Any, **kw: Any) -> None:
        if is_manifest(path):
            raise dcpstore.StorageError(f"injected failure writing {path}")
        real_put(path, data, **kw)

    monkeypatch.setattr(writer.storage, "put", put)
    with pytest.raises(CheckpointException):  # DCP's wrapper of the coordinator's StorageError
        dcp.save(sample_state(2), storage_writer=writer)
    assert any(is_commit_side_file(n) for n in _names(target))  # the new one was written...
    assert _commit_file(target) == {"epoch": 1} == _plain(target)  # ...and the old pair is intact
    loaded = zeros_like_state(old)
    dcpstore.load(loaded, target.uri, **target.kwargs)
    assert_state_equal(old, loaded)
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    try:
        gc(storage, older_than_s=0)
        assert not any(is_commit_side_file(n) for n in _names(target))
        assert verify_checkpoint(storage).ok
    finally:
        storage.close()


def test_a_damaged_commit_file_is_found(local_target: Target) -> None:
    _save(local_target, sample_state(1), {"epoch": 1})
    with open(f"{local_target.uri}/{META}", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(dcpstore.CheckpointCorrupt, match="CRC32C"):
        _commit_file(local_target)
    storage = dcpstore.open_storage(local_target.uri)
    try:
        report = verify_checkpoint(storage)
        assert not report.ok and any(META in p for p in report.problems)
    finally:
        storage.close()


def test_a_stock_checkpoint_gives_the_plain_file(local_target: Target) -> None:
    """No manifest (stock DCP + stock Lightning): the plain file, unverified."""
    dcp.save(sample_state(1), storage_writer=dcp.FileSystemWriter(local_target.uri))
    with open(f"{local_target.uri}/{META}", "wb") as f:
        f.write(_blob({"epoch": 7}))
    assert _commit_file(local_target) == {"epoch": 7}


def test_a_checkpoint_without_the_file_says_so(local_target: Target) -> None:
    dcpstore.save(sample_state(1), local_target.uri)
    with pytest.raises(dcpstore.CheckpointNotFound, match="does not record"):
        _commit_file(local_target)


@pytest.mark.parametrize("name", [".hidden", "a/b", "", "__0_0.distcp", METADATA, MANIFEST, "__3.metadata", "x" * 200])
def test_names_that_cannot_be_commit_files_are_refused(local_target: Target, name: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="commit file"):
        dcpstore.StorageWriter(local_target.uri, commit_files={name: b"x"})


def test_values_must_be_bytes(local_target: Target) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="must be bytes"):
        dcpstore.StorageWriter(local_target.uri, commit_files={META: {"epoch": 1}})  # type: ignore[dict-item]


def test_listing_counts_a_side_file_as_the_saves(local_target: Target) -> None:
    _save(local_target, sample_state(1), {"epoch": 1})
    _save(local_target, sample_state(2), {"epoch": 2})
    storage = dcpstore.open_storage(local_target.uri)
    try:
        (entry,) = list_checkpoints(storage)
        sides = [n for n in entry.names if is_commit_side_file(n)]
        assert len(sides) == 1 and sides[0] == commit_file_path(META, sides[0].split(".")[3])
        assert not set(sides) & set(entry.unknown) and META in entry.unknown  # the plain copy is the caller's
    finally:
        storage.close()
