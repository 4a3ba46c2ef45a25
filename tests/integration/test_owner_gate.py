"""One ownership check per rank, made after every data file is written and
before any is published (dcpstore._impl.dcp.liveness.owner_gate), on every backend and engine.

What the gate must keep of one check per file: no file is published once a
later save has taken the URI over, even when that happens after the files
were written; a file that fails keeps the rank's other files unpublished
(and nothing hangs waiting for it). What it must save: the in-flight marker
is read once per rank for the data (twice for NVRx, which writes under the
final names: before and after), plus once by the commit, whatever the
number of files. (Across ranks the check is shared, once per save:
tests/processes/test_shared_owner_check.py.)
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import dcpstore
from dcpstore._impl.dcp.liveness.owner_gate import OwnerGate
from dcpstore._impl.format.layout import INFLIGHT, METADATA, is_data_file
from tests.support.async_helpers import open_target, skip_unless_engine_serves
from tests.support.backends import Target
from tests.support.faults import Recorder, hook_all_storage
from tests.support.helpers import assert_state_equal, zeros_like_state

ENGINES = [("native", False), ("native", True), ("nvrx", True)]
WORKERS = 4


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {f"t{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(2 * WORKERS)}


def _data_events(events: list[str], kind: str) -> list[int]:
    return [i for i, e in enumerate(events) if e.startswith(f"{kind}:") and is_data_file(e.split(":", 1)[1])]


@pytest.mark.parametrize("engine, async_", ENGINES)
def test_the_marker_is_read_once_per_rank_after_every_file_is_written(
    target: Target, engine: str, async_: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    skip_unless_engine_serves(engine, target)
    recorder = Recorder()
    hook_all_storage({target.uri: recorder}, monkeypatch.setattr)
    state = _state()
    dcpstore.save(state, target.uri, engine=engine, async_=async_, workers=WORKERS, **target.kwargs).result()
    events = recorder.events
    checks = [i for i, e in enumerate(events) if e == f"read:{INFLIGHT}"]
    assert len(checks) == (3 if engine == "nvrx" else 2), events
    if engine == "native":
        wrote, published = _data_events(events, "wrote"), _data_events(events, "commit")
        assert len(published) == WORKERS, events
        # The one check comes after the last byte of every file, before the first publication.
        assert max(wrote) < checks[0] < min(published), events
    restored = zeros_like_state(state)
    dcpstore.load(restored, target.uri, **target.kwargs)
    assert_state_equal(restored, state)


@pytest.mark.parametrize("engine, async_", ENGINES)
def test_a_uri_taken_over_after_the_files_were_written_publishes_none_of_them(
    target: Target, engine: str, async_: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later save replaces the marker once every file is written, just
    before the check: no file of the losing save is published, nothing is
    committed, and the later save's marker is left alone."""
    skip_unless_engine_serves(engine, target)
    storage = open_target(target)
    seen = {"reads": 0}
    # NVRx checks before writing too: take the URI over at its second check.
    take_over_at = 2 if engine == "nvrx" else 1

    def hook(event: str) -> None:
        if event == f"read:{INFLIGHT}":
            seen["reads"] += 1
            if seen["reads"] == take_over_at:
                storage.put(INFLIGHT, b"a-later-save")

    hook_all_storage({target.uri: hook}, monkeypatch.setattr)
    with pytest.raises(dcpstore.SaveError, match="another save"):
        dcpstore.save(_state(), target.uri, engine=engine, async_=async_, workers=WORKERS, **target.kwargs).result()
    names = {o["path"] for o in storage.list()}
    if engine == "native":  # NVRx writes in place: its files exist before the check by design
        assert not any(is_data_file(n) for n in names), names
    assert METADATA not in names
    assert storage.read(INFLIGHT) == b"a-later-save"
    storage.close()


def test_one_failing_file_keeps_the_others_unpublished(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    fired = threading.Event()

    def hook(event: str) -> None:
        recorder(event)
        if event.startswith("wrote:") and "_2" in event and not fired.is_set():
            fired.set()
            raise dcpstore.StorageError("disk on fire")

    hook_all_storage({target.uri: hook}, monkeypatch.setattr)
    with pytest.raises(dcpstore.SaveError, match="disk on fire"):
        dcpstore.save(_state(), target.uri, workers=WORKERS, **target.kwargs)
    assert fired.is_set()
    assert not _data_events(recorder.events, "commit"), recorder.events
    assert f"read:{INFLIGHT}" not in recorder.events  # no check: a file never got there


@pytest.mark.parametrize("parties", [1, 2, 5])
def test_the_gate_checks_once_when_the_last_party_arrives(parties: int) -> None:
    calls: list[int] = []
    arrived = threading.Semaphore(0)

    def check() -> None:
        calls.append(len(calls))

    gate = OwnerGate(check, parties)

    def party() -> None:
        arrived.release()
        gate.wait()

    threads = [threading.Thread(target=party) for _ in range(parties)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert calls == [0]


def test_the_gate_passes_the_check_failure_and_an_abort_to_every_party() -> None:
    def check() -> None:
        raise dcpstore.SaveError("another save took the URI")

    gate = OwnerGate(check, 3)
    errors: list[BaseException] = []

    def party() -> None:
        try:
            gate.wait()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=party) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and all("another save took the URI" in str(e) for e in errors)

    gate = OwnerGate(lambda: None, 3)
    errors.clear()
    threads = [threading.Thread(target=party) for _ in range(2)]
    for t in threads:
        t.start()
    gate.abort(OSError("the third file failed"))
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all("the third file failed" in str(e) for e in errors)
