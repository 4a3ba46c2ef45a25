"""``CheckpointManager(layout="bridge")``: Megatron-Bridge's ``iter_NNNNNNN/``
steps and ``latest_checkpointed_iteration.txt`` tracker, both ways.

A root written the way Bridge 0.6.2 writes one (stock ``FileSystemWriter``
under ``dcp.save`` for its sync ``fsdp_dtensor`` saves, ``train_state.pt``
and ``run_config.yaml`` in each step, ``latest_train_state.pt`` and the
tracker at the root) resumes under the manager; the manager's saves resume
under Bridge's own resolution of the newest step (:func:`bridge_resolve`,
Bridge's ``_resolve_checkpoint_iteration`` replayed) and stock ``dcp.load``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl.cli import main as cli_main
from dcpstore._impl.manager import BRIDGE, DCPSTORE, check_step
from tests.support.helpers import assert_state_equal, sample_state, zeros_like_state

TRACKER = "latest_checkpointed_iteration.txt"
TRAIN_STATE = "latest_train_state.pt"


def bridge_resolve(root: Path) -> int:
    """The step Bridge 0.6.2 resumes from under ``root``: the step of
    ``latest_train_state.pt`` when it exists, else the tracker's
    (``_resolve_checkpoint_iteration``, ``read_train_state``, ``read_metadata``)."""
    if (root / TRAIN_STATE).exists():
        return int(torch.load(root / TRAIN_STATE, weights_only=True)["step"].item())
    return int((root / TRACKER).read_text().strip())


def bridge_save(root: Path, step: int, state: dict[str, object]) -> None:
    """What Bridge's sync ``fsdp_dtensor`` save leaves for ``step``."""
    ckpt = root / f"iter_{step:07d}"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt)), no_dist=True)
    train_state = {"step": torch.tensor(step), "consumed_train_samples": torch.tensor(step * 8)}
    torch.save(train_state, ckpt / "train_state.pt")
    shutil.copy(ckpt / "train_state.pt", root / TRAIN_STATE)
    (root / TRACKER).write_text(str(step))
    (ckpt / "run_config.yaml").write_text("model: {}\n")


def test_bridge_names_steps_and_tracker_as_bridge_does() -> None:
    assert BRIDGE.step_dir(100) == "iter_0000100" and BRIDGE.step_dir(12345678) == "iter_12345678"
    assert BRIDGE.parse_step_dir("iter_0000100") == 100 and BRIDGE.parse_step_dir("iter_12345678") == 12345678
    for foreign in ("iter_100", "iter_00000100", "step_00000100", "iter_000010x", "iter_-000001", "release"):
        assert BRIDGE.parse_step_dir(foreign) is None, foreign
    assert BRIDGE.pointer_text(200) == b"200" and DCPSTORE.pointer_text(200) == b"200\n"
    assert DCPSTORE.step_dir(100) == "step_00000100" and DCPSTORE.parse_step_dir("iter_0000100") is None
    with pytest.raises(dcpstore.InvalidArgument, match="layout must be one of"):
        dcpstore.CheckpointManager("/tmp/x", layout="megatron")
    with pytest.raises(dcpstore.InvalidArgument, match="layout='bridge' is not supported with local_dir"):
        dcpstore.CheckpointManager("/tmp/x", layout="bridge", local_dir="/tmp/y")
    assert check_step(0) == 0


def test_a_run_resumes_from_bridges_checkpoints_and_bridge_from_ours(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    for step in (100, 200):
        bridge_save(root, step, sample_state(step))
    # An interrupted Bridge save: data, no .metadata. Not a step.
    (root / "iter_0000300").mkdir()
    (root / "iter_0000300" / "__0_0.distcp").write_bytes(b"partial")
    mgr = dcpstore.CheckpointManager(str(root), layout="bridge", keep=2, async_=False)
    assert mgr.all_steps() == [100, 200] and mgr.read_pointer() == 200
    restored = zeros_like_state(sample_state(0))
    assert mgr.load(restored) == 200
    assert_state_equal(sample_state(200), restored)

    mgr.save(sample_state(300), 300, overwrite=True)  # over Bridge's interrupted iter_0000300
    mgr.save(sample_state(400), 400)
    assert mgr.all_steps() == [300, 400]  # keep=2 retired Bridge's 100 and 200 once 400 committed
    assert (root / TRACKER).read_text() == "400"
    # Bridge's latest_train_state.pt named step 200: it would have resumed there.
    assert not (root / TRAIN_STATE).exists()
    assert bridge_resolve(root) == 400
    out = zeros_like_state(sample_state(0))
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(root / "iter_0000400")), no_dist=True)
    assert_state_equal(sample_state(400), out)
    assert not (root / "iter_0000100").exists() and not (root / "iter_0000200").exists()
    mgr.close()


def test_retention_leaves_bridges_files_in_steps_it_keeps(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    bridge_save(root, 100, sample_state(100))
    with dcpstore.CheckpointManager(str(root), layout="bridge", keep=2, async_=False) as mgr:
        mgr.save(sample_state(200), 200)
        assert mgr.all_steps() == [100, 200]
    assert (root / "iter_0000100" / "train_state.pt").exists() and (root / "iter_0000100" / "run_config.yaml").exists()
    assert cli_main(["gc", "--older-than", "0", str(root)]) == 0
    assert (root / "iter_0000100" / "train_state.pt").exists()  # gc removes what saves leave, never Bridge's files
