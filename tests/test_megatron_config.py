"""CheckpointConfig: validated once, and exactly as the writers validate.

The matrix does not hard-code which combinations are valid: for each one it
asks the config, then does what the config maps to (a real save with
save_kwargs(), a real get_app_state with ckpt_format) and requires both to
agree. When the async engines land, async_save=True flips from refused to
accepted on both sides at once, with no change here.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dcpstore
from dcpstore.adapters import fsdp
from dcpstore.adapters.megatron import CheckpointConfig, plan_caching_supported

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
        mgr.save(step, {"w": torch.full((4,), float(step))})
    mgr.close()
    loader = cfg.load_manager()
    assert loader is not None and loader.all_steps() == [3, 4]
    out = {"w": torch.zeros(4)}
    assert loader.load(out, step=CheckpointConfig(ckpt_step=3).ckpt_step) == 3 and out["w"][0] == 3.0
    assert CheckpointConfig().load_manager() is None
    with pytest.raises(dcpstore.InvalidArgument, match="CheckpointConfig.save"):
        CheckpointConfig().manager()


@pytest.mark.skipif(not plan_caching_supported(), reason="this torch has no DCP save-plan caching")
def test_constant_structure_reuses_the_plan_and_still_saves_every_step(tmp_path: Path) -> None:
    cfg = CheckpointConfig(save=str(tmp_path / "run"), ckpt_assume_constant_structure=True)
    assert cfg.save_kwargs()["planner"] is not None
    mgr = cfg.manager()
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((8,), float(step)), "b": torch.arange(3) + step})
    for step in (1, 2, 3):
        out = {"w": torch.zeros(8), "b": torch.zeros(3, dtype=torch.int64)}
        mgr.load(out, step)
        assert torch.equal(out["w"], torch.full((8,), float(step))) and torch.equal(out["b"], torch.arange(3) + step)
    mgr.close()
