"""Saving over a committed checkpoint: old until the new commit, new after, never nothing.

On every backend: at every storage operation of a save over a committed
checkpoint, the URI loads exactly the old state or exactly the new one (checked
from inside the save, at each event); a save that fails leaves the old one
loadable (stock ``dcp.load`` agrees, on local paths); after a successful
overwrite nothing of the old checkpoint is left. ``overwrite=False`` refuses
the URI on every entry point. The kill-anywhere versions are in test_crash*.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import dcpstore
from dcpstore._impl.dcp import load as whole_load
from dcpstore._impl.dcp.load import LOAD_TRIES
from dcpstore._impl.tools import maintenance
from dcpstore.storage import open_storage
from tests.support.async_helpers import skip_unless_engine_serves
from tests.support.backends import Target
from tests.support.faults import FailAt, hook_all_storage
from tests.support.helpers import assert_state_equal, zeros_like_state


def state(seed: int, n: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {f"t{i}": torch.randn(257 + i, generator=g) for i in range(n)}
    out["step"] = seed
    return out


def loads_as(target: Target, candidates: dict[str, dict[str, Any]]) -> str:
    """Which of ``candidates`` the URI loads exactly (or "nothing")."""
    try:
        restored = zeros_like_state(candidates["old"])
        # Spelled with a trailing "/": the same checkpoint, but a URI that
        # hook_all_storage (keyed by the URI as given) leaves unhooked.
        dcpstore.load(restored, target.uri.rstrip("/") + "/", **target.kwargs)
    except dcpstore.CheckpointNotFound:
        return "nothing"
    for name, expected in candidates.items():
        try:
            assert_state_equal(expected, restored)
        except AssertionError:
            continue
        return name
    raise AssertionError(f"{target.uri} loads a mixture of the old and the new save")


def listing(target: Target) -> set[str]:
    storage = open_storage(target.uri, **target.kwargs)
    try:
        return {o["path"] for o in storage.list()}
    finally:
        storage.close()


class LoadAtEveryEvent:
    """A storage hook that, at every event of the save, loads the URI from
    another storage and records what it found."""

    def __init__(self, target: Target, candidates: dict[str, dict[str, Any]]) -> None:
        self.target, self.candidates = target, candidates
        self.seen: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, event: str) -> None:
        with self._lock:  # the save's writer threads report events concurrently
            self.seen.append((event, loads_as(self.target, self.candidates)))


@pytest.mark.parametrize("engine", ["native", "nvrx"])
def test_every_point_of_an_overwrite_loads_old_or_new(
    target: Target, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_engine_serves(engine, target)
    old, new = state(1), state(2)
    dcpstore.save(old, target.uri, workers=3, **target.kwargs)
    probe = LoadAtEveryEvent(target, {"old": old, "new": new})
    hook_all_storage({target.uri: probe}, monkeypatch.setattr)
    dcpstore.save(new, target.uri, workers=2, engine=engine, **target.kwargs)
    monkeypatch.undo()
    found = [what for _, what in probe.seen]
    assert "nothing" not in found, probe.seen
    flip = found.index("new")
    assert found[:flip] == ["old"] * flip and found[flip:] == ["new"] * (len(found) - flip), probe.seen
    assert any(e.startswith("commit:.metadata") for e, _ in probe.seen[: flip + 1]), probe.seen
    assert loads_as(target, {"old": old, "new": new}) == "new"


def test_an_overwrite_leaves_nothing_of_the_old_checkpoint(target: Target) -> None:
    dcpstore.save(state(1), target.uri, workers=4, **target.kwargs)
    first = listing(target)
    info = dcpstore.save(state(2), target.uri, workers=2, **target.kwargs).result()
    after = listing(target)
    data = {p for p in after if p.endswith(".distcp")}
    assert data == set(info.files) and not data & first
    manifests = [p for p in after if p.startswith(".dcpstore") and p.endswith(".json")]
    assert len(manifests) == 1 and manifests[0] not in first
    assert after == data | set(manifests) | {".metadata"}


#: Where a save over a committed checkpoint fails: opening its first data
#: file, committing one, committing its manifest, committing .metadata.
FAIL_AT = {
    "data-open": lambda e: e.startswith("open:__"),
    "data-commit": lambda e: e.startswith("commit:__"),
    "manifest-commit": lambda e: e.startswith("commit:.dcpstore") and e.endswith(".json"),
    "metadata-commit": lambda e: e == "commit:.metadata",
}


@pytest.mark.parametrize("fail_at", list(FAIL_AT))
def test_a_failed_overwrite_leaves_the_old_checkpoint(
    target: Target, fail_at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = state(1), state(2)
    dcpstore.save(old, target.uri, workers=2, **target.kwargs)
    hook_all_storage({target.uri: FailAt(FAIL_AT[fail_at], OSError(5, "injected"))}, monkeypatch.setattr)
    with pytest.raises(dcpstore.SaveError):
        dcpstore.save(new, target.uri, workers=2, **target.kwargs)
    monkeypatch.undo()
    assert loads_as(target, {"old": old, "new": new}) == "old"
    # ...and the next save over it works and cleans up what the failed one left.
    info = dcpstore.save(new, target.uri, workers=2, **target.kwargs).result()
    assert loads_as(target, {"old": old, "new": new}) == "new"
    assert {p for p in listing(target) if p.endswith(".distcp")} == set(info.files)


@pytest.mark.parametrize("stopped", ["before-commit", "before-clean-up"])
def test_gc_removes_what_an_interrupted_overwrite_left_and_nothing_the_commit_names(
    target: Target, stopped: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save over a committed checkpoint that failed before its commit leaves
    its own files beside the old checkpoint; one whose clean-up failed leaves
    the old checkpoint's files beside the new one. Either way the URI loads
    exactly one of them, ``gc`` removes the other's files, and it still
    loads exactly the same."""
    old, new = state(1), state(2)
    dcpstore.save(old, target.uri, workers=2, **target.kwargs)
    at = (lambda e: e == "commit:.metadata") if stopped == "before-commit" else (lambda e: e.startswith("delete:"))
    hook_all_storage({target.uri: FailAt(at, dcpstore.StorageError("injected"))}, monkeypatch.setattr)
    if stopped == "before-commit":
        with pytest.raises(dcpstore.SaveError):
            dcpstore.save(new, target.uri, workers=2, **target.kwargs)
    else:
        dcpstore.save(new, target.uri, workers=2, **target.kwargs)  # the clean-up is best effort
    monkeypatch.undo()
    expected = "old" if stopped == "before-commit" else "new"
    assert loads_as(target, {"old": old, "new": new}) == expected
    names = listing(target)
    assert len({p for p in names if p.endswith(".json")}) == 2  # both saves' manifests are there
    report = maintenance.gc(open_storage(target.uri, **target.kwargs), older_than_s=0)
    assert report.removed, report
    assert loads_as(target, {"old": old, "new": new}) == expected
    after = listing(target)
    manifests = {p for p in after if p.endswith(".json")}
    files = set(maintenance.inspect_checkpoint(open_storage(target.uri, **target.kwargs))["files"])
    assert len(manifests) == 1 and after == files | manifests | {".metadata"}


def test_stock_dcp_reads_the_old_and_then_the_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = state(1), state(2)
    dcpstore.save(old, tmp_path, workers=2)
    hook_all_storage(
        {str(tmp_path): FailAt(lambda e: e == "commit:.metadata", OSError(28, "No space left"))}, monkeypatch.setattr
    )
    with pytest.raises(dcpstore.SaveError):
        dcpstore.save(new, str(tmp_path), workers=2)
    monkeypatch.undo()
    restored = zeros_like_state(old)
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path))
    assert_state_equal(old, restored)
    dcpstore.save(new, tmp_path, workers=2)
    restored = zeros_like_state(new)
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path))
    assert_state_equal(new, restored)


def test_overwriting_a_stock_dcp_checkpoint(tmp_path: Path) -> None:
    dcp.save(state(1), storage_writer=FileSystemWriter(tmp_path))
    stock_files = set(os.listdir(tmp_path))
    dcpstore.save(state(2), tmp_path, workers=2)
    assert not stock_files & set(os.listdir(tmp_path)) - {".metadata"}
    restored = zeros_like_state(state(2))
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path))
    assert_state_equal(state(2), restored)


# The loop goes on past ``seconds`` until three loads straddled a commit, so the quick second still races.
@pytest.mark.parametrize("seconds", [pytest.param(1, id="quick"), pytest.param(40, id="long", marks=pytest.mark.slow)])
def test_loads_racing_a_stream_of_overwrites_each_get_one_saved_state(
    target: Target, seconds: float, caplog: pytest.LogCaptureFixture
) -> None:
    """``dcpstore.load`` in a loop while another thread saves over the same
    URI again and again (sync, ``overwrite=True``, the same structure with
    other values): every load gets exactly one of the saved states, whole --
    never ``CheckpointCorrupt``, nothing, or a mixture. A load that read the
    old ``.metadata`` meets the new save's commit and its clean-up of the old
    files (and, before the whole-object read held, a ``.metadata`` torn at the
    old one's size); the loads that straddled a commit are counted, so the
    race really ran. The saves are paced to at most one per load begun (a save
    slower than a load is never waited for): saves committing many times
    within one load (``memory://``'s, several times
    quicker than its loads) would overtake every try of it
    (``dcpstore._impl.dcp.load.LOAD_TRIES``). Nor do releases pile up while a
    save is slower than a load: each save waits for a load begun after the
    previous save committed, so a load meets at most one commit per try it
    began (the bound the reader's tries are for), not a back-to-back stream."""
    states = {
        seed: {**state(seed), "big": torch.randn(1 << 16, generator=torch.Generator().manual_seed(seed))}
        for seed in (1, 2, 3)
    }  # "big" is read straight into its destination
    dcpstore.save(states[1], target.uri, workers=2, **target.kwargs)
    stop = threading.Event()
    begun = threading.Condition()  # notified per load begun; loads_begun[0] counts them
    loads_begun = [0]
    commits = [0]
    save_errors: list[BaseException] = []

    def save_again_and_again() -> None:
        seed, seen = 1, 0
        while not stop.is_set():
            with begun:
                if not begun.wait_for(lambda: loads_begun[0] > seen, timeout=0.1):  # noqa: B023 (waited on here)
                    continue
            seed = seed % 3 + 1
            try:
                dcpstore.save(states[seed], target.uri, workers=2, overwrite=True, **target.kwargs)
            except BaseException as e:  # reported below
                save_errors.append(e)
                return
            commits[0] += 1
            with begun:
                seen = loads_begun[0]  # the next save waits for a load begun after this commit

    caplog.set_level(logging.DEBUG, logger="dcpstore._impl.dcp.load")
    saver = threading.Thread(target=save_again_and_again)
    saver.start()
    wrong: list[str] = []
    loads = straddled = 0
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline or (straddled < 3 and time.monotonic() < deadline + 60):
            restored = zeros_like_state(states[1])
            before = commits[0]
            with begun:
                loads_begun[0] += 1
                begun.notify()
            try:
                dcpstore.load(restored, target.uri, workers=2, **target.kwargs)
            except dcpstore.CheckpointError as e:
                wrong.append(f"{type(e).__name__}: {e}")
                continue
            finally:
                loads += 1
                straddled += commits[0] != before
            if restored["step"] not in states:
                wrong.append(f"step {restored['step']!r}")
                continue
            try:
                assert_state_equal(states[restored["step"]], restored)
            except AssertionError as e:
                wrong.append(f"a mixture: step {restored['step']} but {e}")
    finally:
        stop.set()
        saver.join()
    assert not save_errors, save_errors
    assert not wrong, (len(wrong), loads, wrong[:3])
    assert straddled >= 3 and commits[0] >= 3, (loads, straddled, commits)
    again = sum("loading it again" in r.getMessage() for r in caplog.records)
    print(f"{target.name}: {loads} loads, {straddled} beside a commit, {again} loaded again, {commits[0]} saves")


class OverwriteMidLoad:
    """A hook on a load's storage: at the first read of the second data file
    of a try of the load (:meth:`begin` counts them), save ``new`` over the
    URI -- its commit, then its clean-up of the files the load is about to
    read -- on the tries numbered in ``on_tries`` (None: every try)."""

    def __init__(self, target: Target, new: dict[str, Any], on_tries: set[int] | None) -> None:
        self.target, self.new, self.on_tries = target, new, on_tries
        self.tries, self.overwrites = 0, 0
        self._files: set[str] = set()
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            self.tries += 1
            self._files = set()

    def __call__(self, event: str) -> None:
        with self._lock:
            if not (event.startswith("read:") and event.endswith(".distcp")) or event in self._files:
                return
            self._files.add(event)
            if len(self._files) != 2 or (self.on_tries is not None and self.tries not in self.on_tries):
                return
            dcpstore.save(self.new, self.target.uri, workers=2, overwrite=True, **self.target.kwargs)
            self.overwrites += 1


class NextStateEachTime(OverwriteMidLoad):
    """:class:`OverwriteMidLoad` on every try, each saving the next of ``states``."""

    def __init__(self, target: Target, states: list[dict[str, Any]]) -> None:
        super().__init__(target, states[0], on_tries=None)
        self.states = states

    def __call__(self, event: str) -> None:
        super().__call__(event)
        self.new = self.states[min(self.overwrites, len(self.states) - 1)]


def _load_beside(target: Target, hook: OverwriteMidLoad, into: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Load ``target`` into ``into`` with ``hook`` on the load's storage only
    (spelled with a trailing "/", the URI the saves use stays unhooked)."""
    uri = target.uri.rstrip("/") + "/"
    hook_all_storage({uri: hook}, monkeypatch.setattr)
    one_try = whole_load._load_once

    def counted(*args: Any) -> Any:
        hook.begin()
        return one_try(*args)

    monkeypatch.setattr(whole_load, "_load_once", counted)
    try:
        dcpstore.load(into, uri, workers=1, **target.kwargs)  # one reader thread: the files in order
    finally:
        monkeypatch.undo()


def test_a_load_whose_checkpoint_is_replaced_mid_read_loads_the_new_one(
    target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that read the old ``.metadata`` and one data file of it, when a
    save over the URI commits and removes the old files before it reads the
    next: it loads again from the new commit and gets the new state whole
    (before the loader tried again: ``CheckpointCorrupt``, a data file
    missing, with the first file's keys already changed)."""
    old, new = state(1), state(2)
    dcpstore.save(old, target.uri, workers=2, **target.kwargs)
    hook = OverwriteMidLoad(target, new, on_tries={1})
    restored = zeros_like_state(old)
    _load_beside(target, hook, restored, monkeypatch)
    assert (hook.tries, hook.overwrites) == (2, 1)
    assert_state_equal(new, restored)


def test_a_load_replaced_during_every_try_names_what_all_tries_changed(
    local_target: Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves that commit during every try of a load overtake it: after
    ``LOAD_TRIES`` tries it fails with ``CheckpointCorrupt`` saying so, and
    its key lists count every try's changes: every key it does not name is
    unchanged, every key it names as loaded holds one saved state's values."""
    states = [state(seed) for seed in (1, 2, 3, 4, 5, 6)]
    dcpstore.save(states[0], local_target.uri, workers=2)
    hook = NextStateEachTime(local_target, states[1:])
    restored = zeros_like_state(states[0])
    with pytest.raises(
        dcpstore.CheckpointCorrupt, match=rf"data file is missing.*each of the {LOAD_TRIES} tries"
    ) as info:
        _load_beside(local_target, hook, restored, monkeypatch)
    assert hook.tries == hook.overwrites == LOAD_TRIES
    error = info.value
    changed = set(error.loaded_keys) | set(error.partly_loaded_keys) | set(error.damaged_keys)
    assert error.loaded_keys and not error.damaged_keys, vars(error)
    for key, value in restored.items():
        if key not in changed:
            assert value is None or not torch.is_tensor(value) or not value.any(), f"{key} changed, not named"
        elif key in error.loaded_keys and torch.is_tensor(value):
            assert any(torch.equal(value, s[key]) for s in states), key


def test_a_data_file_missing_without_a_replace_fails_at_the_first_try(
    local_target: Target, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a replaced checkpoint is loaded again: a data file removed by
    hand (the ``.metadata`` unchanged) fails the first try, as before."""
    dcpstore.save(state(1), local_target.uri, workers=2)
    victim = sorted(p for p in listing(local_target) if p.endswith(".distcp"))[-1]
    os.unlink(os.path.join(local_target.uri, victim))
    caplog.set_level(logging.DEBUG, logger="dcpstore._impl.dcp.load")
    with pytest.raises(dcpstore.CheckpointCorrupt, match="data file is missing") as info:
        dcpstore.load(zeros_like_state(state(1)), local_target.uri)
    assert "tries" not in str(info.value)
    assert not [r for r in caplog.records if "loading it again" in r.getMessage()]


# ---------------------------------------------------------------------------
# overwrite=False
# ---------------------------------------------------------------------------


def _refused(target: Target, before: set[str]) -> None:
    assert listing(target) == before  # nothing written, nothing removed


def test_save_overwrite_false_refuses_a_committed_checkpoint(target: Target) -> None:
    dcpstore.save(state(1), target.uri, **target.kwargs)
    before = listing(target)
    with pytest.raises(dcpstore.CheckpointExists, match="already exists") as info:
        dcpstore.save(state(2), target.uri, overwrite=False, **target.kwargs)
    assert isinstance(info.value, FileExistsError) and isinstance(info.value, dcpstore.CheckpointError)
    _refused(target, before)
    assert loads_as(target, {"old": state(1), "new": state(2)}) == "old"


@pytest.mark.parametrize("engine", ["native", "nvrx"])
def test_async_save_overwrite_false_refuses(target: Target, engine: str) -> None:
    skip_unless_engine_serves(engine, target)
    dcpstore.save(state(1), target.uri, **target.kwargs)
    before = listing(target)
    handle = dcpstore.save(state(2), target.uri, async_=True, engine=engine, overwrite=False, **target.kwargs)
    with pytest.raises(dcpstore.CheckpointExists, match="already exists"):
        handle.result(timeout=120)
    _refused(target, before)


def test_overwrite_false_saves_where_there_is_no_commit(target: Target) -> None:
    dcpstore.save(state(1), target.child("a").uri, overwrite=False, **target.kwargs)
    assert loads_as(target.child("a"), {"old": state(1)}) == "old"


def test_storage_writer_overwrite_false_under_dcp_save(target: Target) -> None:
    # What s3torchconnector's test_overwrite and PyTorch's e2e test_overwrite check.
    dcp.save(
        state(1), storage_writer=dcpstore.StorageWriter(target.uri, overwrite=False, options=target.save_options())
    )
    dcp.save(state(2), storage_writer=dcpstore.StorageWriter(target.uri, overwrite=True, options=target.save_options()))
    before = listing(target)
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(
            state(3), storage_writer=dcpstore.StorageWriter(target.uri, overwrite=False, options=target.save_options())
        )
    _refused(target, before)
    assert loads_as(target, {"old": state(2)}) == "old"
