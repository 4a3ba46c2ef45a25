"""Saving a step again (overwrite=True) under a tiered manager never loses
its durable copy.

The new replica commits over the durable step as any overwrite save does:
new names beside the old files, ``.metadata`` last, then the old files go.
Checked on every durable backend with the replication held just before the
commit (the durable step loads the old copy, whole), and with real SIGKILLs
at every point of that replication (the durable step loads old or new,
whole; ``gc`` removes exactly the leftovers; the next manager over the same
local dir replicates the new copy, and local retention keeps it until then).
Both ways a local save can start: over its own old local copy, or in an empty
local step directory (the old copy retired locally, so stock DCP names would
have met the replica's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dcpstore
from dcpstore._impl.format.layout import METADATA
from dcpstore._impl.manager import step_dir
from dcpstore._impl.manager.tiers.replicate import check_no_clash, read_local_commit
from dcpstore._impl.tools.maintenance import gc
from tests.support.backends import Target, make_target, save_options
from tests.support.crashkit import crash, forkserver
from tests.support.dist_utils import run_ranks
from tests.support.faults import BlockAt, KillAt, KillOn, Recorder, hook_all_storage, spread
from tests.support.helpers import assert_state_equal, zeros_like_state
from tests.support.tiered_kit import (  # noqa: F401
    assert_durable_step,
    crash_at_each,
    dtensor_state,
    durable,
    durable_steps,
    full,
    local_steps,
    manager,
    state,
)

#: The seed of the state that overwrites step 1.
NEW = 101


def _durable_load(durable: Target, step: int, seed: int, big: int = 4096) -> None:
    expected = state(seed, big)
    restored = zeros_like_state(expected)
    dcpstore.load(restored, f"{durable.uri.rstrip('/')}/{step_dir(step)}", **durable.kwargs)
    assert_state_equal(expected, restored)


@pytest.mark.parametrize("retired", [False, True], ids=["local-copy", "retired-locally"])
def test_overwrite_keeps_the_durable_copy_until_the_new_one_commits(
    durable: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retired: bool
) -> None:
    local = tmp_path / "local"
    with manager(durable, local, local_keep=1 if retired else None) as mgr:
        mgr.save(state(1), 1)
        mgr.save(state(2), 2)
        mgr.wait()
    assert local_steps(local) == ([2] if retired else [1, 2])
    gate = BlockAt(lambda e: e == f"commit:{step_dir(1)}/{METADATA}")  # the replica's commit point
    hook_all_storage({durable.uri: gate}, monkeypatch.setattr)
    mgr = manager(durable, local, local_keep=1 if retired else None)
    try:
        with pytest.raises(dcpstore.CheckpointExists, match="already exists: step 1 is committed"):
            mgr.save(state(NEW), 1)
        mgr.save(state(NEW), 1, overwrite=True)
        assert gate.reached.wait(60)
        # Every data file of the new copy is up, its .metadata not yet: the durable step is the old one, whole.
        assert durable_steps(durable) == [1, 2]
        _durable_load(durable, 1, 1)
    finally:
        gate.release()
    mgr.wait()
    restored = zeros_like_state(state(NEW))
    assert mgr.load(restored, 1) == 1
    assert_state_equal(state(NEW), restored)
    mgr.close()
    assert_durable_step(durable, 1, seed=NEW)  # the new copy, and none of the old one's files
    assert_durable_step(durable, 2)
    with manager(durable, tmp_path / "fresh") as fresh:  # a fresh node reads the new copy
        restored = zeros_like_state(state(NEW))
        assert fresh.load(restored, 1) == 1
        assert_state_equal(state(NEW), restored)


def test_a_failed_overwrite_replication_is_kept_locally_and_caught_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable, local = Target("local", str(tmp_path / "durable")), tmp_path / "local"
    with manager(durable, local, local_keep=1) as mgr:
        mgr.save(state(1), 1)
        mgr.wait()
    fail = BlockAt(lambda e: e == f"commit:{step_dir(1)}/{METADATA}", then=dcpstore.StorageError("injected"))
    fail.release()  # no hang: the replica's commit fails
    with monkeypatch.context() as patch:
        hook_all_storage({durable.uri: fail}, patch.setattr)
        mgr = manager(durable, local, local_keep=1)
        mgr.save(state(NEW), 1, overwrite=True)
        with pytest.raises(dcpstore.SaveError, match="injected"):
            mgr.wait()
        _durable_load(durable, 1, 1)  # the old copy, untouched
        mgr.save(state(2), 2)  # local retention (local_keep=1) keeps step 1: its durable copy is older
        mgr.wait()
        assert local_steps(local) == [1, 2]
        mgr.close()
    with manager(durable, local, local_keep=1) as mgr:  # the next manager catches up
        mgr.wait()
    assert_durable_step(durable, 1, seed=NEW)
    assert durable_steps(durable) == [1, 2]


def test_retention_that_cannot_compare_the_copies_keeps_the_local_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing read while local retention compares a step's two copies
    keeps the local step and the replicator running."""
    from dcpstore._impl.manager.tiers import replicate

    def cannot_tell(local: object, durable: object, step: int, durable_time: float | None) -> bool:
        raise dcpstore.StorageError("injected: the durable .metadata cannot be read")

    monkeypatch.setattr(replicate, "replica_is_older", cannot_tell)
    durable, local = Target("local", str(tmp_path / "durable")), tmp_path / "local"
    with manager(durable, local, local_keep=1, replicate_timeout_s=30) as mgr:
        for step in (1, 2, 3):
            mgr.save(state(step), step)
        mgr.wait(30)
        assert local_steps(local) == [1, 2, 3]
    assert durable_steps(durable) == [1, 2, 3]


def test_a_replica_never_writes_over_the_files_of_another_commit(tmp_path: Path) -> None:
    """Two saves of one step with the same names (stock DCP's): the second
    is refused before anything is uploaded, naming the files."""
    dcpstore.save(state(1), str(tmp_path / "durable" / step_dir(1)))
    dcpstore.save(state(NEW), str(tmp_path / "local" / step_dir(1)))
    durable, local = dcpstore.open_storage(str(tmp_path / "durable")), dcpstore.open_storage(str(tmp_path / "local"))
    try:
        commit = read_local_commit(local, 1)
        assert commit is not None
        with pytest.raises(dcpstore.SaveError, match=r"another commit of the step .*__0_0\.distcp"):
            check_no_clash(durable, 1, commit.manifest["files"], commit)
        check_no_clash(local, 1, commit.manifest["files"], commit)  # its own commit: fine
    finally:
        durable.close()
        local.close()
    _durable_load(Target("local", str(tmp_path / "durable")), 1, 1)


def _ranks_overwrite(rank: int, world_size: int, durable_uri: str, kwargs: dict[str, Any], local: str) -> None:
    with dcpstore.CheckpointManager(
        durable_uri, local_dir=local, async_=True, local_keep=1, options=save_options(kwargs, workers=2)
    ) as mgr:
        for step in (1, 2):
            mgr.save(dtensor_state(world_size, step), step)
        mgr.wait()  # step 1 is retired locally: the overwrite starts in an empty local step directory
        mgr.save(dtensor_state(world_size, NEW), 1, overwrite=True)
        mgr.wait()
    dist.barrier()
    fresh = dcpstore.CheckpointManager(
        durable_uri, local_dir=f"{local}-fresh", options=save_options(kwargs, async_=True)
    )
    with fresh as mgr:  # from the durable tier
        dest = dtensor_state(world_size, 0)
        assert mgr.load(dest, 1) == 1
        assert torch.equal(dest["w"].full_tensor(), full(NEW)) and dest["step"] == NEW


def test_two_ranks_overwrite_a_replicated_step(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    target = make_target("s3", request)
    run_ranks(_ranks_overwrite, 2, target.uri, target.kwargs, str(tmp_path / "local"))
    assert durable_steps(target) == [1, 2]
    assert_durable_step(target, 1, load=False)  # the new copy's files only, both ranks' (loaded above)
    assert_durable_step(target, 2, load=False)


# -- SIGKILL anywhere in the replication of an overwrite ------------------------

BIG = 1 << 18


def _overwriting_child(durable_uri: str, local: str, kwargs: dict[str, Any], hook: Any) -> None:
    """Commit steps 1 and 2 (replicated; local_keep=1 retires step 1 locally),
    then save step 1 again with other values, with ``hook`` on the durable
    tier's storage calls (a kill lands somewhere in that replication)."""
    with dcpstore.CheckpointManager(
        durable_uri, local_dir=local, async_=False, local_keep=1, options=save_options(kwargs)
    ) as mgr:
        mgr.save(state(1, BIG), 1)
        mgr.save(state(2, BIG), 2)
        mgr.wait()
    hook_all_storage({durable_uri: hook})
    with dcpstore.CheckpointManager(
        durable_uri, local_dir=local, async_=False, local_keep=1, options=save_options(kwargs)
    ) as mgr:
        mgr.save(state(NEW, BIG), 1, overwrite=True)
        mgr.wait()


def _kill_child(durable_uri: str, local: str, kwargs: dict[str, Any], at: int | tuple[str, bool]) -> None:
    """Killed at the ``at``-th durable event, or at the first one named ``at``."""
    _overwriting_child(durable_uri, local, kwargs, KillAt(at) if isinstance(at, int) else KillOn(*at))


def _probe_child(durable_uri: str, local: str, kwargs: dict[str, Any], queue: Any) -> None:
    recorder = Recorder()
    _overwriting_child(durable_uri, local, kwargs, recorder)
    queue.put(recorder.events)


def _local_is_new(local: Path) -> bool:
    """Whether the local tier holds the overwrite's commit of step 1 (the
    old one was retired locally, so any local step 1 is the new one)."""
    return 1 in local_steps(local)


def _run_overwrite_crashes(durable: Target, tmp_path: Path, points: int) -> None:
    ctx = forkserver()
    queue = ctx.Queue()
    probe = durable.child("probe")
    child_kwargs = durable.kwargs
    assert crash(ctx, _probe_child, probe.uri, str(tmp_path / "probe"), child_kwargs, queue) == 0
    events = queue.get(timeout=30)
    prefix = step_dir(1)
    # Named points, each with the copy the durable step must hold after the
    # kill: at the first upload of the new copy, at its commit point (not
    # written yet), right after it, and at the clean-up of the old copy's files.
    # Then points spread over every event (the count of listings may vary
    # between runs, so only "old or new, whole" is checked there).
    named: list[tuple[int | tuple[str, bool], int | None]] = [
        ((f"open:{prefix}/__", True), 1),
        ((f"commit:{prefix}/{METADATA}", False), 1),
        ((f"committed:{prefix}/{METADATA}", False), NEW),
        ((f"delete:{prefix}/", True), NEW),
    ]
    kills = named + [(k, None) for k in spread(len(events), points)]
    runs = crash_at_each(ctx, _kill_child, durable, tmp_path, child_kwargs, kills, events)
    for root, local, seed, where in runs:
        # The durable step 1 is never lost: old or new, whole.
        assert durable_steps(root) == [1, 2], where
        if seed is None:
            try:
                _durable_load(root, 1, 1, BIG)
                seed = 1
            except AssertionError:
                seed = NEW
        _durable_load(root, 1, seed, BIG)
        assert_durable_step(root, 2, BIG)
        # gc removes exactly what the killed replication left (its process is gone).
        storage = dcpstore.open_storage(root.uri, **root.kwargs)
        try:
            gc(storage, older_than_s=0)
        finally:
            storage.close()
        assert durable_steps(root) == [1, 2], where
        assert_durable_step(root, 1, BIG, seed=seed)
        # The next manager over the same local dir replicates the new copy
        # (if the kill came after its local commit); local retention kept it.
        new_locally = _local_is_new(local)
        assert new_locally or seed == 1, where
        with manager(root, local, local_keep=1) as mgr:
            mgr.wait()
        assert durable_steps(root) == [1, 2], where
        assert_durable_step(root, 1, BIG, seed=NEW if new_locally else 1)
        assert _local_is_new(local) == new_locally, where


@pytest.mark.slow  # test_tiered kills a replication in the quick suite
def test_sigkill_during_the_replication_of_an_overwrite_local(tmp_path: Path) -> None:
    _run_overwrite_crashes(Target("local", str(tmp_path / "durable")), tmp_path, 8)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["s3", "msc"])
def test_sigkill_during_the_replication_of_an_overwrite_object_store(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    _run_overwrite_crashes(make_target(backend, request), tmp_path, 12)
