"""CheckpointConfig: validated once, and exactly as the writers validate.

The matrix does not hard-code which combinations are valid: for each one it
asks the config, then does what the config maps to (a real save with
save_kwargs(), a real get_app_state with ckpt_format) and requires both to
agree. When the async engines land, async_save=True flips from refused to
accepted on both sides at once, with no change here.
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from backends import Target
from dcpstore.adapters import fsdp
from dcpstore.adapters.megatron import CheckpointConfig, plan_caching_supported
from dcpstore.dcp.writer import DcpStorageWriter

FORMATS = ["torch_dist", "fsdp_dtensor", "zarr", "torch"]
ENGINES = ["auto", "native", "nvrx", "turbo"]
WORKERS = [None, 2, 0]
MATRIX = list(itertools.product(FORMATS, [False, True], ENGINES, WORKERS))


def _writer_accepts(tmp_path: Path, fmt: str, async_: bool, engine: str, workers: int | None) -> str | None:
    """None if the writer side takes this combination, else why not."""
    try:
        state = fsdp.get_app_state(nn.Linear(2, 2), None, format=fmt)
        dcpstore.save(state, str(tmp_path / "probe"), async_=async_, engine=engine, workers=workers).result()
    except (dcpstore.InvalidArgument, NotImplementedError) as e:
        return str(e)
    return None


@pytest.mark.parametrize("fmt, async_save, engine, workers", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_config_accepts_exactly_what_the_writers_accept(
    tmp_path: Path, fmt: str, async_save: bool, engine: str, workers: int | None
) -> None:
    writer_refusal = _writer_accepts(tmp_path, fmt, async_save, engine, workers)
    kwargs = dict(save=str(tmp_path / "run"), ckpt_format=fmt, async_save=async_save, engine=engine, dist_ckpt_workers=workers)
    if writer_refusal is None:
        cfg = CheckpointConfig(**kwargs)  # type: ignore[arg-type]
        mgr = cfg.manager()
        fsdp.save_app_state(nn.Linear(2, 2), None, mgr, step=1, format=cfg.ckpt_format)
        mgr.close()
        assert mgr.all_steps() == [1]
    else:
        with pytest.raises(dcpstore.InvalidArgument) as info:
            CheckpointConfig(**kwargs)  # type: ignore[arg-type]
        field = str(info.value).split(":", 1)[0]
        assert field in {
            "CheckpointConfig.ckpt_format",
            "CheckpointConfig.async_save",
            "CheckpointConfig.engine",
            "CheckpointConfig.dist_ckpt_workers",
        }, info.value


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"most_recent_k": 0}, "most_recent_k"),
        ({"most_recent_k": -2}, "most_recent_k"),
        ({"most_recent_k": 1.5}, "most_recent_k"),
        ({"save_interval": 0}, "save_interval"),
        ({"save_interval": True}, "save_interval"),
        ({"async_save": "yes"}, "async_save"),
        ({"enable_msc": 1}, "enable_msc"),
        ({"ckpt_step": -1}, "ckpt_step"),
        ({"save": "foo://bucket/run"}, "save"),
        ({"load": "s3:///no-bucket"}, "load"),
        ({"save": 42}, "save"),
    ],
)
def test_bad_fields_are_named(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=rf"^CheckpointConfig\.{field}: "):
        CheckpointConfig(**kwargs)


def test_mapping_onto_the_manager(tmp_path: Path) -> None:
    cfg = CheckpointConfig(save=str(tmp_path / "run"), load=str(tmp_path / "run"), save_interval=2, most_recent_k=2, ckpt_format="fsdp_dtensor")
    assert cfg.keep == 2 and CheckpointConfig().keep is None
    assert [s for s in range(7) if cfg.should_save(s)] == [2, 4, 6]
    assert not CheckpointConfig(save_interval=2).should_save(2)  # nowhere to save
    mgr = cfg.manager()
    assert mgr.keep == 2 and mgr.io_kwargs["workers"] is None
    for step in range(1, 5):
        mgr.save({"w": torch.full((4,), float(step))}, step)
    mgr.close()
    loader = cfg.load_manager()
    assert loader is not None and loader.all_steps() == [3, 4]
    out = {"w": torch.zeros(4)}
    assert loader.load(out, step=CheckpointConfig(ckpt_step=3).ckpt_step) == 3 and out["w"][0] == 3.0
    assert CheckpointConfig().load_manager() is None
    with pytest.raises(dcpstore.InvalidArgument, match="CheckpointConfig.save"):
        CheckpointConfig().manager()


class _CachingPlanner(DefaultSavePlanner):
    """Plan caching on, under its own cache key (torch keys the cache by class)."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)  # type: ignore[call-arg,unused-ignore]


def _writer_replays_cached_plans(tmp_path: Path) -> bool:
    """Two saves through one caching planner, straight into the writer
    (dcpstore.save refuses such planners up front)."""
    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner.__init__).parameters:
        return False
    planner = _CachingPlanner()
    for step in (1, 2):
        writer = DcpStorageWriter(dcpstore.open_storage(str(tmp_path / f"cached{step}")))
        try:
            dcp_save({"w": torch.full((4,), float(step))}, storage_writer=writer, planner=planner, no_dist=True)
        except (CheckpointException, dcpstore.CheckpointError):
            return False
    out = {"w": torch.zeros(4)}
    dcpstore.load(out, str(tmp_path / "cached2"))
    return bool(torch.equal(out["w"], torch.full((4,), 2.0)))


def test_constant_structure_is_accepted_exactly_when_the_writer_can_replay_cached_plans(tmp_path: Path) -> None:
    replays = _writer_replays_cached_plans(tmp_path)
    assert plan_caching_supported() == replays
    kwargs: dict[str, Any] = {"save": str(tmp_path / "run"), "ckpt_assume_constant_structure": True}
    if not replays:
        with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.ckpt_assume_constant_structure: "):
            CheckpointConfig(**kwargs)
        with pytest.raises(dcpstore.InvalidArgument, match="plan caching"):
            dcpstore.save({"w": torch.ones(2)}, str(tmp_path / "x"), planner=_CachingPlanner())
        return
    mgr = CheckpointConfig(**kwargs).manager()
    for step in (1, 2, 3):
        mgr.save({"w": torch.full((8,), float(step))}, step)
    for step in (1, 2, 3):
        out = {"w": torch.zeros(8)}
        mgr.load(out, step)
        assert torch.equal(out["w"], torch.full((8,), float(step)))
    mgr.close()


@pytest.mark.filterwarnings("ignore::dcpstore.EngineFallbackWarning")
@pytest.mark.parametrize("engine", ["auto", "native", "nvrx"])
def test_engine_and_backend_are_accepted_exactly_when_the_writer_accepts_them(target: Target, engine: str) -> None:
    """engine x backend (NVRx writes POSIX and MSC only): the config's verdict
    must be the writer's, on every backend target."""
    try:
        dcpstore.save({"w": torch.ones(2)}, f"{target.uri}/probe", async_=True, engine=engine, **target.kwargs).result()
        refusal = None
    except (dcpstore.InvalidArgument, dcpstore.BackendUnavailable) as e:
        refusal = str(e)
    kwargs: dict[str, Any] = {"save": target.uri, "async_save": True, "engine": engine, "enable_msc": target.kwargs.get("enable_msc", False)}
    if refusal is None:
        CheckpointConfig(**kwargs).manager(storage_options=target.kwargs.get("storage_options")).close()
    else:
        with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.engine: "):
            CheckpointConfig(**kwargs)
        with pytest.raises(dcpstore.InvalidArgument):
            dcpstore.CheckpointManager(target.uri, engine=engine, **target.kwargs)
