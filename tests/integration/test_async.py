"""``save(..., async_=True)``: snapshot semantics, background errors, limits,
and bounded resources, on every backend the engine can write."""

from __future__ import annotations

import logging
import os
import statistics
import threading
from typing import Any

import psutil
import pytest
import torch

import dcpstore
from dcpstore._impl.engines.staging import Stager, StagingPool
from dcpstore._impl.util.errors import CheckpointNotFound, InvalidArgument, SaveError
from tests.support.async_helpers import (
    ENGINES,
    GatedPlanner,
    assert_same,
    engine_params,
    mixed_state,
    mutate,
    open_target,
    skip_unless_engine_serves,
    snapshot,
    zeros_like_state,
)
from tests.support.backends import Target
from tests.support.rss import fix_mmap_threshold, in_own_process, live_rss


@pytest.fixture(scope="module")
def shared_saver() -> Any:
    s = dcpstore.AsyncSaver()
    yield s
    s.close()


@pytest.fixture
def saver(request: pytest.FixtureRequest, shared_saver: Any) -> Any:
    """A saver of the test's own; for the process engine's cases, one saver
    for the module (starting a checkpoint process costs seconds)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("engine") == "process":
        yield shared_saver
        return
    s = dcpstore.AsyncSaver()
    yield s
    s.close()


@pytest.mark.parametrize("engine", engine_params(quick=ENGINES))
def test_mutation_after_save_never_reaches_storage(engine: str, target: Target, saver: Any) -> None:
    skip_unless_engine_serves(engine, target)
    state = mixed_state()
    expected = snapshot(state)
    # Hold the background save before it plans, so every byte it writes is
    # written after the mutation below: aliasing anything would show.
    planner = GatedPlanner("setup")
    handle = saver.save(state, target.uri, options=target.save_options(engine=engine, planner=planner, workers=3))
    assert not handle.done()
    mutate(state)
    planner.gate.set()
    info = handle.result(timeout=60)
    assert info.engine == engine and info.bytes_written > 0 and info.phases["stage"] > 0
    loaded = zeros_like_state(state)
    dcpstore.load(loaded, target.uri, **target.kwargs)
    assert_same(loaded, expected)


@pytest.mark.parametrize("engine", engine_params(quick=ENGINES))
def test_module_level_async_save_roundtrip(engine: str, target: Target) -> None:
    skip_unless_engine_serves(engine, target)
    state = {"w": torch.randn(300, 30), "step": 3}
    expected = snapshot(state)
    handle = dcpstore.save(state, target.uri, async_=True, engine=engine, **target.kwargs)
    state["w"].mul_(0)
    info = handle.result(timeout=60)
    assert handle.done() and handle.exception() is None
    assert info.uri == open_target(target).uri
    loaded = {"w": torch.empty(300, 30), "step": 0}
    dcpstore.load(loaded, target.uri, **target.kwargs)
    assert_same(loaded, expected)


@pytest.mark.parametrize("engine", engine_params())
def test_background_error_surfaces_from_result(engine: str, local_target: Target, saver: Any) -> None:
    # The parent of the checkpoint directory is a regular file: the failure
    # happens in the background (creating the directory), not in save().
    blocker = local_target.uri + "-file"
    with open(blocker, "w") as f:
        f.write("not a directory")
    uri = os.path.join(blocker, "ckpt")
    handle = saver.save({"w": torch.ones(10)}, uri, options=dcpstore.SaveOptions(engine=engine))
    with pytest.raises(SaveError) as info:
        handle.result(timeout=60)
    assert uri in str(info.value)
    assert info.value.__cause__ is not None  # chained to the backend error
    assert handle.exception() is info.value
    with pytest.raises(SaveError):  # every call re-raises
        handle.result()


@pytest.mark.parametrize("engine", engine_params())
def test_failed_write_commits_nothing(engine: str, local_target: Target, saver: Any) -> None:
    uri = local_target.uri
    state = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    # A directory squats on a data file's name (a save to a fresh URI uses
    # stock DCP's names): that write fails mid-save.
    os.makedirs(os.path.join(uri, "__0_1.distcp"))
    with pytest.raises(SaveError, match="__0_1.distcp"):
        saver.save(state, uri, options=dcpstore.SaveOptions(engine=engine, workers=2)).result(timeout=60)
    assert not os.path.exists(os.path.join(uri, ".metadata"))
    with pytest.raises(CheckpointNotFound):
        dcpstore.load({"a": torch.empty(64, 64), "b": torch.empty(64, 64)}, uri)


@pytest.mark.parametrize("engine", engine_params(quick=ENGINES))
def test_the_old_commit_loads_while_an_overwrite_writes(engine: str, local_target: Target, saver: Any) -> None:
    uri = local_target.uri
    saver.save({"w": torch.zeros(100)}, uri, options=dcpstore.SaveOptions(engine=engine)).result(timeout=60)
    planner = GatedPlanner("resolve")  # stops before the first data byte is written
    handle = saver.save({"w": torch.ones(100)}, uri, options=dcpstore.SaveOptions(engine=engine, planner=planner))
    assert planner.reached.wait(30)
    loaded = {"w": torch.empty(100)}
    dcpstore.load(loaded, uri)  # the claim happened: the old checkpoint is untouched
    assert torch.equal(loaded["w"], torch.zeros(100))
    planner.gate.set()
    handle.result(timeout=60)
    loaded = {"w": torch.empty(100)}
    dcpstore.load(loaded, uri)
    assert torch.equal(loaded["w"], torch.ones(100))


@pytest.mark.parametrize("engine", engine_params())
def test_a_later_save_to_the_same_uri_wins(engine: str, local_target: Target, saver: Any) -> None:
    uri = local_target.uri
    planner = GatedPlanner("resolve")  # the first save claimed the URI and stops before writing
    first = saver.save(
        {"w": torch.zeros(100)}, uri, options=dcpstore.SaveOptions(engine=engine, planner=planner, workers=2)
    )
    assert planner.reached.wait(30)
    dcpstore.save({"w": torch.ones(100)}, uri, workers=2)  # another writer: sync, to completion
    planner.gate.set()
    with pytest.raises(SaveError, match="another save"):
        first.result(timeout=60)
    loaded = {"w": torch.empty(100)}
    dcpstore.load(loaded, uri)
    assert torch.equal(loaded["w"], torch.ones(100))  # the later save's checkpoint, intact


def test_unpicklable_value_fails_in_save_naming_the_key(local_target: Target, saver: Any) -> None:
    with pytest.raises(InvalidArgument, match="bad"):
        saver.save({"bad": threading.Lock()}, local_target.uri, options=dcpstore.SaveOptions(engine="native"))
    assert saver.pending() == 0


def test_max_in_flight_one_finishes_the_previous_save_first(local_target: Target, saver: Any) -> None:
    planner = GatedPlanner("setup")
    first = saver.save(
        {"w": torch.ones(10)},
        local_target.child("a").uri,
        options=dcpstore.SaveOptions(engine="native", planner=planner),
    )
    returned = threading.Event()
    second: list[Any] = []

    def save_second() -> None:
        second.append(
            saver.save(
                {"w": torch.ones(10)}, local_target.child("b").uri, options=dcpstore.SaveOptions(engine="native")
            )
        )
        returned.set()

    thread = threading.Thread(target=save_second)
    thread.start()
    assert not returned.wait(0.5)  # blocked: the first save is still pending
    planner.gate.set()
    assert returned.wait(30)
    thread.join()
    assert first.done()  # finished before the second one was even staged
    second[0].result(timeout=60)


def test_max_in_flight_two_allows_two_pending_and_finishes_in_order(local_target: Target) -> None:
    order: list[str] = []
    with dcpstore.AsyncSaver(max_in_flight=2) as saver:
        planner = GatedPlanner("setup")
        h1 = saver.save(
            {"w": torch.ones(10)},
            local_target.child("a").uri,
            options=dcpstore.SaveOptions(engine="native", planner=planner),
        )
        h2 = saver.save(
            {"w": torch.ones(10)}, local_target.child("b").uri, options=dcpstore.SaveOptions(engine="native")
        )
        h1.add_done_callback(lambda h: order.append("a"))
        h2.add_done_callback(lambda h: order.append("b"))
        assert saver.pending() == 2 and not h1.done() and not h2.done()
        third_returned = threading.Event()
        thread = threading.Thread(
            target=lambda: (
                saver.save(
                    {"w": torch.ones(10)}, local_target.child("c").uri, options=dcpstore.SaveOptions(engine="native")
                ),
                third_returned.set(),
            )
        )
        thread.start()
        assert not third_returned.wait(0.5)  # a third must wait for the oldest
        planner.gate.set()
        assert third_returned.wait(30)
        thread.join()
        saver.wait(timeout=60)
    assert order == ["a", "b"]
    for name in "abc":
        assert os.path.exists(os.path.join(local_target.uri, name, ".metadata"))


def test_closed_saver_refuses_and_close_waits(local_target: Target) -> None:
    saver = dcpstore.AsyncSaver()
    handle = saver.save({"w": torch.ones(1000)}, local_target.uri, options=dcpstore.SaveOptions(engine="native"))
    saver.close()
    assert handle.done() and handle.result().bytes_written > 0
    with pytest.raises(InvalidArgument, match="closed"):
        saver.save({"w": torch.ones(1)}, local_target.uri, options=dcpstore.SaveOptions(engine="native"))


@pytest.mark.parametrize("engine", engine_params())
def test_sync_save_with_engine_runs_it_and_raises_directly(engine: str, local_target: Target) -> None:
    handle = dcpstore.save({"w": torch.ones(10)}, local_target.uri, engine=engine)
    assert handle.done()
    assert handle.result().engine == (
        "sync" if engine == "native" else engine
    )  # another engine runs, and is waited for
    blocker = local_target.uri + "-file"
    open(blocker, "w").close()
    with pytest.raises(SaveError):
        dcpstore.save({"w": torch.ones(10)}, os.path.join(blocker, "x"), engine=engine)


def _repeated_saves_stay_flat(engine: str, target: Target) -> None:
    """50 async saves of one structure: RSS, open files and threads stay flat.

    A leak grows RSS with every save; warming up does not. Connection pools,
    caches and malloc arenas grow in one-off steps, anywhere in the first
    dozens of saves (up to 2.2 MiB at once in CI). So RSS is sampled over
    three windows, and the *smaller* of the two growths between them must
    stay under a quarter of a state: a leak of ``r`` bytes per save grows
    each half by ``17.5 r``, so it shows in both halves, and this catches it
    from ``r`` >= 30 KiB per save; a one-off warm-up step lands in one half
    only, and is not read as a leak.
    Staging itself is checked exactly (``held_bytes``). Runs in a process
    of its own (:func:`rss.in_own_process`), whose allocator it changes.
    """
    # DCP logs every phase at DEBUG: no log records pile up in this process.
    logging.getLogger("c10d-NullHandler-dcp_logger").disabled = True
    proc = psutil.Process()
    state: dict[str, Any] = {f"layer{i}": torch.randn(256, 256) for i in range(8)}  # 2 MiB
    state["step"] = 0
    state_bytes = 8 * 256 * 256 * 4

    fix_mmap_threshold()

    def usage() -> tuple[int, int, int]:
        return live_rss(proc), proc.num_fds(), threading.active_count()

    # RSS after saves 10-14, 28-32 and 45-49: the median of each, so that one
    # allocator fluctuation is not read as growth.
    windows: dict[int, list[int]] = {10: [], 28: [], 45: []}
    with dcpstore.AsyncSaver() as saver:
        for step in range(50):
            state["step"] = step
            for name in list(state)[:8]:
                state[name].add_(1)
            uri = target.child(f"step{step % 3}").uri  # overwrite a few URIs, like a rotating manager
            saver.save(state, uri, options=target.save_options(engine=engine, workers=2)).result(timeout=60)
            if step == 9:
                _, fds0, threads0 = usage()
            for first, samples in windows.items():
                if first <= step < first + 5:
                    samples.append(usage()[0])
        _, fds1, threads1 = usage()
        assert fds1 == fds0, "open files grew"
        assert threads1 == threads0, "threads grew"
        assert saver.pool.held_bytes() == state_bytes  # staging reuses one buffer set
        # memory:// keeps the checkpoints themselves in this heap, where
        # rewriting them fragments it, so RSS says nothing about leaks there.
        if target.name != "memory":
            early, middle, late = (statistics.median(samples) for samples in windows.values())
            halves = (middle - early, late - middle)
            report = f"RSS grew by {halves[0] / 2**20:.2f} MiB, then by {halves[1] / 2**20:.2f} MiB"
            assert min(halves) < state_bytes // 4, report


@pytest.mark.parametrize("engine", ["native"])  # every engine on every backend: the slow twin below
def test_repeated_saves_keep_memory_files_and_threads_flat(engine: str, local_target: Target) -> None:
    skip_unless_engine_serves(engine, local_target)
    in_own_process(_repeated_saves_stay_flat, engine, local_target)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
def test_repeated_saves_stay_flat_on_every_backend(engine: str, target: Target) -> None:
    skip_unless_engine_serves(engine, target)
    in_own_process(_repeated_saves_stay_flat, engine, target)


# -- staging ------------------------------------------------------------------


def test_staging_copies_and_reuses_buffers_per_structure() -> None:
    stager = Stager(StagingPool(max_structures=1, max_sets=1))
    state = {"a": torch.randn(10, 10), "b": torch.randn(64, 64)[:, 1:5], "c": torch.randn(3, 4).t()}
    first = stager.stage(state)
    for k, v in state.items():
        staged = first.state_dict[k]
        assert torch.equal(staged, v)
        assert staged.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()  # a copy, never an alias
        assert staged.untyped_storage().nbytes() == staged.nbytes  # views staged compactly
    assert first.state_dict["c"].stride() == state["c"].stride()  # dense layouts kept
    ptrs = [t.data_ptr() for t in first.state_dict.values()]
    first.release()
    second = stager.stage(state)
    assert [t.data_ptr() for t in second.state_dict.values()] == ptrs  # same structure: same buffers
    second.release()
    other = stager.stage({"a": torch.randn(10, 11)})  # another structure: new buffers
    other.release()
    assert stager.pool.held_bytes() == 10 * 11 * 4  # bounded: one structure kept


def test_staging_keeps_tied_tensors_tied_and_resolves_stateful() -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 4

        def state_dict(self) -> dict[str, Any]:
            return {"n": self.n, "t": torch.full((2,), float(self.n))}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.n = sd["n"]

    tied = torch.randn(5)
    staged = Stager().stage({"x": tied, "y": tied, "counter": Counter()})
    assert staged.state_dict["x"] is staged.state_dict["y"]
    assert staged.state_dict["counter"]["n"] == 4
    assert torch.equal(staged.state_dict["counter"]["t"], torch.full((2,), 4.0))
