"""CheckpointConfig: validated once, and exactly as the writers validate.

The contract is written down here, not asked of dcpstore: which formats,
engines and worker counts must be accepted, sync and async, and which field
each refusal must name. Each accepted combination must really save through
both paths (a plain save of ``get_app_state`` with the mapped arguments, and
the config's manager); each refused one must be refused by the config
(``InvalidArgument`` naming the field) and by the writer with the same
exception type. ``NotImplementedError`` is never a refusal: a combination
that must work and raises it fails the test.
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
from dcpstore.engines import nvrx as nvrx_adapter
from dcpstore.adapters.megatron import CheckpointConfig, plan_caching_supported
from dcpstore.dcp.writer import DcpStorageWriter

FORMATS = ["torch_dist", "fsdp_dtensor", "zarr", "torch"]
ENGINES = ["auto", "native", "nvrx", "turbo"]
WORKERS = [None, 2, 0]
MATRIX = list(itertools.product(FORMATS, [False, True], ENGINES, WORKERS))

#: What must be accepted, sync and async alike (Megatron-Bridge's two DCP
#: formats; every dcpstore engine; any positive worker count, None: default).
ACCEPTED_FORMATS = {"torch_dist", "fsdp_dtensor"}
ACCEPTED_ENGINES = {"auto", "native", "nvrx"}
HAS_NVRX = nvrx_adapter.import_error() is None


def _bad_fields(fmt: str, engine: str, workers: int | None) -> set[str]:
    """The config fields at fault in this combination (empty: it must work)."""
    bad = set()
    if fmt not in ACCEPTED_FORMATS:
        bad.add("ckpt_format")
    if engine not in ACCEPTED_ENGINES:
        bad.add("engine")
    if workers is not None and workers < 1:
        bad.add("dist_ckpt_workers")
    return bad


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(3, 2)


@pytest.mark.filterwarnings("ignore::dcpstore.EngineFallbackWarning")
@pytest.mark.parametrize("fmt, async_save, engine, workers", MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_config_accepts_exactly_the_supported_combinations(
    tmp_path: Path, fmt: str, async_save: bool, engine: str, workers: int | None
) -> None:
    bad = _bad_fields(fmt, engine, workers)
    kwargs = dict(save=str(tmp_path / "run"), ckpt_format=fmt, async_save=async_save, engine=engine, dist_ckpt_workers=workers)
    if engine == "nvrx" and not HAS_NVRX and not bad:
        pytest.skip("nvidia-resiliency-ext not installed")
    if not bad:
        # The writer path: a plain save of the format's state with these arguments.
        uri = str(tmp_path / "plain")
        dcpstore.save(fsdp.get_app_state(_linear(1), None, format=fmt), uri, async_=async_save, engine=engine, workers=workers).result()
        # The config path: its manager, its format; both load back exactly.
        cfg = CheckpointConfig(**kwargs)  # type: ignore[arg-type]
        assert (cfg.async_save, cfg.engine, cfg.dist_ckpt_workers) == (async_save, engine, workers)
        with cfg.manager() as mgr:
            fsdp.save_app_state(_linear(1), None, mgr, step=1, format=cfg.ckpt_format)
        assert mgr.all_steps() == [1]
        for src in (uri, mgr):
            model = _linear(2)
            fsdp.load_app_state(model, None, src, format=fmt)
            assert torch.equal(model.weight, _linear(1).weight) and torch.equal(model.bias, _linear(1).bias)
        return
    with pytest.raises(dcpstore.InvalidArgument) as info:
        CheckpointConfig(**kwargs)  # type: ignore[arg-type]
    field = str(info.value).split(":", 1)[0].removeprefix("CheckpointConfig.")
    assert field in bad, f"named {field!r}, expected one of {sorted(bad)}: {info.value}"
    # The writer refuses it too, as a bad argument (never "not implemented").
    with pytest.raises(dcpstore.InvalidArgument):
        state = fsdp.get_app_state(_linear(1), None, format=fmt)
        dcpstore.save(state, str(tmp_path / "probe"), async_=async_save, engine=engine, workers=workers).result()


def test_every_field_at_fault_is_refused_on_its_own() -> None:
    """Each refusal names its own field when it is the only fault."""
    for kwargs, field in [
        ({"ckpt_format": "zarr"}, "ckpt_format"),
        ({"engine": "turbo", "async_save": True}, "engine"),
        ({"dist_ckpt_workers": 0, "async_save": True}, "dist_ckpt_workers"),
    ]:
        with pytest.raises(dcpstore.InvalidArgument, match=rf"^CheckpointConfig\.{field}: "):
            CheckpointConfig(**kwargs)


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


#: Targets (backends.TARGETS) NVRx can write to: POSIX paths and MSC URLs.
NVRX_TARGETS = {"local", "local+msc", "msc", "s3+msc"}


@pytest.mark.filterwarnings("ignore::dcpstore.EngineFallbackWarning")
@pytest.mark.parametrize("engine", ["auto", "native", "nvrx"])
def test_engine_and_backend_are_accepted_exactly_where_they_work(target: Target, engine: str) -> None:
    """engine x backend: auto and native everywhere, NVRx on POSIX and MSC
    only. Accepted: an async save really works; refused: the config names
    ``engine`` and the writer and the manager refuse it too."""
    if engine == "nvrx" and not HAS_NVRX:
        pytest.skip("nvidia-resiliency-ext not installed")
    kwargs: dict[str, Any] = {"save": target.uri, "async_save": True, "engine": engine, "enable_msc": target.kwargs.get("enable_msc", False)}
    if engine != "nvrx" or target.name in NVRX_TARGETS:
        info = dcpstore.save({"w": torch.ones(2)}, f"{target.uri}/probe", async_=True, engine=engine, **target.kwargs).result()
        assert info.engine == ("nvrx" if engine == "nvrx" or (engine == "auto" and target.name in NVRX_TARGETS) else "native")
        CheckpointConfig(**kwargs).manager(storage_options=target.kwargs.get("storage_options")).close()
        return
    with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.engine: "):
        CheckpointConfig(**kwargs)
    with pytest.raises(dcpstore.InvalidArgument):
        dcpstore.save({"w": torch.ones(2)}, f"{target.uri}/probe", async_=True, engine=engine, **target.kwargs).result()
    with pytest.raises(dcpstore.InvalidArgument):
        dcpstore.CheckpointManager(target.uri, engine=engine, **target.kwargs)
