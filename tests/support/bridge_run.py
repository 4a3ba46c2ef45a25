"""A Megatron-Bridge 0.6.2 training run on CPU gloo ranks whose checkpoint
config names dcpstore's manager, as a user's would::

    checkpoint.custom_manager_class = "dcpstore.adapters.megatron.BridgeCheckpointManager"
    checkpoint.ckpt_format = "fsdp_dtensor"; checkpoint.save = checkpoint.load = "s3://bucket/run"

Bridge's own code runs the checkpointing (compiled from its wheel,
tests/support/bridge_wheel.py): ``create_checkpoint_manager`` builds the manager
(after ``register_allowed_target_prefix("dcpstore")``, the one call Bridge's
allowlist demands), ``setup()``'s ``_should_load_checkpoint`` decides
whether to resume and its ``load()`` call follows, the loop saves through
``save_checkpoint_and_time`` and finalizes every step
(``finalize_async_saves(blocking=False)``, then ``blocking=True,
terminate=True`` at the end), and the manager builds and restores state
with ``generate_state_dict``, ``get_rng_state`` and
``_load_checkpoint_from_path``. The call sites inside ``setup()`` and
``train()`` are replayed line for line (:func:`train`, with their line
numbers).

Megatron's model and optimizer need CUDA; their checkpoint surface stands
in: a small FSDP2 module (DTensor parameters, as Megatron-FSDP's) with
``state_dict_for_save_checkpoint``, an AdamW behind
``MegatronOptimizer``'s ``sharded_state_dict`` / ``load_state_dict``, and
an ``OptimizerParamScheduler``-like schedule. The batches come from the
global torch RNG, so a resume is exact only if Bridge's RNG state is saved
and restored too.
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcpstore
from dcpstore.adapters.megatron import BridgeCheckpointManager
from tests.support.bridge_wheel import checkpointing_module, enable_msc

MANAGER = "dcpstore.adapters.megatron.BridgeCheckpointManager"
#: A user's subclass that picks dcpstore's engine (Bridge's config has no field for it).
PROCESS_MANAGER = "tests.support.bridge_run.ProcessEngineManager"


class ProcessEngineManager(BridgeCheckpointManager):
    options = dcpstore.SaveOptions(engine="process")


class Model(nn.Module):
    """The part of a Megatron model Bridge's checkpointing touches."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.decoder = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
        #: megatron-core's ``get_model_config(model)``: no GLU interleaving, SwiGLU or experts.
        self.config = SimpleNamespace(gated_linear_unit=False, num_moe_experts=None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.embedding(tokens)).clone()  # not a view: FSDP2 hooks the output

    def state_dict_for_save_checkpoint(self) -> dict[str, Any]:
        return self.state_dict()


class Optimizer:
    """``MegatronOptimizer``'s ``fsdp_dtensor`` surface over AdamW."""

    is_stub_optimizer = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def sharded_state_dict(
        self, model_state_dict: Any, metadata: Any = None, is_loading: bool = False
    ) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optim, state_dict)


class Scheduler:
    """``OptimizerParamScheduler``'s checkpoint surface."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.lr = 1e-2

    def step(self) -> None:
        self.num_steps += 1
        self.lr = 1e-2 * 0.9**self.num_steps

    def state_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "max_lr": 1e-2, "lr": self.lr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_steps, self.lr = state["num_steps"], state["lr"]


class Config(SimpleNamespace):
    """The ``ConfigContainer`` fields Bridge's checkpointing reads."""

    def to_yaml(self, yaml_path: str) -> None:
        with open(yaml_path, "w") as f:
            yaml.safe_dump({"model": vars(self.model), "checkpoint": dict(vars(self.checkpoint))}, f)


def bridge_config(**checkpoint: Any) -> Config:
    """A run's config: ``checkpoint`` fields as a user sets them, over
    Bridge 0.6.2's (and megatron-core 0.19.2's) defaults for the rest."""
    fields = dict(
        save=None,
        load=None,
        pretrained_checkpoint=None,
        save_interval=2,
        ckpt_format="fsdp_dtensor",
        async_save=False,
        most_recent_k=-1,
        ckpt_step=None,
        finetune=False,
        load_optim=True,
        load_rng=True,
        save_optim=True,
        save_rng=True,
        dist_ckpt_workers=1,
        ckpt_assume_constant_structure=False,
        non_persistent_save_interval=None,
        non_persistent_ckpt_type=None,
        non_persistent_global_ckpt_dir=None,
        also_save_hf_checkpoint=False,
        strict_fsdp_dtensor_load=False,
        custom_manager_class=MANAGER,
    )
    fields.update(checkpoint)
    return Config(
        checkpoint=SimpleNamespace(**fields),
        rng=SimpleNamespace(data_parallel_random_init=False),
        optimizer=SimpleNamespace(use_distributed_optimizer=True),
        model=SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, fp16=False, bf16=False),
        ddp=SimpleNamespace(use_megatron_fsdp=True, overlap_param_gather=False),
        dist=SimpleNamespace(use_torch_fsdp2=False),
        logger=SimpleNamespace(log_progress=False),
        peft=None,
        dataset=None,
        _checkpoint_load_required=False,  # pretrain(); finetune() sets it
    )


class Timers:
    """``state.timers``: Bridge's loop starts and stops them."""

    def __call__(self, name: str, log_level: int = 0) -> Any:
        return SimpleNamespace(start=lambda barrier=False: None, stop=lambda barrier=False: None)

    def log(self, names: Any) -> None:
        pass


def full_state(model: nn.Module, optimizer: Optimizer, scheduler: Scheduler, train_state: Any) -> dict[str, Any]:
    """Everything a resume must restore, gathered whole (every rank calls it)."""
    full = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {
        "model": get_model_state_dict(model, options=full),
        "optimizer": get_optimizer_state_dict(model, optimizer.optim, options=full),
        "scheduler": scheduler.state_dict(),
        "train_state": {k: v.item() for k, v in train_state.state_dict().items()},
        "rng": torch.get_rng_state(),
    }


def train(rank: int, world: int, cfg: Config, until: int, report: str, how: dict[str, Any] | None = None) -> None:
    """Bridge's ``setup()`` and ``train()`` as far as checkpointing goes,
    to iteration ``until``; each rank writes ``report/rank{r}.pt``: its
    :func:`full_state` at the end, the iteration it resumed from and the
    full model right after the load, and the full model at every save.

    ``how``: ``kill_at``: SIGKILL rank 1 when the save of that iteration
    writes its first data file; ``enable_msc``: Megatron's ``--enable-msc``;
    ``bridge_load``: resume with Bridge's own
    ``_load_checkpoint_from_path(checkpoint.load)`` and megatron-core's
    stock reader, as a run without dcpstore's manager does."""
    how = how or {}
    if how.get("enable_msc"):
        enable_msc()
    bridge = checkpointing_module()
    bridge.register_allowed_target_prefix("dcpstore")  # the launch script's one line
    bridge.register_allowed_target_prefix("tests.support.bridge_run")  # where ProcessEngineManager lives
    if how.get("kill_at") is not None and rank == 1:
        _die_in_save(how["kill_at"])
    torch.manual_seed(1234)
    mesh = init_device_mesh("cpu", (world,))
    model = Model()
    fully_shard(model, mesh=mesh)
    optimizer, scheduler = Optimizer(model), Scheduler()
    state = SimpleNamespace(
        cfg=cfg,
        train_state=bridge.TrainState(),
        timers=Timers(),
        energy_monitor=None,
        wandb_logger=None,
        mlflow_logger=None,
        comet_logger=None,
    )

    # setup.py:289, 397-415
    manager = bridge.create_checkpoint_manager(cfg.checkpoint)
    resumed, loaded = None, None
    if how.get("bridge_load"):
        bridge._load_checkpoint_from_path(
            cfg.checkpoint.load, state, [model], optimizer, scheduler, checkpointing_context={}
        )
        resumed, loaded = state.train_state.step, get_model_state_dict(model, options=FULL)
    elif bridge._should_load_checkpoint(cfg, manager):
        manager.load(
            bridge.CheckpointLoadContext(
                state=state,
                model=[model],
                optimizer=optimizer,
                opt_param_scheduler=scheduler,
                skip_load_to_model_and_opt=cfg.dist.use_torch_fsdp2,
            )
        )
        resumed, loaded = state.train_state.step, get_model_state_dict(model, options=FULL)
    saved: dict[int, dict[str, Any]] = {}
    # train.py: the loop, its save (1269, save_checkpoint_and_time) and its finalize (389, 782)
    for step in range(state.train_state.step + 1, until + 1):
        tokens = torch.randint(0, 16, (4, 6))
        loss = model(tokens).pow(2).mean()
        loss.backward()
        for group in optimizer.optim.param_groups:
            group["lr"] = scheduler.lr
        optimizer.optim.step()
        optimizer.optim.zero_grad()
        scheduler.step()
        state.train_state.step = step
        state.train_state.consumed_train_samples += 4 * world
        state.train_state.floating_point_operations_so_far += 1000
        if step % cfg.checkpoint.save_interval == 0:
            saved[step] = get_model_state_dict(model, options=FULL)
            flops = state.train_state.floating_point_operations_so_far
            bridge.save_checkpoint_and_time(state, [model], optimizer, scheduler, flops, manager)
        manager.finalize_async_saves(state=state, blocking=False)
    manager.finalize_async_saves(state=state, blocking=True, terminate=True)
    engines = [(s.step, s.info.engine, s.info.backend) for s in manager.history]
    out = {
        "final": full_state(model, optimizer, scheduler, state.train_state),
        "resumed": resumed,
        "loaded": loaded,
        "saved": saved,
        "engines": engines,
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    Path(report, f"rank{rank}.pt").write_bytes(buf.getvalue())
    dist.barrier()


FULL = StateDictOptions(full_state_dict=True)


def _die_in_save(step: int) -> None:
    """SIGKILL this rank when the save of ``step`` makes its first data file
    durable: its bytes are written, its commit not (every engine fsyncs a
    rank's data files before the coordinator commits)."""
    step_dir = f"{os.sep}iter_{step:07d}{os.sep}"
    real = os.fsync

    def fsync(fd: Any) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
        if step_dir in path and ".distcp" in path:
            os.kill(os.getpid(), signal.SIGKILL)
        real(fd)

    os.fsync = fsync


def read_report(report: Path, rank: int = 0) -> dict[str, Any]:
    return torch.load(report / f"rank{rank}.pt", weights_only=False)
