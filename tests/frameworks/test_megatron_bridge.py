"""Megatron-Bridge's async ``fsdp_dtensor`` saves through
``dcpstore.adapters.megatron.FileSystemWriterAsync``, driven exactly as
Bridge 0.6.2 drives NVRx's writer (tests/support/bridge_kit.py: NVRx's own planner,
finalize, ``AsyncRequest`` and persistent ``AsyncCallsQueue``), on real gloo
ranks, with stock ``dcp.load`` as the oracle.

* saves land on every backend, with dcpstore's commit and checksums; two
  saves in flight at once; every tensor changed in place right after the
  save returned (what the preload staged is what lands);
* a rank SIGKILLed mid-save (trainer and worker): nothing is committed, the
  previous checkpoint (also when saved over) loads exactly, the tracker is
  untouched, ``dcpstore gc`` removes the wreck, the next save commits;
* ``ckpt_assume_constant_structure=True`` with NVRx's metadata cache on:
  replayed plans save correctly, and a changed structure under a replayed
  plan fails that save on every rank instead of committing a wrong one.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import signal
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcpstore
from dcpstore._impl.adapters.megatron_bridge import BridgeRoots
from dcpstore._impl.cli import main as cli_main
from dcpstore._impl.storage import join_uri, open_storage
from dcpstore._impl.tools.maintenance import list_checkpoints
from dcpstore.adapters.megatron import FileSystemWriterAsync, install_in_bridge
from tests.support import killcount
from tests.support.backends import make_target, save_options
from tests.support.bridge_kit import (
    TRACKER,
    assert_equal,
    bridge_module,
    bridge_save,
    check_step,
    cuda_device_is_cpu,
    dying,
    full_state,
    iter_dir,
    mesh_of,
    mutate,
    new_queue,
    run_ranks_codes,
    sharded,
    stop_results_managers,
    zeros,
)
from tests.support.bridge_wheel import checkpoint_utils
from tests.support.dist_utils import run_ranks
from tests.support.extras import NVRX, skip_module_unless

# NVRx throughout; under CI (which runs this file on every tested release) a missing one fails.
skip_module_unless(NVRX)


def _installed(io: dict[str, Any], root: str | None = None) -> Any:
    """Bridge's checkpointing names after ``install_in_bridge`` for a run
    whose ``checkpoint.save`` and ``load`` are ``root`` (with the suites'
    small multipart part size on object stores)."""
    config = SimpleNamespace(save=root, load=root, pretrained_checkpoint=None)
    return bridge_module(
        checkpoint_config=config, **({"storage_options": io["storage_options"]} if "storage_options" in io else {})
    )


def _step_name(root: str, step: int, use_msc: bool) -> str:
    """The name Bridge's save passes its writer for ``step``: Bridge's own
    ``get_checkpoint_name`` (its ``pathlib`` join folds ``s3://`` into
    ``s3:/``). Under ``--enable-msc`` Bridge joins with MSC's path class,
    which keeps the URI whole."""
    return join_uri(root, iter_dir(step)) if use_msc else checkpoint_utils().get_checkpoint_name(root, step)


def _saves_job(rank: int, world: int, root: str, io: dict[str, Any], use_msc: bool, cwd: str) -> None:
    os.chdir(cwd)  # where Bridge's rank 0 makes the directory of a folded name (./s3:/...)
    with cuda_device_is_cpu():
        mesh = mesh_of(world)
        queue = new_queue()
        warmed = getattr(type(queue), "_warmup_persistent_caller", None)  # 0.6+: Bridge's warm-up started it
        assert warmed is None or warmed.process.is_alive()
        bridge = _installed(io, root)
        written = bridge.FileSystemWriterAsync(_step_name(root, 1, use_msc), use_msc=use_msc)
        assert isinstance(written, FileSystemWriterAsync) and written.storage.uri == join_uri(root, iter_dir(1))
        written.storage.close()
        local = "://" not in root
        for step in (100, 200):
            state = sharded(full_state(step), mesh)
            bridge_save(
                bridge,
                queue,
                state,
                _step_name(root, step, use_msc),
                save_root=root if local else None,
                step=step,
                workers=2,
                use_msc=use_msc,
            )
            mutate(state)  # training goes on: the staged snapshot is what must land
            queue.maybe_finalize_async_calls(blocking=False)  # step 100 may still be in flight at 200
        queue.maybe_finalize_async_calls(blocking=True)
        assert warmed is None or queue.persistent_caller is warmed  # the saves ran in the warmed-up worker
        queue.close()


CASES = [
    ("local", 2),
    pytest.param("local", 4, marks=pytest.mark.slow),
    ("s3", 2),
    pytest.param(
        "msc", 2, marks=pytest.mark.slow
    ),  # the quick run reaches MSC through Bridge in test_megatron_bridge_manager
    pytest.param("s3+msc", 2, marks=pytest.mark.slow),
    pytest.param("s3", 4, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("backend, world", CASES)
def test_bridge_async_saves_land_with_dcpstores_commit(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, world: int
) -> None:
    target = make_target(backend, request)
    io = dict(target.kwargs)
    use_msc = bool(io.pop("enable_msc", False)) or target.uri.startswith("msc://")  # Megatron's --enable-msc
    run_ranks(_saves_job, world, target.uri, io, use_msc, str(tmp_path), timeout=300)
    msc_io = {**io, "enable_msc": use_msc}
    for step in (100, 200):
        check_step(target.uri, step, msc_io, tmp_path)
    manager = dcpstore.CheckpointManager(target.uri, layout="bridge", async_=False, options=save_options(msc_io))
    assert manager.all_steps() == [100, 200]
    if backend == "local":  # Bridge's own tracker finalize (open(): local roots only)
        assert (Path(target.uri) / TRACKER).read_text() == "200"
        assert manager.read_pointer() == 200
    manager.close()


# -- a rank SIGKILLed mid-save ------------------------------------------------


def _kill_job(rank: int, world: int, root: str, io: dict[str, Any], scenario: str, report: str) -> None:
    local = "://" not in root
    with cuda_device_is_cpu():
        mesh = mesh_of(world)
        queue = new_queue()
        bridge = _installed(io)
        kwargs: dict[str, Any] = {"save_root": root if local else None, "workers": 2}
        bridge_save(bridge, queue, sharded(full_state(100), mesh), join_uri(root, iter_dir(100)), step=100, **kwargs)
        queue.maybe_finalize_async_calls(blocking=True)
        step = 200 if scenario == "next" else 100
        state = sharded(full_state(200), mesh)
        if rank == 1:  # it dies by SIGKILL: NVRx's results-queue Manager (0.6+), unused by dcpstore, would outlive it
            stop_results_managers()
        try:
            bridge_save(
                bridge,
                queue,
                state,
                join_uri(root, iter_dir(step)),
                step=step,
                wrap_save_fn=dying if rank == 1 else None,
                **kwargs,
            )
            mutate(state)
            queue.maybe_finalize_async_calls(blocking=True)
            outcome = "finalized"
        except Exception as e:  # rank 1 died: the next collective fails here
            outcome = f"raised {type(e).__name__}"
        Path(report, f"rank{rank}").write_text(outcome)
        queue.persistent_caller.close()  # NVRx 0.4.1's worker is no daemon: stop it


@pytest.mark.parametrize(
    "backend, scenario",
    [
        ("local", "next"),
        pytest.param("local", "overwrite", marks=pytest.mark.slow),
        pytest.param("s3", "next", marks=pytest.mark.slow),
    ],
)
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, scenario: str
) -> None:
    target = make_target(backend, request)
    io = dict(target.kwargs)
    report = tmp_path / "report"
    report.mkdir()
    codes = run_ranks_codes(_kill_job, 2, target.uri, io, scenario, str(report), timeout=240)
    assert codes == [0, -signal.SIGKILL], codes
    killcount.record(1, 1, 1)
    assert (report / "rank0").read_text().startswith("raised"), "rank 0 finalized a save its peer died in"
    manager = dcpstore.CheckpointManager(target.uri, layout="bridge", async_=False, options=save_options(io))
    assert manager.all_steps() == [100]
    check_step(target.uri, 100, io, tmp_path)  # the old values, exactly (also when saved over)
    if scenario == "next":
        with pytest.raises(dcpstore.CheckpointNotFound):
            dcpstore.load(full_state(200), join_uri(target.uri, iter_dir(200)), **io)
    if backend == "local":
        assert (Path(target.uri) / TRACKER).read_text() == "100"
    # The wreck is an interrupted save that gc removes; step 100 stays.
    storage = open_storage(target.uri, **io)
    assert any(not e.committed or e.leftovers or e.mixed for e in list_checkpoints(storage))
    assert cli_main(["gc", "--older-than", "0", target.uri]) == 0
    after = list_checkpoints(storage)
    assert [e.path for e in after] == [iter_dir(100)] and not (after[0].leftovers or after[0].mixed)
    storage.close()
    check_step(target.uri, 100, io, tmp_path / "after-gc")
    if scenario == "next":  # and the run saves on
        run_ranks(_saves_job, 2, target.uri, io, False, str(tmp_path), timeout=300)
        assert manager.all_steps() == [100, 200]
        check_step(target.uri, 200, io, tmp_path / "resaved")
    manager.close()


# -- failures: every rank raises, nothing is committed ------------------------


def _failures_job(rank: int, world: int, root: str, report: str) -> None:
    with cuda_device_is_cpu():
        mesh = mesh_of(world)
        queue = new_queue()
        bridge = bridge_module()
        bridge_save(bridge, queue, sharded(full_state(100), mesh), join_uri(root, iter_dir(100)), step=100, workers=2)
        queue.maybe_finalize_async_calls(blocking=True)
        lines = []
        if rank == 0:  # a directory squats on one of rank 1's data files: its worker's write fails
            os.makedirs(os.path.join(root, iter_dir(200), "__1_1.distcp"))
        dist.barrier()
        bridge_save(bridge, queue, sharded(full_state(200), mesh), join_uri(root, iter_dir(200)), step=200, workers=2)
        try:
            queue.maybe_finalize_async_calls(blocking=True)
            lines.append("committed")
        except dcpstore.SaveError as e:
            lines.append(f"failed: {type(e).__name__}: {e}")
        # overwrite=False over a committed checkpoint: refused on every rank, when the save is planned
        bridge.FileSystemWriterAsync = functools.partial(FileSystemWriterAsync, overwrite=False)
        try:
            bridge_save(
                bridge, queue, sharded(full_state(300), mesh), join_uri(root, iter_dir(100)), step=100, workers=2
            )
            lines.append("scheduled")
        except dcpstore.CheckpointExists as e:
            lines.append(f"refused: {e}")
        Path(report, f"rank{rank}").write_text("\n".join(lines))
        queue.close()


def _reported(job: Any, tmp_path: Path) -> tuple[str, list[list[str]]]:
    """Run ``job(rank, world, root, report_dir)`` on 2 ranks; the root and
    each rank's report lines."""
    root, report = str(tmp_path / "run"), tmp_path / "report"
    report.mkdir()
    run_ranks(job, 2, root, str(report), timeout=300)
    return root, [(report / f"rank{rank}").read_text().splitlines() for rank in (0, 1)]


def test_a_failure_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root, reports = _reported(_failures_job, tmp_path)
    for failed, refused in reports:
        assert failed.startswith("failed: SaveError: ") and "rank 1: " in failed and "__1_1.distcp" in failed, failed
        assert "rank 0: " not in failed  # only the rank that failed is named
        assert refused.startswith("refused: ") and "overwrite=False" in refused, refused
    with dcpstore.CheckpointManager(root, layout="bridge", async_=False) as manager:
        assert manager.all_steps() == [100]
    check_step(root, 100, {}, tmp_path)
    with pytest.raises(dcpstore.CheckpointNotFound):
        dcpstore.load(full_state(200), join_uri(root, iter_dir(200)))


# -- a second finalize: refused for what it is, the data intact -------------


def _finalize_twice_job(rank: int, world: int, root: str, report: str) -> None:
    """A committed save, then a failed one, each finalized again by hand
    with the arguments Bridge's finalize got (recorded on the way)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver

    real = state_dict_saver.save_state_dict_async_finalize
    calls: list[tuple[Any, ...]] = []

    def recording(*args: Any) -> None:
        calls.append(args)
        real(*args)

    state_dict_saver.save_state_dict_async_finalize = recording  # bridge_save imports it per save
    lines = []
    with cuda_device_is_cpu():
        mesh = mesh_of(world)
        queue = new_queue()
        bridge = bridge_module()
        for step in (100, 200):
            if step == 200 and rank == 0:  # a directory squats on one of rank 1's data files: its write fails
                os.makedirs(os.path.join(root, iter_dir(200), "__1_1.distcp"))
            dist.barrier()
            bridge_save(
                bridge, queue, sharded(full_state(step), mesh), join_uri(root, iter_dir(step)), step=step, workers=2
            )
            try:
                queue.maybe_finalize_async_calls(blocking=True)
                lines.append(f"{step} first: committed")
            except dcpstore.SaveError as e:
                lines.append(f"{step} first: {type(e).__name__}")
            try:
                real(*calls[-1])
                lines.append(f"{step} second: returned")
            except Exception as e:
                lines.append(f"{step} second: {type(e).__name__}: {e}")
        queue.close()
    Path(report, f"rank{rank}").write_text("\n".join(lines))


def test_a_second_finalize_says_the_save_is_already_finalized(tmp_path: Path) -> None:
    """NVRx's ``save_state_dict_async_finalize`` called again after a save
    was finalized: an ``InvalidArgument`` saying so, with how the save
    ended, on every rank (issue #38: it said the committed save had failed,
    its worker leaving no results). NVRx 0.4.1's own writer raises too
    (``RuntimeError: results_queue should not be empty``); nothing changes
    on storage: the committed step still loads exactly."""
    root, reports = _reported(_finalize_twice_job, tmp_path)
    for rank, lines in enumerate(reports):
        assert lines[0] == "100 first: committed" and lines[2] == "200 first: SaveError", lines
        second, failed_second = lines[1], lines[3]
        assert second.startswith(
            "100 second: InvalidArgument: save_state_dict_async_finalize called again for the save to "
        ), second
        ended = "committed." if rank == 0 else "this rank's results went to the commit on the coordinator"
        assert f"already finalized: {ended}" in second and "this second call changed nothing" in second, second
        assert "failed" not in second and "no results" not in second, second
        assert failed_second.startswith("200 second: InvalidArgument: "), failed_second
        assert "already finalized: it failed, nothing was committed (rank 1: " in failed_second, failed_second
    with dcpstore.CheckpointManager(root, layout="bridge", async_=False) as manager:
        assert manager.all_steps() == [100]
    check_step(root, 100, {}, tmp_path)


# -- NVRx 0.6+'s writer keywords ----------------------------------------------


def _cpu_shm_job(rank: int, world: int, root: str, report: str) -> None:
    """megatron-core's ``--async-ckpt-use-cpu-shm``: the queue in
    ``cpu_shm_mode`` (0.6+) and the writer with every 0.6 keyword Megatron
    passes, as Megatron finds them (in the writer's signature)."""
    with cuda_device_is_cpu():
        mesh = mesh_of(world)
        queue = new_queue(cpu_shm=True)
        bridge = bridge_module()
        params = inspect.signature(
            bridge.FileSystemWriterAsync
        ).parameters  # install_in_bridge keeps the class signature
        keywords = {
            k: True
            for k in ("use_cpu_shm_for_gpu_tensors", "use_cached_data_structure", "is_multiproc_io")
            if k in params
        }
        assert len(keywords) == 3, params
        bridge.FileSystemWriterAsync = functools.partial(FileSystemWriterAsync, **keywords)
        lines = []
        for step in (100, 200):
            state = sharded(full_state(step), mesh)
            live = {t.to_local().untyped_storage().data_ptr() for t in _dtensors(state)}
            writer = bridge_save(
                bridge, queue, state, join_uri(root, iter_dir(step)), save_root=root, step=step, workers=2
            )
            # The writer's tensors are its own snapshots in shared memory, not training's.
            staged = [t for bucket in writer.write_buckets for _, t in bucket[2][1]]
            lines.append(
                f"{step} {len(staged)} {all(t.is_shared() for t in staged)} "
                f"{any(t.untyped_storage().data_ptr() in live for t in staged)}"
            )
            mutate(state)
            queue.maybe_finalize_async_calls(blocking=False)
        queue.maybe_finalize_async_calls(blocking=True)
        Path(report, f"rank{rank}").write_text("\n".join(lines))
        queue.close()


def _dtensors(state: dict[str, Any]) -> list[Any]:
    out = []
    for value in state.values():
        if isinstance(value, dict):
            out += _dtensors(value)
        elif hasattr(value, "to_local"):
            out.append(value)
    return out


def test_nvrx_06_writer_keywords_save_from_shared_memory_snapshots(tmp_path: Path) -> None:
    root, reports = _reported(_cpu_shm_job, tmp_path)
    for lines in reports:
        for line in lines:
            step, count, shared, aliased = line.split()
            assert int(count) > 0 and shared == "True" and aliased == "False", line
    with dcpstore.CheckpointManager(root, layout="bridge", async_=False) as manager:
        assert manager.all_steps() == [100, 200] and manager.read_pointer() == 200
    for step in (100, 200):  # the values at save time, though training changed them right after
        check_step(root, step, {}, tmp_path)


def test_the_writer_takes_every_installed_releases_keywords(tmp_path: Path) -> None:
    """Feature detection, not versions: whatever NVRx is installed, each
    keyword its writer takes is a parameter of the drop-in's (Megatron
    probes the signature), and each the drop-in cannot honour is refused
    naming it as the caller spelt it."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync as NvrxWriter

    def keywords(cls: Any) -> set[str]:
        return {n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}

    assert keywords(NvrxWriter) <= keywords(FileSystemWriterAsync)
    for kwargs, match in (
        ({"separation_hint": "optimizer."}, "separation_hint='optimizer.' is not supported"),
        ({"open_file": io.open}, None),  # builtin open, by another name: taken
        ({"open_file": lambda *a: None}, "open_file=<function .* is not supported"),
        ({"is_multiproc_io": 1}, "is_multiproc_io must be a bool, got 1"),
        ({"use_cached_data_structure": "yes"}, "use_cached_data_structure must be a bool, got 'yes'"),
        ({"use_cpu_shm_for_gpu_tensors": None}, "use_cpu_shm_for_gpu_tensors must be a bool, got None"),
    ):
        if match is None:
            FileSystemWriterAsync(str(tmp_path / "ckpt"), **kwargs)
        else:
            with pytest.raises(dcpstore.InvalidArgument, match=match):
                FileSystemWriterAsync(str(tmp_path / "ckpt"), **kwargs)


# -- ckpt_assume_constant_structure: NVRx's plan cache ------------------------


def _constant_structure_job(rank: int, world: int, root: str, report: str) -> None:
    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver

    state_dict_saver.init_checkpoint_metadata_cache()  # NVRx's module cache; Bridge's enable_cache uses it
    with cuda_device_is_cpu():
        mesh = mesh_of(world)
        queue = new_queue()
        bridge = bridge_module()
        lines = []
        for step, change in ((100, None), (200, None), (300, None), (400, "grow"), (500, "new key")):
            full = full_state(step, grow=3 if change == "grow" else 0)
            if change == "new key":
                full["model"]["output_layer.weight"] = full["model"]["embedding.word_embeddings.weight"].clone()
            # NVRx replays this save's plan (get_cache_metadata: every release's;
            # get_metadata_caching_status is 0.4.1's only).
            replayed = state_dict_saver._checkpoint_metadata_cache.get_cache_metadata()[2]
            bridge_save(
                bridge,
                queue,
                sharded(full, mesh),
                join_uri(root, iter_dir(step)),
                step=step,
                workers=2,
                constant_structure=True,
            )
            try:
                queue.maybe_finalize_async_calls(blocking=True)
                lines.append(f"{step} {replayed} committed")
            except dcpstore.SaveError as e:
                lines.append(f"{step} {replayed} failed: {e}")
        Path(report, f"rank{rank}").write_text("\n".join(lines))
        queue.close()


def test_constant_structure_replays_plans_and_never_commits_a_changed_structure(tmp_path: Path) -> None:
    root, reports = _reported(_constant_structure_job, tmp_path)
    for lines in reports:
        assert [line.split(" ", 2)[:2] for line in lines] == [
            ["100", "False"],
            ["200", "False"],
            ["300", "True"],
            ["400", "True"],
            ["500", "True"],
        ]
        assert [line.split(" ", 2)[2].split(":")[0] for line in lines] == ["committed"] * 3 + ["failed"] * 2
        # Every rank raises, naming what changed (the replayed plan is not written).
        assert "changed: model.decoder.layers.1.mlp.weight" in lines[3] and "ckpt_assume_constant_structure" in lines[3]
        assert "new: model.output_layer.weight" in lines[4]
    manager = dcpstore.CheckpointManager(root, layout="bridge", async_=False)
    assert manager.all_steps() == [100, 200, 300]  # 400 and 500 never committed
    for step in (100, 200, 300):  # 300 was written from NVRx's replayed plan
        check_step(root, step, {}, tmp_path)
    manager.close()


# -- install_in_bridge: every storage path of Bridge's fsdp_dtensor at once ----


@pytest.mark.filterwarnings("ignore:`load_state_dict` is deprecated:FutureWarning")  # what Bridge 0.6.2 calls
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_install_in_bridge_puts_dcpstore_beneath_sync_saves_and_loads_too(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str
) -> None:
    """After the one call, Bridge's sync writer factory and its reader are
    dcpstore's as well (the async writer: every test above), so no path is
    left on stock storage; Bridge's sync save and its load, call for call."""
    target = make_target(backend, request)
    io = dict(target.kwargs)
    bridge = _installed(io, target.uri)
    uri = _step_name(target.uri, 100, use_msc=False)  # s3://: folded to s3:/ by Bridge's join
    state = full_state(100)
    writer = bridge._create_fsdp_dtensor_storage_writer(uri)  # save_fsdp_dtensor_checkpoint
    assert isinstance(writer, dcpstore.StorageWriter)
    dcp.save(state_dict=state, storage_writer=writer, no_dist=True)
    check_step(target.uri, 100, io, tmp_path)  # stock dcp.load, and the manifest's checksums
    reader = bridge._get_filesystem_reader(uri)  # _load_checkpoint_from_path: metadata first, then the load
    assert isinstance(reader, dcpstore.StorageReader)
    assert "model.embedding.word_embeddings.weight" in reader.read_metadata().state_dict_metadata
    out = zeros(state)
    dcp.load_state_dict(
        state_dict=out,
        storage_reader=bridge._get_filesystem_reader(uri),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert_equal(state, out)


def test_names_bridge_folds_are_read_back_as_the_configured_uri_and_only_those() -> None:
    names = checkpoint_utils()  # Bridge 0.6.2's own path functions, from its wheel
    config = SimpleNamespace(save="s3://bucket/run", load="msc://profile/run/", pretrained_checkpoint="s3://b2/base")
    roots = BridgeRoots.of(config)
    for root, want in (
        ("s3://bucket/run", "s3://bucket/run"),
        ("msc://profile/run/", "msc://profile/run"),
        ("s3://b2/base", "s3://b2/base"),
    ):
        folded = names.get_checkpoint_name(root, 10)
        assert folded == want.replace("://", ":/") + "/iter_0000010"  # what Bridge hands its writers
        assert roots.restore(folded) == f"{want}/iter_0000010"
    assert (
        roots.restore(names.get_checkpoint_tracker_filename("s3://bucket/run"))
        == "s3://bucket/run/latest_checkpointed_iteration.txt"
    )
    # The configuration decides: a name under no configured root stays as it came.
    for name in (
        "s3:/other/run/iter_0000010",
        "s3:/bucket/running/iter_0000010",
        "/tmp/s3:/bucket/run/iter_0000010",
        "s3://bucket/run/iter_0000010",
        "relative/run",
    ):
        assert roots.restore(name) == name
    assert BridgeRoots.of(None).restore("s3:/bucket/run/iter_0000010") == "s3:/bucket/run/iter_0000010"
    # Installed without the configuration, the writers and the reader name the folded URI they refuse.
    bridge = bridge_module()
    folded = names.get_checkpoint_name("s3://bucket/run", 10)
    for make in (
        lambda: bridge.FileSystemWriterAsync(folded, thread_count=1, use_msc=False),
        lambda: bridge._create_fsdp_dtensor_storage_writer(folded),
        lambda: bridge._get_filesystem_reader(folded),
    ):
        with pytest.raises(dcpstore.InvalidURI, match="s3:/bucket/run/iter_0000010"):
            make()


def test_install_in_bridge_refuses_a_module_it_does_not_know_and_replaces_nothing() -> None:
    module = ModuleType("megatron.bridge.training.checkpointing")
    module.FileSystemWriterAsync = original = object()  # type: ignore[attr-defined]
    with pytest.raises(dcpstore.InvalidArgument, match="_create_fsdp_dtensor_storage_writer, _get_filesystem_reader"):
        install_in_bridge(module)
    assert module.FileSystemWriterAsync is original


def test_a_replayed_central_plan_is_checked_even_when_the_local_plan_is_fresh() -> None:
    """Newer NVRx releases recompute the local plan of a cached save (and
    check it themselves) but still replay the central plan: the writer
    checks that one against the state dict too."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dcpstore._impl.adapters import megatron_async

    def planned(state: dict[str, Any]) -> tuple[DefaultSavePlanner, Any]:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        return planner, planner.create_local_plan()

    _, stale = planned(full_state(1))
    planner, fresh = planned(full_state(1, grow=2))
    megatron_async._check_structure(fresh, fresh, planner)  # a fresh plan passes
    with pytest.raises(dcpstore.SaveError, match=r"changed: model\.decoder\.layers\.1\.mlp\.weight"):
        megatron_async._check_structure(fresh, stale, planner)
