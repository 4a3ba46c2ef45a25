"""Tiered checkpoints: CheckpointManager(root, local_dir=...).

Saves commit to a local directory; the committed steps are replicated to
the durable root (local path, native S3 over moto, MSC) in the background.
Checked against real files and a real S3 endpoint: what each tier lists,
that every durable step loads exactly what was saved (with stock-shaped
loads of the durable URI), retention per tier, resume on a fresh local
directory, the nearest copy chosen on load, corrupt local copies never
replicated, failed replications leaving the local step in place until a
later manager catches up, SIGKILLs at every point of a replication, and two
gloo ranks (one shared local directory, and loads across differing
directories; node-local directories have their own suite,
tests/processes/test_tiered_nodes.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcpstore
from dcpstore._impl.format.layout import METADATA, REPLICA_REPORT_PREFIX
from dcpstore._impl.manager import step_dir
from dcpstore._impl.tools.maintenance import gc, list_checkpoints
from tests.support.backends import Target, make_target, save_options
from tests.support.crashkit import crash, forkserver
from tests.support.dist_utils import run_ranks
from tests.support.faults import BlockAt, KillAt, KillOn, Recorder, hook_all_storage, spread
from tests.support.tiered_kit import (  # noqa: F401
    assert_durable_step,
    crash_at_each,
    dtensor_state,
    durable,
    durable_steps,
    full,
    gc_keeps_running,
    loads,
    local_steps,
    manager,
    state,
)

# -- the core: local commit, background replication, retention per tier -------


@pytest.mark.parametrize(
    "engine_kwargs, ran_by",
    [
        ({"async_": False}, {"sync"}),
        ({"async_": True}, {"native"}),  # engine="auto": threads for the local tier
        pytest.param({"async_": True, "engine": "process"}, {"process"}, marks=pytest.mark.slow),
    ],
    ids=["sync", "async", "async-process"],
)
def test_steps_commit_locally_and_replicate_whole(
    durable: Target, tmp_path: Path, engine_kwargs: dict[str, Any], ran_by: set[str]
) -> None:
    """Each engine's saves (the process engine's in its checkpoint process)
    commit locally, and the tier replicates what they committed."""
    local = tmp_path / "local"
    big = (3 << 20) if durable.name != "local" else 4096  # 12 MiB: multipart at the targets' 5 MiB parts
    with manager(durable, local, keep=2, local_keep=1, **engine_kwargs) as mgr:
        for step in (10, 20, 30):
            handle = mgr.save(state(step, big), step)
            info = handle.result()
            assert info.uri.startswith(str(local)), info.uri  # the handle completes at the local commit
            assert info.engine in ran_by, info.engine
        mgr.wait()
        assert durable_steps(durable) == [20, 30]
        assert local_steps(local) == [30]
        assert mgr.all_steps() == [20, 30]
        assert mgr.latest_step() == 30
        assert loads(mgr, big=big) == 30
        assert loads(mgr, 20, big=big) == 20  # only durable: read from there
    for step in (20, 30):
        assert_durable_step(durable, step, big)


def test_fresh_local_dir_resumes_from_the_durable_tier(durable: Target, tmp_path: Path) -> None:
    with manager(durable, tmp_path / "node-a") as mgr:
        for step in (1, 2):
            mgr.save(state(step), step)
    fresh = tmp_path / "node-b"
    with manager(durable, fresh) as mgr:
        assert mgr.all_steps() == [1, 2]
        assert loads(mgr) == 2
        mgr.save(state(3), 3)  # and goes on from there
        mgr.wait()
        assert local_steps(fresh) == [3]
    assert durable_steps(durable) == [1, 2, 3]


def test_load_reads_the_local_copy_when_it_is_whole(tmp_path: Path) -> None:
    durable = Target("local", str(tmp_path / "durable"))
    local = tmp_path / "local"
    with manager(durable, local) as mgr:
        mgr.save(state(5), 5)
        mgr.wait()
        # Damage the durable copy: a load that read it would fail its checksums.
        data = next(p for p in (tmp_path / "durable" / step_dir(5)).iterdir() if p.suffix == ".distcp")
        data.write_bytes(b"\0" * data.stat().st_size)
        assert loads(mgr) == 5
        # A local copy that lost a file is not whole: the (repaired) durable copy is read.
        shutil_copy = (local / step_dir(5) / data.name).read_bytes()
        data.write_bytes(shutil_copy)
        (local / step_dir(5) / data.name).unlink()
        assert mgr.all_steps() == [5]
        assert loads(mgr) == 5


def test_replicate_every_and_local_retention(tmp_path: Path) -> None:
    durable = Target("local", str(tmp_path / "durable"))
    local = tmp_path / "local"
    with manager(durable, local, local_keep=2, replicate_every=2) as mgr:
        for step in range(1, 6):
            mgr.save(state(step), step)
        mgr.wait()
        assert durable_steps(durable) == [2, 4]  # only even steps go to the durable tier
        assert local_steps(local) == [4, 5]
        assert mgr.all_steps() == [2, 4, 5]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gaps=st.lists(st.integers(1, 3), min_size=1, max_size=6),
    every=st.integers(1, 3),
    keep=st.one_of(st.none(), st.integers(1, 3)),
    local_keep=st.one_of(st.none(), st.integers(1, 3)),
)
def test_retention_per_tier_matches_the_model(
    tmp_path_factory: pytest.TempPathFactory, gaps: list[int], every: int, keep: int | None, local_keep: int | None
) -> None:
    """Whatever the steps and settings: the durable tier holds the ``keep``
    newest steps divisible by ``every``, the local tier the ``local_keep``
    newest steps, and a load gets the newest step, exactly."""
    base = tmp_path_factory.mktemp("model")
    durable, local = Target("local", str(base / "durable")), base / "local"
    steps = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    with manager(durable, local, keep=keep, local_keep=local_keep, replicate_every=every) as mgr:
        for step in steps:
            mgr.save(state(step, 64), step)
        mgr.wait()
        selected = [s for s in steps if s % every == 0]
        assert durable_steps(durable) == (selected[-keep:] if keep else selected)
        assert local_steps(local) == (steps[-local_keep:] if local_keep else steps)
        assert mgr.all_steps() == sorted(set(durable_steps(durable)) | set(local_steps(local)))
        assert loads(mgr, big=64) == steps[-1]


def test_a_local_step_is_kept_until_it_is_replicated(tmp_path: Path) -> None:
    durable_path = tmp_path / "durable"
    durable_path.write_text("a file where the durable root should be")  # every replication fails
    durable = Target("local", str(durable_path))
    local = tmp_path / "local"
    mgr = manager(durable, local, local_keep=1, keep=2)
    for step in (1, 2, 3):
        mgr.save(state(step), step)  # local commits go on
    with pytest.raises(dcpstore.SaveError, match="replication to .*durable.* failed"):
        mgr.wait()
    assert local_steps(local) == [1, 2, 3]  # none replicated: none deleted
    mgr.close()
    durable_path.unlink()
    # The next manager over the same local dir replicates what the durable tier lacks.
    with manager(durable, local, local_keep=1, keep=2) as mgr:
        mgr.wait()
        assert durable_steps(durable) == [2, 3]
        assert local_steps(local) == [3]
    for step in (2, 3):
        assert_durable_step(durable, step)


def test_a_corrupt_local_copy_is_never_replicated(tmp_path: Path) -> None:
    durable = Target("local", str(tmp_path / "durable"))
    local = tmp_path / "local"
    dcpstore.save(state(7), str(local / step_dir(7)))
    data = next(p for p in (local / step_dir(7)).iterdir() if p.suffix == ".distcp")
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x40  # bit rot after the local commit
    data.write_bytes(bytes(blob))
    mgr = manager(durable, local)  # catch-up replicates step 7
    with pytest.raises(dcpstore.SaveError, match="does not match its integrity manifest"):
        mgr.wait()
    mgr.close()
    assert durable_steps(durable) == []
    assert not (tmp_path / "durable" / step_dir(7) / data.name).exists()


def test_gc_keeps_a_replication_in_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    durable = Target("local", str(tmp_path / "durable"))
    gate = BlockAt(lambda e: e.startswith(f"commit:{step_dir(1)}/__"))  # a data file's upload hangs
    hook_all_storage({durable.uri: gate}, monkeypatch.setattr)
    mgr = manager(durable, tmp_path / "local")
    mgr.save(state(1), 1)
    gc_keeps_running(durable.uri, gate, 1)
    mgr.wait()
    mgr.close()
    assert_durable_step(durable, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"local_keep": 0}, "local_keep"),
        ({"replicate_every": 0}, "replicate_every"),
        ({"replicate_every": True}, "replicate_every"),
        ({"replicate_timeout_s": 0}, "replicate_timeout_s"),
        ({"local_dir": "s3://bucket/x"}, "local_dir must be a local path"),
    ],
)
def test_bad_tier_arguments_are_refused(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    kwargs.setdefault("local_dir", str(tmp_path / "local"))
    with pytest.raises(dcpstore.InvalidArgument, match=match):
        dcpstore.CheckpointManager(str(tmp_path / "durable"), **kwargs)
    with pytest.raises(dcpstore.InvalidArgument, match="need local_dir"):
        dcpstore.CheckpointManager(str(tmp_path / "durable"), local_keep=1)


def test_only_a_tiered_manager_loads_the_tiers(tmp_path: Path) -> None:
    """A plain manager leaves the tiers package (replicator threads, node
    discovery) unimported; a manager given local_dir imports it."""
    script = (
        "import sys, dcpstore\n"
        "TIERS = 'dcpstore._impl.manager.tiers'\n"
        f"with dcpstore.CheckpointManager({str(tmp_path / 'plain')!r}) as m:\n"
        "    assert not m.tiered and TIERS not in sys.modules, sorted(k for k in sys.modules if 'tiers' in k)\n"
        f"with dcpstore.CheckpointManager({str(tmp_path / 'durable')!r}, local_dir={str(tmp_path / 'local')!r}) as m:\n"
        "    assert m.tiered and TIERS in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_replication_pending_at_exit_is_finished_by_atexit(tmp_path: Path) -> None:
    """A script that saves asynchronously and exits without wait() or close():
    the exit hook finishes the local commit and the replication."""
    durable, local = tmp_path / "durable", tmp_path / "local"
    script = (
        "import torch, dcpstore\n"
        f"mgr = dcpstore.CheckpointManager({str(durable)!r}, local_dir={str(local)!r}, async_=True)\n"
        "mgr.save({'w': torch.full((1 << 20,), 1.0)}, 1)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert local_steps(local) == [1]
    assert durable_steps(Target("local", str(durable))) == [1]


def test_an_unreachable_durable_root_fails_at_construction(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    s3 = make_target("s3", request)  # the session's endpoint; a bucket that does not exist
    with pytest.raises(dcpstore.CheckpointError, match="s3://dcpstore-no-such-bucket/run"):
        dcpstore.CheckpointManager(
            "s3://dcpstore-no-such-bucket/run", local_dir=str(tmp_path / "local"), options=s3.save_options(async_=True)
        )


def test_ls_shows_where_each_step_lives(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dcpstore._impl.cli import main as cli_main

    durable = Target("local", str(tmp_path / "durable"))
    local = tmp_path / "local"
    with manager(durable, local, keep=2, local_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(state(step), step)
    # durable: 2, 3; local: 2, 3 -> add a local-only step (replicate_every skips it)
    with manager(durable, local, keep=2, local_keep=3, replicate_every=2) as mgr:
        mgr.save(state(5), 5)
    assert cli_main(["ls", durable.uri, "--local-dir", str(local)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("step_")}
    assert "both" in lines[step_dir(2)] and "both" in lines[step_dir(3)], out
    assert "local" in lines[step_dir(5)] and "both" not in lines[step_dir(5)], out
    assert step_dir(1) not in lines, out


# -- crash safety: SIGKILL anywhere in a replication -----------------------------


def _replicating_child(durable_uri: str, local: str, kwargs: dict[str, Any], hook: Any) -> None:
    """Commit step 1 (replicated), then step 2, killed by ``hook`` (on the
    durable tier's storage calls only) while step 2 is replicated."""
    with dcpstore.CheckpointManager(
        durable_uri, local_dir=local, async_=False, keep=1, options=save_options(kwargs)
    ) as mgr:
        mgr.save(state(1, 1 << 20), 1)
        mgr.wait()
    hook_all_storage({durable_uri: hook})
    with dcpstore.CheckpointManager(
        durable_uri, local_dir=local, async_=False, keep=1, options=save_options(kwargs)
    ) as mgr:
        mgr.save(state(2, 1 << 20), 2)
        mgr.wait()


def _kill_child(durable_uri: str, local: str, kwargs: dict[str, Any], at: int | tuple[str, bool]) -> None:
    """Killed at the ``at``-th durable event, or at the first one named ``at``."""
    _replicating_child(durable_uri, local, kwargs, KillAt(at) if isinstance(at, int) else KillOn(*at))


def _probe_child(durable_uri: str, local: str, kwargs: dict[str, Any], queue: Any) -> None:
    recorder = Recorder()
    _replicating_child(durable_uri, local, kwargs, recorder)
    queue.put(recorder.events)


def _run_replication_crashes(durable: Target, tmp_path: Path, points: int) -> None:
    ctx = forkserver()
    queue = ctx.Queue()
    probe = durable.child("probe")
    child_kwargs = durable.kwargs
    assert crash(ctx, _probe_child, probe.uri, str(tmp_path / "probe"), child_kwargs, queue) == 0
    events = queue.get(timeout=30)
    # Named points at the commit of step 2's replica, each with whether step
    # 2 must be durable after the kill: right before its .metadata is
    # written, and right after. Then points spread over every event, where
    # only "whole committed steps" is checked: the number of events before a
    # point varies from run to run (a new manager reads a durable .metadata
    # only when its whole-second time looks older than the local copy's).
    named: list[tuple[int | tuple[str, bool], bool | None]] = [
        ((f"commit:{step_dir(2)}/{METADATA}", False), False),
        ((f"committed:{step_dir(2)}/{METADATA}", False), True),
    ]
    kills = named + [(k, None) for k in sorted(set(spread(len(events), points)) | {0, len(events) - 1})]
    replicated_from = min(i for i, e in enumerate(events) if e.startswith(f"open:{step_dir(2)}/"))
    runs = crash_at_each(ctx, _kill_child, durable, tmp_path, child_kwargs, kills, events)
    for root, local, durable_after, where in runs:
        steps = durable_steps(root)
        # Whole committed steps only, never none: step 1 is retired only after step 2 committed.
        assert steps in ([1], [2], [1, 2]), (where, steps)
        if durable_after is not None:
            assert (2 in steps) == durable_after, (where, steps)
        for step in steps:
            assert_durable_step(root, step, 1 << 20, killed=True)
        # gc removes what the killed replication left (its process is gone), never a committed step.
        storage = dcpstore.open_storage(root.uri, **root.kwargs)
        try:
            gc(storage, older_than_s=0)
            assert all(e.committed for e in list_checkpoints(storage)), where
        finally:
            storage.close()
        assert durable_steps(root) == steps, where
        # The next manager over the same local dir replicates step 2 (if the
        # kill came after its local commit: the first events are the manager's own listings).
        newest = local_steps(local)[-1]
        with manager(root, local, keep=1) as mgr:
            mgr.wait()
        after = durable_steps(root)
        # Retention (keep=1) of step 1 runs after the next commit, as a plain manager's does.
        assert after[-1] == newest and set(after) <= {1, 2}, (where, after)
        assert_durable_step(root, newest, 1 << 20, killed=True)  # a kill after the commit: gc's markers
        point = where[0]  # an event index, or a named event (all of them after the local commit)
        assert newest == 2 or (isinstance(point, int) and point < replicated_from), where


def test_sigkill_during_replication_leaves_whole_steps_local(tmp_path: Path) -> None:
    _run_replication_crashes(Target("local", str(tmp_path / "durable")), tmp_path, 10)


@pytest.mark.slow
def test_sigkill_during_replication_leaves_whole_steps_s3(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    _run_replication_crashes(make_target("s3", request), tmp_path, 16)


# -- two gloo ranks ---------------------------------------------------------------


def _ranks_save(rank: int, world_size: int, durable_uri: str, local_dirs: list[str], env: dict[str, str]) -> None:
    # One local directory that every rank sees.
    local = local_dirs[rank % len(local_dirs)]
    with dcpstore.CheckpointManager(
        durable_uri, local_dir=local, async_=True, keep=2, local_keep=2, options=dcpstore.SaveOptions(workers=2)
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(dtensor_state(world_size, step), step)
        mgr.wait()
        dist.barrier()
        assert mgr.all_steps()[-1] == 3
        state = dtensor_state(world_size, 0)
        assert mgr.load(state) == 3
        assert torch.equal(state["w"].full_tensor(), full(3)) and state["step"] == 3


def _ranks_load(rank: int, world_size: int, durable_uri: str, local_dirs: list[str], expect: int) -> None:
    local = local_dirs[rank % len(local_dirs)]
    with dcpstore.CheckpointManager(durable_uri, local_dir=local) as mgr:
        state = dtensor_state(world_size, 0)
        assert mgr.load(state) == expect
        assert torch.equal(state["w"].full_tensor(), full(expect)) and state["step"] == expect


def test_two_ranks_replicate_and_agree_on_the_copy(tmp_path: Path) -> None:
    durable_uri = str(tmp_path / "durable")
    shared = str(tmp_path / "local")
    run_ranks(_ranks_save, 2, durable_uri, [shared], {})
    assert durable_steps(Target("local", durable_uri)) == [2, 3]
    assert not list(Path(durable_uri).glob(f"*/{REPLICA_REPORT_PREFIX}*"))  # reports removed after the commit
    # Resharding: one process reads it back, from the durable tier (a fresh dir) or the local one.
    for local in (str(tmp_path / "fresh"), shared):
        with dcpstore.CheckpointManager(durable_uri, local_dir=local) as mgr:
            dest = {"w": torch.zeros(64, 24), "step": 0}
            assert mgr.load(dest) == 3
            assert torch.equal(dest["w"], full(3))
    # Both ranks hold the whole local copy: both read it (the durable one is damaged).
    durable_files = list(Path(durable_uri, step_dir(3)).glob("*.distcp"))
    saved = {p: p.read_bytes() for p in durable_files}
    for data in durable_files:
        data.write_bytes(b"\0" * data.stat().st_size)
    run_ranks(_ranks_load, 2, durable_uri, [shared], 3)
    # Rank 1 has no local copy (a fresh node): both read the durable tier, even
    # though rank 0's local copy looks whole (it is damaged here, at its sizes).
    for data, blob in saved.items():
        data.write_bytes(blob)
    for data in Path(shared, step_dir(3)).glob("*.distcp"):
        data.write_bytes(b"\0" * data.stat().st_size)
    run_ranks(_ranks_load, 2, durable_uri, [shared, str(tmp_path / "fresh")], 3)


def _ranks_one_fails(rank: int, world_size: int, durable_uri: str, local: str) -> None:
    import dcpstore._impl.manager.tiers.tiered as tiered

    if rank == 1:  # rank 1's uploads fail: its files never reach the durable tier

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise dcpstore.StorageError("injected: rank 1 cannot reach the object store")

        tiered.upload_files = broken  # type: ignore[assignment]
    mgr = dcpstore.CheckpointManager(durable_uri, local_dir=local, async_=False, replicate_timeout_s=3.0)
    mgr.save(dtensor_state(world_size, 1), 1)
    expected = "injected" if rank == 1 else r"\(__1_0\.distcp\) never arrived"
    with pytest.raises(dcpstore.SaveError, match=expected):
        mgr.wait()
    mgr.close()


def test_a_rank_whose_uploads_fail_leaves_no_durable_step(tmp_path: Path) -> None:
    durable_uri = str(tmp_path / "durable")
    run_ranks(_ranks_one_fails, 2, durable_uri, str(tmp_path / "local"))
    assert durable_steps(Target("local", durable_uri)) == []
    assert local_steps(tmp_path / "local") == [1]  # kept: it still needs replicating


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_item_over_512_mib_replicates_to_s3_and_loads_back(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    durable = make_target("s3", request)
    # moto reads the whole object for every ranged GET: few large parts, two
    # at a time (as tests/integration/test_scale.py does), keep this to a few minutes.
    durable.kwargs["storage_options"] = dcpstore.StorageOptions(
        part_size=256 << 20, max_concurrency=2, max_attempts=5, read_timeout_s=300.0, op_timeout_s=900.0
    )
    big = (600 << 20) // 4 + 3  # one float32 tensor past 2**29 bytes, not a multiple of a MiB
    with manager(durable, tmp_path / "local", local_keep=1) as mgr:
        mgr.save(state(1, big), 1)
        mgr.wait()
    assert_durable_step(durable, 1, big, load=False)
    with manager(durable, tmp_path / "fresh") as mgr:  # a fresh node: resumes from S3, every CRC checked
        assert loads(mgr, big=big) == 1


# -- wait() right after an async save ---------------------------------------------


def test_wait_right_after_a_save_waits_for_its_replication(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save handle's result() returns before its done callbacks run (the
    one that queues the replication among them): wait() counts the save
    until that callback ran. The callbacks are held back here, as a busy
    machine holds them, so a wait() that missed the save would return with
    nothing replicated."""
    import threading

    from dcpstore._impl.values.results import SaveHandle

    real = SaveHandle.add_done_callback

    def late(self: SaveHandle, fn: Any) -> None:
        real(self, lambda h: threading.Timer(0.5, fn, (h,)).start())

    monkeypatch.setattr(SaveHandle, "add_done_callback", late)
    durable = Target("local", str(tmp_path / "durable"))
    with manager(durable, tmp_path / "local", async_=True) as mgr:
        mgr.save(state(1), 1)
        mgr.wait()
        assert mgr.all_steps() == [1]
        assert durable_steps(durable) == [1]
