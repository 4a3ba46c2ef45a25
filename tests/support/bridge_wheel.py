"""Megatron-Bridge 0.6.2's own code, read from its wheel.

Bridge cannot be imported on a CPU-only machine (its package imports
CUDA-only ones at the top), yet what the tests need of it is plain Python:
how it names a step's directory from the configured root, how it builds and
picks its checkpoint manager, when ``setup()`` resumes, how its loop saves,
how its ``save_checkpoint`` builds an ``fsdp_dtensor`` state dict and how
``_load_checkpoint_from_path`` restores one. :func:`compile_from_wheel`
compiles exactly the named top-level functions and classes from the
wheel's source, unchanged, into a namespace that holds what they refer to,
so a test drives Bridge's own lines with the values a user types.

What that namespace cannot take from Bridge is stood in for, in one place
(:func:`checkpointing_module`'s "stand-ins"), each for a stated reason:
megatron-core's CUDA-bound parts (the CUDA RNG and its tracker, the rerun
state machine, the microbatch calculator, the model's config, the
Megatron-FSDP state-dict transforms, which change nothing for the tests'
models: no FP8, SwiGLU, GDN or experts) and the loggers.

``scripts/setup.sh`` downloads the Bridge and megatron-core wheels into
``.cache/wheels`` (``pip download``, no install: megatron-core supplies
the allowlist Bridge checks manager classes against). Without them the
tests that need them skip, and under ``CI=true`` fail: CI runs setup.sh.
"""

from __future__ import annotations
import __future__

import ast
import os
import types
import zipfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.extras import CI

WHEEL = "megatron_bridge-0.6.2-py3-none-any.whl"
MCORE_WHEEL = "megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
WHEELS = Path(__file__).resolve().parents[2] / ".cache" / "wheels"
CHECKPOINT_UTILS = "megatron/bridge/training/utils/checkpoint_utils.py"
CHECKPOINTING = "megatron/bridge/training/checkpointing.py"
BRIDGE_MODULE = "megatron.bridge.training.checkpointing"


def wheel(name: str = WHEEL) -> Path:
    """A wheel's path (skips, or under CI fails, when setup.sh did not fetch it)."""
    path = WHEELS / name
    if not path.is_file():
        why = f"{path} is missing: scripts/setup.sh downloads it"
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    return path


def compile_from_wheel(
    member: str, names: Sequence[str], namespace: dict[str, Any], whl: str = WHEEL
) -> SimpleNamespace:
    """The top-level functions and classes ``names`` of the wheel's
    ``member``, compiled from its source as they are (decorators included),
    with ``namespace`` as their globals."""
    with zipfile.ZipFile(wheel(whl)) as archive:
        source = archive.read(member).decode()
    tree = ast.parse(source, filename=member)
    found = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    missing = [n for n in names if n not in found]
    assert not missing, f"{whl}:{member} has no {missing}: not the release these tests read"
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    # Annotations stay unevaluated (they name megatron-core's classes).
    code = compile(module, f"{whl}/{member}", "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 -- NVIDIA's own released code
    return SimpleNamespace(**{n: namespace[n] for n in names})


def constants_from_wheel(member: str, names: Sequence[str], namespace: dict[str, Any], whl: str = WHEEL) -> None:
    """Module-level assignments ``names`` of the wheel's ``member``, evaluated into ``namespace``."""
    with zipfile.ZipFile(wheel(whl)) as archive:
        tree = ast.parse(archive.read(member).decode(), filename=member)
    body = [
        node
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(t, ast.Name) and t.id in names
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    exec(compile(ast.Module(body=body, type_ignores=[]), f"{whl}/{member}", "exec"), namespace)  # noqa: S102
    missing = [n for n in names if n not in namespace]
    assert not missing, f"{whl}:{member} has no {missing}"


class MultiStorageClientFeature:
    """megatron-core's process-global ``--enable-msc`` switch (its
    ``megatron.core.msc_utils`` class, pure Python, restated): off, what a
    Bridge run gets unless it passes ``--enable-msc`` (:func:`enable_msc`)."""

    enabled = False

    @classmethod
    def is_enabled(cls) -> bool:
        return cls.enabled

    @staticmethod
    def import_package() -> Any:
        import multistorageclient

        return multistorageclient


def enable_msc() -> None:
    """Megatron's ``--enable-msc`` in this process: Bridge's functions and
    dcpstore (which asks ``megatron.core.msc_utils``) both see it."""
    import sys

    MultiStorageClientFeature.enabled = True
    sys.modules["megatron.core.msc_utils"] = types.SimpleNamespace(MultiStorageClientFeature=MultiStorageClientFeature)  # type: ignore[assignment]


def checkpoint_utils() -> SimpleNamespace:
    """Bridge's path functions for a step, as its save and load call them."""
    namespace: dict[str, Any] = {
        "os": os,
        "Path": Path,
        "Optional": Any,
        "MultiStorageClientFeature": MultiStorageClientFeature,
        "TRAIN_STATE_FILE": "train_state.pt",
        "CONFIG_FILE": "run_config.yaml",
    }
    names = [
        "join_paths",
        "get_checkpoint_name",
        "get_checkpoint_train_state_filename",
        "get_checkpoint_tracker_filename",
    ]
    return compile_from_wheel(CHECKPOINT_UTILS, names, namespace)


# -- Bridge's checkpointing module, compiled --------------------------------------

#: What of Bridge 0.6.2 runs as Bridge wrote it, per source file.
FROM_BRIDGE = {
    "megatron/bridge/training/state.py": ["TrainState"],
    CHECKPOINT_UTILS: [
        "file_exists",
        "join_paths",
        "get_checkpoint_name",
        "get_checkpoint_train_state_filename",
        "get_checkpoint_run_config_filename",
        "get_checkpoint_tracker_filename",
        "_has_hf_weight_files",
        "is_hf_checkpoint_dir",
        "is_checkpoint_iteration_directory",
        "checkpoint_exists",
        "read_run_config",
        "read_train_state",
        "_sanitize_run_config_object",
    ],
    CHECKPOINTING: [
        "CheckpointType",
        "CheckpointSaveContext",
        "CheckpointLoadContext",
        "CheckpointManager",
        "create_checkpoint_manager",
        "get_rng_state",
        "generate_state_dict",
        "_generate_model_state_dict",
        "preprocess_fsdp_dtensor_state_dict",
        "_build_sharded_state_dict_metadata",
        "set_checkpoint_version",
        "get_checkpoint_version",
        "_get_train_state_from_state_dict",
        "_load_model_state_dict",
        "_get_model_glu_interleave_sizes",
        "_load_checkpoint_from_path",
        "_load_base_checkpoint",
        "load_fsdp_dtensor_checkpoint",
        "_resolve_checkpoint_iteration",
        "_get_checkpoint_format",
        "_record_dataloader_state_dir",
        "_has_global_non_persistent_checkpoint",
        "_get_global_non_persistent_checkpoint_dirs",
        "read_metadata",
        "_get_non_persistent_iteration",
    ],
    "megatron/bridge/utils/instantiate_utils.py": [
        "_as_module_prefix",
        "_seed_allowlist",
        "register_allowed_target_prefix",
        "_validate_target_prefix",
    ],
    "megatron/bridge/training/setup.py": ["_should_load_checkpoint"],
    "megatron/bridge/training/train.py": ["should_disable_forward_pre_hook", "save_checkpoint_and_time"],
}
CONSTANTS = {
    CHECKPOINT_UTILS: [
        "TRAIN_STATE_FILE",
        "TRACKER_PREFIX",
        "CONFIG_FILE",
        "_RUNTIME_ONLY_TARGETS",
        "_RECIPE_CONFIG_TARGET",
        "_ITERATION_DIR_MARKERS",
        "_HF_KNOWN_WEIGHT_FILES",
        "_HF_WEIGHT_GLOB_PATTERNS",
    ],
    CHECKPOINTING: [
        "_CHECKPOINT_VERSION",
        "_NON_PERSISTENT_CKPT_SUBDIR",
        "_DIRECT_ITERATION_DIR_SENTINEL",
        "DATALOADER_STATE_SUBDIR",
    ],
    "megatron/bridge/utils/instantiate_utils.py": [
        "_ALLOWED_TARGET_PREFIXES",
        "_TARGET_ALLOWLIST_MUTATORS",
        "_ALLOWED_PRIVATE_TARGETS",
        "_DISALLOWED_TARGETS",
        "_DISALLOWED_CALLABLE_FIELD_NAMES",
    ],
}
#: megatron-core's target allowlist, which Bridge's checks consult.
MCORE_INSTANTIATE = "megatron/training/config/instantiate_utils.py"


class Group:
    """A process group's rank and size, as megatron-core's groups answer them."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class RngTracker:
    """megatron-core's CUDA RNG tracker (CUDA-bound): named states, kept on CPU."""

    def __init__(self) -> None:
        self.states = {"model-parallel-rng": torch.zeros(8, dtype=torch.uint8)}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


class TorchOnCpu(types.ModuleType):
    """``torch`` as Bridge's functions see it: all of torch, but ``torch.cuda``'s
    RNG and cache calls, which a CPU-only build refuses, act on nothing, and a
    tensor made ``device="cuda"`` (a one-int all-reduce) is made on the CPU."""

    cuda = SimpleNamespace(
        get_rng_state=lambda: torch.zeros(1, dtype=torch.uint8),
        set_rng_state=lambda state: None,
        empty_cache=lambda: None,
    )

    @staticmethod
    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, *args, device="cpu" if device == "cuda" else device, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _stand_ins(namespace: dict[str, Any]) -> None:
    """Names Bridge's functions use whose real ones need CUDA or megatron-core's
    GPU stack, or only log (see the module docstring)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def rank() -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def world() -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    tracker = RngTracker()
    nothing = lambda *args, **kwargs: None  # noqa: E731
    namespace.update(
        print_rank_0=lambda message: None,
        print_diff_in_state_dicts=nothing,
        get_rank_safe=rank,
        get_world_size_safe=world,
        is_last_rank=lambda: rank() == world() - 1,
        unwrap_model=lambda model: model,
        get_pg_collection=lambda model: SimpleNamespace(
            tp=Group(0, 1), pp=Group(0, 1), ep=Group(0, 1), dp=Group(rank(), world()), dp_cp=Group(rank(), world())
        ),
        get_pg_size=lambda group: group.size(),
        tensor_parallel=SimpleNamespace(
            get_cuda_rng_tracker=lambda: tracker,
            is_graph_safe_cuda_rng_tracker=lambda t: False,
            convert_cuda_rng_state=lambda state, to_graphable: state,
        ),
        # megatron-core's rerun state machine is off unless configured: no state to save.
        get_rerun_state_machine=lambda: SimpleNamespace(state_dict=lambda **kw: None, load_state_dict=nothing),
        update_num_microbatches=nothing,
        # Megatron-FSDP's state-dict transforms: the tests' models have no FP8 extra state, SwiGLU,
        # GDN or experts, and evenly sharded DTensors.
        HAVE_MEGATRON_FSDP=True,
        MegatronFSDP=type("MegatronFSDP", (), {}),
        handle_fp8_extra_state_case=nothing,
        preprocess_state_dict_for_uneven_dtensor=nothing,
        handle_swiglu_in_state_dict=None,
        handle_gdn_in_state_dict=None,
        handle_experts_in_state_dict=None,
        LayerWiseDistributedOptimizer=type("LayerWiseDistributedOptimizer", (), {}),
        apply_run_config_backward_compat=lambda config: config,
        dist_checkpointing=SimpleNamespace(
            check_is_distributed_checkpoint=lambda path: os.path.exists(os.path.join(path, "metadata.json"))
        ),
        # megatron-core's reader without MSC (BridgeCheckpointManager puts its own in for its loads).
        _get_filesystem_reader=lambda path, cache_metadata=False, async_strategy="mcore": dcp.FileSystemReader(path),
        wandb_utils=SimpleNamespace(on_load_checkpoint_success=nothing, on_save_checkpoint_success=nothing),
        mlflow_utils=SimpleNamespace(on_load_checkpoint_success=nothing, on_save_checkpoint_success=nothing),
        comet_utils=SimpleNamespace(on_load_checkpoint_success=nothing, on_save_checkpoint_success=nothing),
        fault_tolerance=SimpleNamespace(on_checkpoint_loaded=nothing),
        compute_throughputs_and_append_to_progress_log=nothing,
        force_param_sync=nothing,
    )


def checkpointing_module() -> types.ModuleType:
    """Bridge 0.6.2's ``megatron.bridge.training.checkpointing``, as far as
    :class:`~dcpstore.adapters.megatron.BridgeCheckpointManager` and the code
    that calls it reach, registered in ``sys.modules`` (with the one
    megatron-core function Bridge imports at call time, ``get_model_config``).
    Bridge's setup and loop functions (``_should_load_checkpoint``,
    ``save_checkpoint_and_time``) and its allowlist are attributes too."""
    import dataclasses
    import enum
    import functools
    import gc
    import logging
    import random
    import sys
    import typing

    import numpy as np
    import yaml
    from torch.distributed.checkpoint.stateful import Stateful

    module = types.ModuleType(BRIDGE_MODULE)
    # Dataclasses look their module up while they compile, and pickle imports
    # it (with its parents) to find a class by name.
    for parent in ("megatron", "megatron.bridge", "megatron.bridge.training"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    sys.modules[BRIDGE_MODULE] = module
    namespace = module.__dict__  # the compiled functions' globals, as a real module's are
    namespace.update(
        os=os,
        sys=sys,
        gc=gc,
        random=random,
        np=np,
        yaml=yaml,
        torch=TorchOnCpu("torch"),
        F=torch.nn.functional,
        Path=Path,
        dataclass=dataclasses.dataclass,
        field=dataclasses.field,
        Enum=enum.Enum,
        auto=enum.auto,
        Any=Any,
        Optional=typing.Optional,
        Union=typing.Union,
        Protocol=typing.Protocol,
        runtime_checkable=typing.runtime_checkable,
        lru_cache=functools.lru_cache,
        logger=logging.getLogger(BRIDGE_MODULE),
        Stateful=Stateful,
        MultiStorageClientFeature=MultiStorageClientFeature,
    )
    _stand_ins(namespace)
    compile_from_wheel(MCORE_INSTANTIATE, ["InstantiationException", "TargetAllowlist"], namespace, MCORE_WHEEL)
    constants_from_wheel(
        MCORE_INSTANTIATE, ["_DEFAULT_ALLOWED_PREFIXES", "_DEFAULT_ALLOWED_EXACT"], namespace, MCORE_WHEEL
    )
    namespace["target_allowlist"] = namespace["TargetAllowlist"]()
    for member, names in CONSTANTS.items():
        constants_from_wheel(member, names, namespace)
    for member, names in FROM_BRIDGE.items():
        compile_from_wheel(member, names, namespace)
    namespace["_seed_allowlist"]()  # as Bridge's instantiate_utils does on import
    sys.modules["megatron.core.utils"] = types.SimpleNamespace(get_model_config=lambda model: model.config)  # type: ignore[assignment]
    return module
