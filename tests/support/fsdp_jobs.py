"""Rank functions for the multi-rank FSDP2 suites (run through dist_utils.run_ranks).

The model's row counts (10 and 3) shard unevenly on 2 and 4 ranks, and on 4
ranks one rank holds an empty shard of the 3-row tensors: the awkward cases.
Every check compares against a *reference*: the full (gathered) model and
optimizer state that rank 0 wrote with torch.save at save time.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcpstore
from dcpstore.adapters import fsdp


def build(seed: int, *, sharded: bool = True, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """The test model (FSDP2 over all ranks unless ``sharded=False``) and
    AdamW, on ``device`` ("cuda": the rank's current GPU)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 3)).to(device)
    if sharded:
        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = next(model.parameters()).device
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
        loss = model(torch.randn(4, 8, generator=g).to(device)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Gathered model + flattened optimizer state (rank 0 gets it all)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optim, options=opts)
    # Unsharded CPU models hand back their live tensors: snapshot them.
    snap = lambda sd: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}  # noqa: E731
    return {"model": snap(model_sd), "optimizer": snap(optim_sd)}


def assert_same(expected: dict[str, Any], actual: dict[str, Any], where: str) -> None:
    for section in ("model", "optimizer"):
        want, got = expected[section], actual[section]
        assert want.keys() == got.keys(), f"{where}: {section} keys differ: {set(want) ^ set(got)}"
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got[key]), f"{where}: {section}.{key} differs"
            else:  # torch's full-state path turns AdamW's betas tuple into a list
                norm = lambda v: list(v) if isinstance(v, tuple) else v
                assert norm(value) == norm(got[key]), f"{where}: {section}.{key}: {got[key]!r} != {value!r}"


def differs(expected: dict[str, Any], actual: dict[str, Any]) -> bool:
    return any(
        isinstance(v, torch.Tensor) and not torch.equal(v, actual["model"][k]) for k, v in expected["model"].items()
    )


def job_save(rank: int, world: int, root: str) -> None:
    """Train, then save in every format plus a rank-0 reference; reload on
    the same world size and check."""
    model, optim = build(0)
    train(model, optim, 3)
    ref = full_state(model, optim)
    if rank == 0:
        torch.save(ref, os.path.join(root, f"ref{world}.pt"))
    extra = {"step": 3, "note": f"saved on {world}"}
    fsdp.save_app_state(model, optim, f"{root}/dt{world}", extra=extra, workers=2).result()
    fsdp.save_app_state(model, optim, f"{root}/td{world}", format="torch_dist", extra=extra).result()
    fsdp.save_app_state(
        model, optim, f"{root}/full{world}", full_state_dict=True, cpu_offload=True, extra=extra
    ).result()
    # Same world size, fresh weights: the load must restore everything.
    fresh, fresh_optim = build(1)
    back: dict[str, Any] = {"step": 0, "note": ""}
    report = fsdp.load_app_state(fresh, fresh_optim, f"{root}/dt{world}", extra=back)
    assert report.ok, report.describe()
    assert back == extra, back
    if rank == 0:
        assert_same(ref, full_state(fresh, fresh_optim), f"dt{world} -> {world}")
    else:
        full_state(fresh, fresh_optim)  # collective


def _world_of(name: str) -> str:
    """The world size a checkpoint name ends with (``dt2``, ``td4``, ``full2``):
    its reference state is ``ref{world}.pt``."""
    return name[len(name.rstrip("0123456789")) :]


def job_load(rank: int, world: int, root: str, cases: list[tuple[str, str, bool]], resave: bool) -> None:
    """Load each (checkpoint, format, full_state_dict) into a fresh model on
    this world size and compare with the reference saved with it."""
    for name, fmt, full in cases:
        model, optim = build(1)
        before = full_state(model, optim)
        extra: dict[str, Any] = {"step": 0}
        report = fsdp.load_app_state(
            model, optim, f"{root}/{name}", format=fmt, full_state_dict=full, cpu_offload=full, extra=extra
        )
        after = full_state(model, optim)
        assert report.ok and extra["step"] == 3, (report.describe(), extra)
        if rank == 0:
            ref = torch.load(os.path.join(root, f"ref{_world_of(name)}.pt"), weights_only=False)
            assert differs(ref, before), "fresh model already equals the reference: the check would be vacuous"
            assert_same(ref, after, f"{name} -> {world} ranks ({fmt}, full={full})")
        train(model, optim, 1)  # the restored optimizer state is usable
    if resave:
        model, optim = build(0)
        train(model, optim, 3, seed=world)
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"ref{world}.pt"))
        fsdp.save_app_state(model, optim, f"{root}/td{world}", format="torch_dist", extra={"step": 3}).result()


def load_unsharded(root: str, name: str) -> None:
    """1 process, no torch.distributed: load a sharded checkpoint into a plain model."""
    model, optim = build(1, sharded=False)
    extra: dict[str, Any] = {"step": 0}
    report = fsdp.load_app_state(model, optim, f"{root}/{name}", extra=extra)
    assert report.ok and extra["step"] == 3, report.describe()
    ref = torch.load(os.path.join(root, f"ref{_world_of(name)}.pt"), weights_only=False)
    assert_same(ref, full_state(model, optim), f"{name} -> 1 process")


def job_manager(rank: int, world: int, root: str) -> None:
    """Manager on several ranks: saves through it, retention on rank 0 only,
    resume from the latest committed step."""
    model, optim = build(0)
    mgr = dcpstore.CheckpointManager(root, keep=2, async_=False)
    if rank != 0:  # only rank 0 may delete (retention) or write the pointer

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError(f"rank {rank} modified the root outside a save")

        mgr._roots.save_storage.delete = refuse  # type: ignore[method-assign]
        mgr._roots.committed = refuse  # type: ignore[method-assign]  # the pointer and retention
    for step in range(1, 5):
        train(model, optim, 1, seed=step)
        fsdp.save_app_state(model, optim, mgr, step=step, extra={"step": step})
        dist.barrier()
        assert mgr.all_steps() == list(range(max(1, step - 1), step + 1)), mgr.all_steps()
    ref = full_state(model, optim)
    mgr.close()
    fresh, fresh_optim = build(1)
    extra: dict[str, Any] = {"step": -1}
    with dcpstore.CheckpointManager(root, keep=2, async_=False) as again:
        report = fsdp.load_app_state(fresh, fresh_optim, again, extra=extra)
    assert report.step == 4 and extra["step"] == 4, (report, extra)
    got = full_state(fresh, fresh_optim)
    if rank == 0:
        assert_same(ref, got, "manager resume")


def job_save_to(rank: int, world: int, uri: str, kwargs: dict[str, Any], ref_path: str) -> None:
    """Save on ``world`` ranks to any backend target; rank 0 writes the reference."""
    model, optim = build(0)
    train(model, optim, 2)
    ref = full_state(model, optim)
    if rank == 0:
        torch.save(ref, ref_path)
    fsdp.save_app_state(model, optim, uri, extra={"step": 3}, **kwargs).result()


def load_unsharded_from(uri: str, kwargs: dict[str, Any], ref_path: str) -> None:
    model, optim = build(1, sharded=False)
    before = full_state(model, optim)
    extra: dict[str, Any] = {"step": 0}
    report = fsdp.load_app_state(model, optim, uri, extra=extra, **kwargs)
    assert report.ok and extra["step"] == 3, report.describe()
    ref = torch.load(ref_path, weights_only=False)
    assert differs(ref, before)
    assert_same(ref, full_state(model, optim), f"{uri} -> 1 process")
