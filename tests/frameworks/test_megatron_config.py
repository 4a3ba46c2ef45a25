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

import importlib.util
import inspect
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcpstore
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.engines import nvrx as nvrx_adapter
from dcpstore._impl.engines.selection import auto_engine
from dcpstore.adapters import fsdp
from dcpstore.adapters.megatron import (
    BRIDGE_FIELDS,
    DCPSTORE_FIELDS,
    CheckpointConfig,
    megatron_msc_enabled,
    plan_caching_supported,
)
from tests.support import extras
from tests.support.backends import Target
from tests.support.dist_utils import run_ranks

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

    def config() -> CheckpointConfig:
        options = dcpstore.SaveOptions(engine=engine)  # the engine is the options'
        return CheckpointConfig(
            save=str(tmp_path / "run"),
            ckpt_format=fmt,
            async_save=async_save,
            dist_ckpt_workers=workers,
            options=options,
        )

    if engine == "nvrx" and not HAS_NVRX and not bad:
        pytest.skip("nvidia-resiliency-ext not installed")
    if not bad:
        # The writer path: a plain save of the format's state with these arguments.
        uri = str(tmp_path / "plain")
        dcpstore.save(
            fsdp.get_app_state(_linear(1), None, format=fmt), uri, async_=async_save, engine=engine, workers=workers
        ).result()
        # The config path: its manager, its format; both load back exactly.
        cfg = config()
        assert (cfg.async_save, cfg.options.engine, cfg.dist_ckpt_workers) == (async_save, engine, workers)
        assert cfg.options == dcpstore.SaveOptions(async_=async_save, engine=engine, workers=workers)
        with cfg.manager() as mgr:
            fsdp.save_app_state(_linear(1), None, mgr, step=1, format=cfg.ckpt_format)
        assert mgr.all_steps() == [1]
        for src in (uri, mgr):
            model = _linear(2)
            fsdp.load_app_state(model, None, src, format=fmt)
            assert torch.equal(model.weight, _linear(1).weight) and torch.equal(model.bias, _linear(1).bias)
        return
    with pytest.raises(dcpstore.InvalidArgument) as info:
        config()
    message = str(info.value)
    # The config names its field; the options name theirs ("engine must be one of ...").
    field = (
        message.split(":", 1)[0].removeprefix("CheckpointConfig.")
        if message.startswith("CheckpointConfig.")
        else message.split(" ", 1)[0]
    )
    assert field in bad, f"named {field!r}, expected one of {sorted(bad)}: {info.value}"
    # The writer refuses it too, as a bad argument (never "not implemented").
    with pytest.raises(dcpstore.InvalidArgument):
        state = fsdp.get_app_state(_linear(1), None, format=fmt)
        dcpstore.save(state, str(tmp_path / "probe"), async_=async_save, engine=engine, workers=workers).result()


def test_every_field_at_fault_is_refused_on_its_own() -> None:
    """Each refusal names its own field when it is the only fault."""
    for kwargs, field in [
        ({"ckpt_format": "zarr"}, "ckpt_format"),
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
        ({"ckpt_step": -1}, "ckpt_step"),
        ({"save": "foo://bucket/run"}, "save"),
        ({"load": "s3:///no-bucket"}, "load"),
        ({"save": 42}, "save"),
    ],
)
def test_bad_fields_are_named(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match=rf"^CheckpointConfig\.{field}: "):
        CheckpointConfig(**kwargs)


def test_the_engine_and_msc_are_the_options_fields() -> None:
    """Bridge has no engine and no MSC field (MSC is Megatron's --enable-msc):
    they are the options', and the config takes no field of that name."""
    with pytest.raises(TypeError, match="engine"):
        CheckpointConfig(engine="native")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="enable_msc"):
        CheckpointConfig(enable_msc=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'engine': pass options=dcpstore\.SaveOptions\(engine=\.\.\.\)"):
        CheckpointConfig.from_bridge({}, engine="native")  # type: ignore[call-arg]
    with pytest.raises(
        TypeError,
        match=r"'enable_msc': pass options=dcpstore\.SaveOptions\(storage_options=dcpstore\.StorageOptions\(enable_msc=\.\.\.\)\)",
    ):
        CheckpointConfig.from_bridge({}, enable_msc=True)  # type: ignore[call-arg]


def test_mapping_onto_the_manager(tmp_path: Path) -> None:
    cfg = CheckpointConfig(
        save=str(tmp_path / "run"),
        load=str(tmp_path / "run"),
        save_interval=2,
        most_recent_k=2,
        ckpt_format="fsdp_dtensor",
    )
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


@pytest.mark.filterwarnings("ignore::dcpstore.EngineFallbackWarning")
@pytest.mark.parametrize("async_save, engine", [(False, "auto"), (True, "native"), (True, "nvrx")])
def test_constant_structure_is_accepted_and_every_save_is_exact(tmp_path: Path, async_save: bool, engine: str) -> None:
    """Bridge's ``ckpt_assume_constant_structure=True`` is accepted (it was
    refused) on every engine, and saves stay exact; DCP's own plan cache
    stays refused by ``dcpstore.save`` for as long as the native writer
    cannot replay it."""
    if engine == "nvrx" and not HAS_NVRX:
        pytest.skip("nvidia-resiliency-ext not installed")
    assert plan_caching_supported() == _writer_replays_cached_plans(tmp_path)
    if not plan_caching_supported():
        with pytest.raises(dcpstore.InvalidArgument, match="plan caching"):
            dcpstore.save({"w": torch.ones(2)}, str(tmp_path / "x"), planner=_CachingPlanner())
    cfg = CheckpointConfig(
        save=str(tmp_path / "run"),
        async_save=async_save,
        options=dcpstore.SaveOptions(engine=engine),
        ckpt_assume_constant_structure=True,
    )
    mgr = cfg.manager()
    for step in (1, 2, 3):
        mgr.save({"w": torch.full((8,), float(step)), "b": torch.arange(step + 0.0, step + 3)}, step)
    for step in (1, 2, 3):
        out = {"w": torch.zeros(8), "b": torch.zeros(3)}
        mgr.load(out, step)
        assert torch.equal(out["w"], torch.full((8,), float(step))) and torch.equal(
            out["b"], torch.arange(step + 0.0, step + 3)
        )
    mgr.close()


#: Megatron-Bridge 0.6.2's ``CheckpointConfig`` field names: its own and those
#: it inherits from megatron-core 0.19.2's ``megatron.training`` one (read
#: from the two wheels; neither imports without CUDA).
BRIDGE_062_FIELDS = frozenset(
    """also_save_hf_checkpoint async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm async_save
    async_strategy async_write_results_mp_mode auto_detect_ckpt_format ckpt_assume_constant_structure
    ckpt_convert_format ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format ckpt_format
    ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_process_group
    ckpt_fully_parallel_save_process_group ckpt_load_validate_sharding_integrity ckpt_step custom_manager_class
    dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014 dist_ckpt_strictness dist_ckpt_workers
    distrib_optim_fully_reshardable_mem_efficient exit_on_missing_checkpoint finetune fully_parallel_load
    fully_parallel_save hf_distributed_save hf_save_every_n_ranks hf_source_path hf_trust_remote_code load
    load_main_params_from_ckpt load_optim load_rng most_recent_k non_persistent_ckpt_type
    non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo non_persistent_local_ckpt_dir
    non_persistent_save_interval pretrained_checkpoint replication replication_factor replication_jump save
    save_activations_interval save_dgrads_interval save_interval save_optim save_params_interval
    save_retain_interval save_rng save_tokenizer_assets save_tokens_per_expert_interval save_wgrads_interval
    storage_writers_per_rank stream_ckpt_dequant strict_fsdp_dtensor_load use_checkpoint_args
    use_mp_args_from_checkpoint_args use_persistent_ckpt_worker use_tokenizer_model_from_checkpoint_args
    verify_integrity""".split()
)


def test_fields_are_bridges_under_its_names_or_dcpstores_own() -> None:
    assert set(BRIDGE_FIELDS) <= BRIDGE_062_FIELDS
    assert not set(DCPSTORE_FIELDS) & BRIDGE_062_FIELDS
    assert set(CheckpointConfig.field_names()) == set(BRIDGE_FIELDS) | set(DCPSTORE_FIELDS)


def _bridge_cfg(**values: Any) -> SimpleNamespace:
    """A Bridge 0.6.2 ``CheckpointConfig`` as an object with its attributes:
    Bridge's defaults for the fields dcpstore reads, every other field set
    (to a value dcpstore must ignore)."""
    defaults = dict(
        save=None,
        load=None,
        save_interval=None,
        async_save=False,
        ckpt_format="torch_dist",
        dist_ckpt_workers=1,
        most_recent_k=-1,
        ckpt_assume_constant_structure=False,
        ckpt_step=None,
    )
    others = {name: object() for name in BRIDGE_062_FIELDS - defaults.keys()}
    return SimpleNamespace(**{**others, **defaults, **values})


def test_from_bridge_reads_bridges_fields_and_keeps_bridges_layout(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    bridge = _bridge_cfg(
        save=root,
        load=root,
        async_save=True,
        ckpt_format="fsdp_dtensor",
        dist_ckpt_workers=2,
        most_recent_k=2,
        ckpt_assume_constant_structure=True,
        save_interval=10,
    )
    native = dcpstore.SaveOptions(engine="native")
    cfg = CheckpointConfig.from_bridge(bridge, options=native)
    assert {name: getattr(cfg, name) for name in BRIDGE_FIELDS} == {
        name: getattr(bridge, name) for name in BRIDGE_FIELDS
    }
    assert (cfg.layout, cfg.options.engine) == ("bridge", "native")
    # MSC is Megatron's process-global --enable-msc (off where megatron-core is absent).
    assert cfg.options.enable_msc is megatron_msc_enabled()
    if importlib.util.find_spec("megatron") is None:
        assert cfg.options.enable_msc is False
    assert CheckpointConfig.from_bridge(vars(bridge), options=native) == cfg  # a mapping of the fields works too
    assert CheckpointConfig.from_bridge(_bridge_cfg(most_recent_k=None)).keep is None  # megatron-core's "keep all"
    with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.ckpt_format: "):
        CheckpointConfig.from_bridge(_bridge_cfg(ckpt_format="torch"))
    with cfg.manager() as mgr:
        for step in (10, 20, 30):
            mgr.save({"w": torch.full((4,), float(step))}, step)
    assert sorted(p.name for p in Path(root).iterdir()) == [
        "iter_0000020",
        "iter_0000030",
        "latest_checkpointed_iteration.txt",
    ]
    assert (Path(root) / "latest_checkpointed_iteration.txt").read_text() == "30"
    loader = CheckpointConfig.from_bridge(_bridge_cfg(load=root, ckpt_step=20)).load_manager()
    assert loader is not None
    out = {"w": torch.zeros(4)}
    assert loader.load(out, step=20) == 20 and torch.equal(out["w"], torch.full((4,), 20.0))
    loader.close()
    with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.layout: "):
        CheckpointConfig(layout="megatron")


def _ckpt_step_job(rank: int, world: int, root: str) -> None:
    """Steps 20, 40, 60 saved in Bridge's layout; then what ``ckpt_step``
    resumes, on every rank (``rank``, ``world``: run_ranks' arguments, or
    0 and 1 in-process)."""
    with CheckpointConfig.from_bridge(_bridge_cfg(save=root)).manager() as mgr:
        for step in (20, 40, 60):
            mgr.save({"w": torch.full((4,), float(step))}, step)
    if rank == 0:  # a step directory that holds data but was never committed
        (Path(root) / "iter_0000050").mkdir()
        (Path(root) / "iter_0000050" / "__0_0.distcp").write_bytes(b"half a save")
    if world > 1:
        torch.distributed.barrier()
    for ckpt_step, want in ((40, 40), (20, 20), (None, 60)):
        loader = CheckpointConfig.from_bridge(_bridge_cfg(load=root, ckpt_step=ckpt_step)).load_manager()
        assert loader is not None
        out = {"w": torch.zeros(4)}
        assert loader.resolve_step() == want
        assert loader.load(out) == want and torch.equal(out["w"], torch.full((4,), float(want))), (ckpt_step, out)
        assert loader.load(out, step=60) == 60 and out["w"][0] == 60.0  # a step passed to load still wins
        loader.close()
    for missing in (50, 80):  # uncommitted, absent: an error on every rank, never the newest step instead
        loader = CheckpointConfig.from_bridge(_bridge_cfg(load=root, ckpt_step=missing)).load_manager()
        assert loader is not None
        for call in (lambda: loader.load({"w": torch.zeros(4)}), loader.resolve_step):  # noqa: B023 (called here)
            with pytest.raises(dcpstore.CheckpointNotFound) as info:
                call()
            message = str(info.value)
            assert message.startswith(f"CheckpointConfig.ckpt_step={missing}: "), message
            assert f"{root}/iter_{missing:07d}" in message and "20, 40, 60" in message, message
            assert isinstance(info.value, FileNotFoundError)  # what Bridge raises for a missing ckpt_step
        loader.close()


def test_ckpt_step_is_the_step_load_manager_resumes(tmp_path: Path) -> None:
    """Bridge's ``ckpt_step``: the load manager resumes exactly that step
    (issue #38: it resumed the newest), and a step not committed there is a
    ``CheckpointNotFound`` naming ``ckpt_step`` and the URI."""
    _ckpt_step_job(0, 1, str(tmp_path / "run"))


def test_ckpt_step_is_resumed_on_every_rank(tmp_path: Path) -> None:
    """The same on 2 gloo ranks: rank 0 looks, every rank loads the step or raises."""
    run_ranks(_ckpt_step_job, 2, str(tmp_path / "run"), timeout=240)


@pytest.mark.parametrize("engine", ["auto", "native", "nvrx"])
def test_engine_and_backend_are_accepted_exactly_where_they_work(target: Target, engine: str) -> None:
    """engine x backend: auto (what it prefers there) and native everywhere, NVRx on POSIX and MSC
    only. Accepted: an async save really works; refused: the config names
    ``engine`` and the writer and the manager refuse it too."""
    if engine == "nvrx" and not HAS_NVRX:
        pytest.skip("nvidia-resiliency-ext not installed")
    kwargs: dict[str, Any] = {"save": target.uri, "async_save": True, "options": target.save_options(engine=engine)}
    if engine != "nvrx" or target.name in extras.NVRX_TARGETS:
        info = dcpstore.save(
            {"w": torch.ones(2)}, f"{target.uri}/probe", async_=True, engine=engine, **target.kwargs
        ).result()
        assert info.engine == (auto_engine(info.backend, info.uri).order[0] if engine == "auto" else engine)
        CheckpointConfig(**kwargs).manager().close()
        return
    with pytest.raises(dcpstore.InvalidArgument, match=r"^CheckpointConfig\.options\.engine: "):
        CheckpointConfig(**kwargs)
    with pytest.raises(dcpstore.InvalidArgument):
        dcpstore.save({"w": torch.ones(2)}, f"{target.uri}/probe", async_=True, engine=engine, **target.kwargs).result()
    with pytest.raises(dcpstore.InvalidArgument):
        dcpstore.CheckpointManager(target.uri, options=target.save_options(async_=True, engine=engine))
