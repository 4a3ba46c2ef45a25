"""``checkpoint.custom_manager_class = "dcpstore.adapters.megatron.BridgeCheckpointManager"``:
a Megatron-Bridge 0.6.2 run checkpoints through dcpstore by configuration.

Driven by Bridge's own code from its wheel (tests/support/bridge_run.py,
tests/support/bridge_wheel.py) on gloo ranks, with the values a user types
(``checkpoint.save = "s3://bucket/run"``), stock ``dcp.load`` as the oracle:

* async ``fsdp_dtensor`` saves land in Bridge's layout with dcpstore's
  commit, checksums, Bridge's ``train_state.pt`` and ``run_config.yaml``
  inside the commit, the tracker, ``most_recent_k``; ``dcpstore verify``
  says OK; on local disk, S3 and MSC;
* a run resumed from them (on ``s3://`` too, where Bridge's own check sees
  nothing) continues exactly as the run that was never stopped: model,
  optimizer, scheduler, train state, RNG; ``ckpt_step`` picks the step;
* a rank SIGKILLed mid-save leaves the previous step, which resumes exactly;
* Bridge's own resume reads the manager's steps, and the manager resumes
  steps Bridge's sync save wrote; a resume on more ranks reshards;
* what the manager does not cover is refused, naming the field, and Bridge's
  allowlist demands exactly one call.
"""

from __future__ import annotations

import io
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
import dcpstore.tools
from dcpstore._impl.cli import main as cli_main
from dcpstore._impl.engines.selection import auto_engine
from dcpstore._impl.storage import join_uri
from tests.support import killcount
from tests.support.async_helpers import open_target
from tests.support.backends import make_target
from tests.support.bridge_kit import local_copy, run_ranks_codes
from tests.support.bridge_run import MANAGER, PROCESS_MANAGER, bridge_config, read_report, train
from tests.support.bridge_wheel import BRIDGE_MODULE, checkpointing_module
from tests.support.dist_utils import run_ranks

TRACKER = "latest_checkpointed_iteration.txt"


def _equal(want: Any, got: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and want.keys() == got.keys(), f"{where}: {sorted(want)} != {sorted(got)}"
        for key in want:
            _equal(want[key], got[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(want, got), f"values differ at {where}"
    else:
        assert want == got, f"{where}: {want!r} != {got!r}"


def _run(cfg: Any, until: int, report: Path, world: int = 2, **how: Any) -> dict[str, Any]:
    report.mkdir()
    run_ranks(train, world, cfg, until, str(report), how, timeout=300)
    return read_report(report)


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run of 8 steps on 2 ranks that was never stopped: what a resumed run
    must end as (the save mode does not change the values it trains to)."""
    tmp = tmp_path_factory.mktemp("never-stopped")
    return _run(bridge_config(save=str(tmp / "run"), load=str(tmp / "run")), 8, tmp / "report")


def _io(target: Any) -> dict[str, Any]:
    return {k: v for k, v in target.kwargs.items() if k != "enable_msc"}


def _stock_model(
    uri: str, kwargs: dict[str, Any], like: dict[str, torch.Tensor], scratch: Path
) -> dict[str, torch.Tensor]:
    """The step's model, by stock ``dcp.load`` (the oracle) into plain tensors."""
    out = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(local_copy(uri, kwargs, scratch))), no_dist=True)
    return out["model"]


@pytest.mark.parametrize(
    "backend, world, async_save",
    [
        # Every other test here runs on local disk; the quick run takes the
        # URI that Bridge itself would mangle.
        pytest.param("local", 2, True, marks=pytest.mark.slow),
        ("s3", 2, True),
        pytest.param("msc", 2, True, marks=pytest.mark.slow),
        pytest.param("local", 4, False, marks=pytest.mark.slow),
        pytest.param("s3", 4, True, marks=pytest.mark.slow),
    ],
)
def test_a_bridge_run_saves_through_dcpstore_and_resumes_exactly(
    request: pytest.FixtureRequest, tmp_path: Path, backend: str, world: int, async_save: bool
) -> None:
    target = make_target(backend, request)
    where_kwargs = _io(target)
    root, whole_root = target.uri, target.uri.rstrip("/") + "-whole"
    settings = dict(async_save=async_save, most_recent_k=2)
    whole = _run(bridge_config(save=whole_root, load=whole_root, **settings), 8, tmp_path / "whole", world)
    first = _run(bridge_config(save=root, load=root, **settings), 4, tmp_path / "first", world)
    assert whole["resumed"] is None and first["resumed"] is None  # nothing to resume: a fresh start
    second = _run(bridge_config(save=root, load=root, **settings), 8, tmp_path / "second", world)
    assert second["resumed"] == 4  # on s3:// too, where Bridge's own check sees no checkpoint
    _equal(whole["final"], second["final"], "final")  # model, optimizer, scheduler, train state, RNG
    storage = open_target(target)
    auto = auto_engine(storage.backend, storage.uri)  # the ranks run on this host
    storage.close()
    engine = auto.order[0] if async_save else "sync"  # engine="auto"
    assert {e for _, e, _ in whole["engines"]} == {engine}, whole["engines"]

    steps = dcpstore.CheckpointManager(root, layout="bridge", async_=False, options=target.save_options())
    assert steps.all_steps() == [6, 8]  # most_recent_k=2
    assert steps.read_pointer() == 8
    steps.close()
    step8 = join_uri(root, "iter_0000008")
    _equal(
        second["saved"][8], _stock_model(step8, where_kwargs, second["saved"][8], tmp_path / "copy8"), "stock dcp.load"
    )
    assert cli_main(["verify", step8] + (["--enable-msc"] if target.kwargs.get("enable_msc") else [])) == 0
    where = target.save_options().storage_options
    train_state = torch.load(
        io.BytesIO(dcpstore.tools.commit_file(step8, "train_state.pt", storage_options=where)), weights_only=True
    )
    assert train_state["step"].item() == 8 and train_state["consumed_train_samples"].item() == 8 * 4 * world
    assert train_state["floating_point_operations_so_far"].item() == 8000
    assert b"tensor_model_parallel_size: 1" in dcpstore.tools.commit_file(
        step8, "run_config.yaml", storage_options=where
    )


@pytest.mark.slow
def test_a_subclass_picks_dcpstores_engine(tmp_path: Path) -> None:
    """``custom_manager_class`` naming a subclass with ``options``: its saves
    run on the checkpoint-process engine, and resume exactly."""
    root, whole_root = str(tmp_path / "run"), str(tmp_path / "whole")
    settings = dict(async_save=True, custom_manager_class=PROCESS_MANAGER)
    whole = _run(bridge_config(save=whole_root, load=whole_root, **settings), 6, tmp_path / "r0")
    assert [(step, engine) for step, engine, _ in whole["engines"]] == [(2, "process"), (4, "process"), (6, "process")]
    _run(bridge_config(save=root, load=root, **settings), 4, tmp_path / "r1")
    second = _run(bridge_config(save=root, load=root, **settings), 6, tmp_path / "r2")
    assert second["resumed"] == 4
    _equal(whole["final"], second["final"], "final")


def test_with_megatrons_enable_msc_the_bytes_go_through_msc(tmp_path: Path) -> None:
    """``--enable-msc`` (megatron-core's process-global switch): the manager's
    saves and loads go through MSC, as Bridge's own I/O does then."""
    root, whole_root = str(tmp_path / "run"), str(tmp_path / "whole")
    whole = _run(bridge_config(save=whole_root, load=whole_root, async_save=True), 6, tmp_path / "r0", enable_msc=True)
    assert {backend for _, _, backend in whole["engines"]} == {"msc"}, whole["engines"]
    _run(bridge_config(save=root, load=root, async_save=True), 4, tmp_path / "r1", enable_msc=True)
    second = _run(bridge_config(save=root, load=root, async_save=True), 6, tmp_path / "r2", enable_msc=True)
    assert second["resumed"] == 4
    _equal(whole["final"], second["final"], "final")


def test_resume_without_the_rng_state_is_not_exact(tmp_path: Path, never_stopped: dict[str, Any]) -> None:
    """The comparison above can fail: without Bridge's RNG restore the
    resumed run draws other batches."""
    root = str(tmp_path / "run")
    _run(bridge_config(save=root, load=root), 4, tmp_path / "r1")
    second = _run(bridge_config(save=root, load=root, load_rng=False), 8, tmp_path / "r2")
    assert second["resumed"] == 4
    with pytest.raises(AssertionError, match="values differ"):
        _equal(never_stopped["final"]["model"], second["final"]["model"])


def test_ckpt_step_resumes_that_step_and_a_missing_one_is_named(tmp_path: Path, bridge: ModuleType) -> None:
    root = str(tmp_path / "run")
    first = _run(bridge_config(save=root, load=root), 6, tmp_path / "r1")
    again = _run(bridge_config(save=root, load=root, ckpt_step=4), 6, tmp_path / "r2")
    assert again["resumed"] == 4
    _equal(first["saved"][4], again["loaded"], "loaded")
    _equal(first["final"], again["final"], "final")  # 4 -> 6 again, exactly as the first time
    bridge.register_allowed_target_prefix("dcpstore")
    manager = bridge.create_checkpoint_manager(bridge_config(save=root, load=root, ckpt_step=5).checkpoint)
    with pytest.raises(
        dcpstore.CheckpointNotFound, match=r"checkpoint.ckpt_step=5 is not a committed step .*\[2, 4, 6\]"
    ):
        manager.resume_point()


def test_a_rank_killed_mid_save_leaves_the_previous_step_which_resumes_exactly(
    tmp_path: Path, never_stopped: dict[str, Any]
) -> None:
    root = str(tmp_path / "run")
    (tmp_path / "r1").mkdir()
    cfg = bridge_config(save=root, load=root, async_save=True)
    codes = run_ranks_codes(train, 2, cfg, 8, str(tmp_path / "r1"), {"kill_at": 6}, timeout=240)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes  # rank 0's save fails with its peer gone
    killcount.record(1, 1, 1)
    steps = dcpstore.CheckpointManager(root, layout="bridge", async_=False)
    assert steps.all_steps() == [2, 4] and steps.read_pointer() == 4
    steps.close()
    assert cli_main(["gc", "--older-than", "0", root]) == 0  # the wreck of step 6
    second = _run(bridge_config(save=root, load=root, async_save=True), 8, tmp_path / "r2")
    assert second["resumed"] == 4
    _equal(never_stopped["final"], second["final"], "final")


def test_bridges_own_resume_reads_the_managers_steps_and_the_manager_bridges(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    first = _run(bridge_config(save=root, load=root), 4, tmp_path / "r1")
    # Bridge's own _load_checkpoint_from_path(checkpoint.load) with megatron-core's stock reader.
    by_bridge = _run(bridge_config(save=str(tmp_path / "other"), load=root), 4, tmp_path / "r2", bridge_load=True)
    assert by_bridge["resumed"] == 4
    _equal(first["saved"][4], by_bridge["loaded"], "Bridge's load")
    # A root as Bridge's sync save leaves it: stock DCP files, its two files beside them, no manifest.
    bridge_root = tmp_path / "bridge-run"
    shutil.copytree(Path(root) / "iter_0000004", bridge_root / "iter_0000004")
    for manifest in (bridge_root / "iter_0000004").glob(".dcpstore*"):
        manifest.unlink()
    (bridge_root / TRACKER).write_text("4")
    ours = _run(bridge_config(save=str(bridge_root), load=str(bridge_root)), 6, tmp_path / "r3")
    assert ours["resumed"] == 4
    _equal(first["saved"][4], ours["loaded"], "the manager's load of Bridge's step")


def test_a_pretrained_checkpoint_starts_a_fine_tune_from_its_weights(tmp_path: Path) -> None:
    """``pretrained_checkpoint`` with nothing under ``load``: Bridge's
    fine-tune start (weights only, iteration 0), from the newest step."""
    base = str(tmp_path / "base")
    first = _run(bridge_config(save=base, load=base), 4, tmp_path / "r1")
    tuned = str(tmp_path / "tuned")
    fine = _run(bridge_config(save=tuned, load=tuned, pretrained_checkpoint=base), 2, tmp_path / "r2")
    assert fine["resumed"] == 0  # Bridge resets the iteration of a fine-tune
    _equal(first["saved"][4], fine["loaded"], "pretrained weights")
    assert fine["final"]["scheduler"]["num_steps"] == 2  # the schedule starts over: no optimizer state was loaded
    steps = dcpstore.CheckpointManager(tuned, layout="bridge", async_=False)
    assert steps.all_steps() == [2]  # the fine-tune saves under its own root
    steps.close()


@pytest.mark.slow
def test_a_resume_on_more_ranks_reshards(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    first = _run(bridge_config(save=root, load=root), 4, tmp_path / "r1", world=2)
    wider = _run(bridge_config(save=root, load=root), 4, tmp_path / "r2", world=4)
    assert wider["resumed"] == 4
    _equal(first["saved"][4], wider["loaded"], "loaded on 4 ranks")


# -- in this process: Bridge's factory, its allowlist, what is refused --------------


@pytest.fixture
def bridge() -> Iterator[ModuleType]:
    """Bridge's checkpointing module, compiled into this process, and gone after."""
    before = set(sys.modules)
    yield checkpointing_module()
    for name in set(sys.modules) - before:
        del sys.modules[name]
    assert BRIDGE_MODULE not in sys.modules


def test_bridges_allowlist_demands_one_call(tmp_path: Path, bridge: ModuleType) -> None:
    cfg = bridge_config(save=str(tmp_path), load=str(tmp_path)).checkpoint
    with pytest.raises(bridge.InstantiationException, match="register_allowed_target_prefix"):
        bridge.create_checkpoint_manager(cfg)
    bridge.register_allowed_target_prefix("dcpstore")
    manager = bridge.create_checkpoint_manager(cfg)  # Bridge checks the protocol too
    assert (
        type(manager).__module__ + "." + type(manager).__name__
        == "dcpstore._impl.adapters.megatron_manager.BridgeCheckpointManager"
    )
    assert MANAGER == "dcpstore.adapters.megatron.BridgeCheckpointManager"
    assert isinstance(manager, bridge.CheckpointManager)


@pytest.mark.parametrize(
    "field, value, match",
    [
        (
            "ckpt_format",
            "torch_dist",
            r"checkpoint.ckpt_format: is 'torch_dist'; this manager saves 'fsdp_dtensor' only",
        ),
        ("non_persistent_save_interval", 10, r"checkpoint.non_persistent_save_interval: is set"),
        (
            "also_save_hf_checkpoint",
            True,
            r"checkpoint.also_save_hf_checkpoint: the Hugging Face sidecar export is not covered",
        ),
        ("most_recent_k", 0, r"CheckpointConfig.most_recent_k: must be -1 \(keep all\) or an int >= 1"),
    ],
)
def test_what_the_manager_does_not_cover_is_refused_naming_the_field(
    tmp_path: Path, bridge: ModuleType, field: str, value: Any, match: str
) -> None:
    bridge.register_allowed_target_prefix("dcpstore")
    cfg = bridge_config(save=str(tmp_path), load=str(tmp_path), **{field: value}).checkpoint
    with pytest.raises(dcpstore.InvalidArgument, match=match):
        bridge.create_checkpoint_manager(cfg)
