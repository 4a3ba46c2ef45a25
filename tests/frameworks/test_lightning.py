"""Lightning 2.6's ``ModelParallelStrategy`` (FSDP2) sharded checkpoints on
dcpstore (:func:`dcpstore.adapters.lightning.install`), Fabric's and the
Trainer's, on 2 gloo ranks, on a local directory and on S3 (moto).

Fabric: ``fabric.save`` / ``fabric.load`` of model, optimizer and extra
state (``meta.pt``), every value compared with ``torch.equal`` against the
gathered state at save time; ``meta.pt`` is recorded in the commit; saving
over the checkpoint replaces the pair; stock Lightning loads what dcpstore
saved and the reverse (local: stock Lightning cannot write ``s3://``).
Trainer: ``ModelCheckpoint`` every 2 steps with ``save_top_k=1`` (its
rotation deletes through dcpstore), then ``fit(ckpt_path=...)`` resumes a
new model whose state at the start of training equals the saved one.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.extras import skip_module_unless  # noqa: E402

skip_module_unless("lightning")

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy as FabricStrategy
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy as TrainerStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import dcpstore
from dcpstore._impl.dcp.commit import read_checkpoint_metadata
from dcpstore.adapters import lightning as dl
from tests.support.backends import OBJECT_STORE_OPTIONS, make_target
from tests.support.dist_utils import run_ranks
from tests.support.fsdp_jobs import assert_same, full_state

BACKENDS = ["local", "s3"]


def _options(s3: bool) -> dict[str, Any]:
    return {"storage_options": OBJECT_STORE_OPTIONS} if s3 else {}


def _env(rank: int) -> None:
    """What a launcher sets: Lightning then joins the existing process group."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE="2")


def _shard(model: nn.Module, mesh: Any) -> nn.Module:
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 3))


class Extra:
    """Stateful extra state: goes to meta.pt."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _fabric(ours: bool, s3: bool) -> Fabric:
    strategy = FabricStrategy(parallelize_fn=_shard, data_parallel_size=2, tensor_parallel_size=1)
    if ours:
        dl.install(strategy, **_options(s3))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, seed: int) -> tuple[Any, Any]:
    model = fabric.setup(_net(seed))
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optim


def _train(fabric: Fabric, model: Any, optim: Any, steps: int, seed: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 100 + step * 10 + fabric.global_rank)
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        optim.zero_grad()
        fabric.backward(loss)
        optim.step()


def _meta_recorded(uri: str, s3: bool) -> bool:
    storage = dcpstore.open_storage(uri, **_options(s3))
    try:
        _, manifest = read_checkpoint_metadata(storage)
        return manifest is not None and any(p.endswith(dl.META) for p in manifest["files"])
    finally:
        storage.close()


def job_fabric(rank: int, world: int, uri: str, s3: bool) -> None:
    _env(rank)
    fabric = _fabric(True, s3)
    model, optim = _setup(fabric, 0)
    _train(fabric, model, optim, 3, 0)
    ref = full_state(model, optim)
    fabric.save(uri, {"model": model, "optimizer": optim, "step": 3, "extra": Extra(7), "note": {"lr": 0.01}})
    assert _meta_recorded(uri, s3)
    model2, optim2 = _setup(fabric, 1)
    extra = Extra(0)
    state = {"model": model2, "optimizer": optim2, "step": 0, "extra": extra}
    remainder = fabric.load(uri, state)
    assert_same(ref, full_state(model2, optim2), "fabric.load") if rank == 0 else full_state(model2, optim2)
    assert state["step"] == 3 and state["extra"] == {"value": 7} and remainder == {"note": {"lr": 0.01}}
    # Saving over it replaces model, optimizer and meta.pt together.
    _train(fabric, model, optim, 2, 1)
    ref2 = full_state(model, optim)
    fabric.save(uri, {"model": model, "optimizer": optim, "step": 5})
    model3, optim3 = _setup(fabric, 2)
    state3 = {"model": model3, "optimizer": optim3, "step": 0}
    assert fabric.load(uri, state3) == {}
    assert_same(ref2, full_state(model3, optim3), "after overwrite") if rank == 0 else full_state(model3, optim3)
    assert state3["step"] == 5
    with pytest.raises(KeyError, match="'extra'"):  # strict, as Lightning: the new save has no 'extra'
        fabric.load(uri, {"model": model3, "optimizer": optim3, "extra": Extra(0)})


def job_fabric_migration(rank: int, world: int, uri: str, saver_ours: bool) -> None:
    """One side saves with dcpstore, the other with stock Lightning."""
    _env(rank)
    saver = _fabric(saver_ours, False)
    model, optim = _setup(saver, 0)
    _train(saver, model, optim, 2, 0)
    ref = full_state(model, optim)
    saver.save(uri, {"model": model, "optimizer": optim, "step": 2})
    strategy = saver.strategy
    if saver_ours:
        strategy._dcpstore.uninstall()
    else:
        dl.install(strategy)
    model2, optim2 = _setup(saver, 1)
    state = {"model": model2, "optimizer": optim2, "step": 0}
    saver.load(uri, state)
    assert_same(ref, full_state(model2, optim2), "migration") if rank == 0 else full_state(model2, optim2)
    assert state["step"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_fabric_save_load(request: pytest.FixtureRequest, backend: str) -> None:
    run_ranks(job_fabric, 2, make_target(backend, request).uri, backend == "s3", timeout=300)


@pytest.mark.parametrize(
    "saver_ours", [pytest.param(True, marks=pytest.mark.slow), False], ids=["dcpstore-to-stock", "stock-to-dcpstore"]
)
def test_fabric_migration(request: pytest.FixtureRequest, saver_ours: bool) -> None:
    run_ranks(job_fabric_migration, 2, make_target("local", request).uri, saver_ours, timeout=300)


# -- Trainer ---------------------------------------------------------------


class Net(LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = _net(seed)

    def configure_model(self) -> None:
        _shard(self.net, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Capture(Callback):
    """The gathered model and optimizer state when training starts (after a
    resume restored it) and when it ends."""

    def __init__(self) -> None:
        self.start: dict[str, Any] | None = None
        self.end: dict[str, Any] | None = None
        self.start_step = -1

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step
        self.start = full_state(pl_module, trainer.optimizers[0]) if trainer.global_step else None

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end = full_state(pl_module, trainer.optimizers[0])


class Leftovers(Callback):
    """At step 3, what an interrupted write leaves in step 2's checkpoint
    (a temporary file; on S3 an open multipart upload): rotation must
    remove it with the rest."""

    def __init__(self, uri: str, s3: bool) -> None:
        self.uri, self.s3 = uri, s3

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step != 3 or not trainer.is_global_zero:
            return
        if not self.s3:
            with open(
                os.path.join(self.uri, "epoch=0-step=2.ckpt", ".__0_0.distcp.dcpstore-tmp-0123456789ab"), "wb"
            ) as f:
                f.write(b"half a write")
            return
        storage = dcpstore.open_storage(self.uri, **_options(self.s3))
        try:
            key = f"{storage.prefix}/epoch=0-step=2.ckpt/__0_0.distcp"  # type: ignore[attr-defined]
            storage.client.create_multipart_upload(Bucket=storage.bucket, Key=key)  # type: ignore[attr-defined]
        finally:
            storage.close()


def _trainer(uri: str, s3: bool, steps: int, root: str) -> tuple[Trainer, Capture, ModelCheckpoint]:
    strategy = TrainerStrategy(data_parallel_size=2, tensor_parallel_size=1)
    dl.install(strategy, **_options(s3))
    capture = Capture()
    ckpt = ModelCheckpoint(dirpath=uri, every_n_train_steps=2, save_top_k=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        callbacks=[ckpt, capture, Leftovers(uri, s3)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    return trainer, capture, ckpt


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(64, 8, generator=g)), batch_size=4)


def _listed(uri: str, s3: bool) -> list[str]:
    storage = dcpstore.open_storage(uri, **_options(s3))
    try:
        return sorted({o["path"].split("/")[0] for o in storage.list() if o["path"].endswith("/.metadata")})
    finally:
        storage.close()


def _names_left(uri: str, s3: bool) -> list[str]:
    """Every name directly under ``uri``, whatever it holds: directories
    (empty ones too), S3 directory markers and open multipart uploads."""
    if not s3:
        return sorted(os.listdir(uri))
    storage = dcpstore.open_storage(uri, **_options(s3))
    try:
        client, bucket, prefix = storage.client, storage.bucket, f"{storage.prefix}/"  # type: ignore[attr-defined]
        keys = [
            o["Key"]
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
        ]
        keys += [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])]
        return sorted({key[len(prefix) :].split("/")[0] for key in keys})
    finally:
        storage.close()


def job_trainer(rank: int, world: int, uri: str, s3: bool, root: str) -> None:
    _env(rank)
    trainer, capture, ckpt = _trainer(uri, s3, 4, root)
    trainer.fit(Net(0), _data())
    dist.barrier()  # rank 0 removes the rotated-out checkpoint
    listed = _listed(uri, s3)
    assert listed == ["epoch=0-step=4.ckpt"], listed  # save_top_k=1: step 2 was removed through dcpstore
    # Removed whole, as stock Lightning removes it: no empty directory (issue
    # #38), no marker, no upload; so Lightning's own check finds the name free.
    assert (left := _names_left(uri, s3)) == ["epoch=0-step=4.ckpt"], left
    if not s3:  # (on S3 fsspec's listing cache, not the storage, answers Lightning's check)
        assert not ckpt.file_exists(f"{uri}/epoch=0-step=2.ckpt", trainer)
    ckpt_path = f"{uri}/epoch=0-step=4.ckpt"
    assert _meta_recorded(ckpt_path, s3)
    trainer2, capture2, _ = _trainer(uri, s3, 6, root)
    trainer2.fit(Net(1), _data(), ckpt_path=ckpt_path)
    assert capture2.start_step == 4
    if rank == 0:
        assert capture.end is not None and capture2.start is not None
        assert_same(capture.end, capture2.start, "fit(ckpt_path=...)")
    dist.barrier()
    # Lightning keeps the checkpoint a run resumed from on a local filesystem, and only there.
    want = ["epoch=0-step=6.ckpt"] if s3 else ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt"]
    assert (listed := _listed(uri, s3)) == want, listed
    assert (left := _names_left(uri, s3)) == want, left


@pytest.mark.parametrize("backend", BACKENDS)
def test_trainer_checkpoint_and_resume(request: pytest.FixtureRequest, tmp_path: Any, backend: str) -> None:
    uri = make_target(backend, request).uri
    run_ranks(job_trainer, 2, uri, backend == "s3", str(tmp_path / "root"), timeout=300)


def test_install_refuses_other_strategies() -> None:
    from lightning.fabric.strategies import DDPStrategy

    with pytest.raises(dcpstore.InvalidArgument, match="ModelParallelStrategy"):
        dl.install(DDPStrategy())


def test_install_is_undone_and_idempotent() -> None:
    strategy = FabricStrategy(parallelize_fn=_shard)
    first = dl.install(strategy)
    second = dl.install(strategy, verify=False)  # replaces the first
    assert not first.installed and second.installed and "save_checkpoint" in strategy.__dict__
    second.uninstall()
    assert "save_checkpoint" not in strategy.__dict__ and "_dcpstore" not in strategy.__dict__
    assert dl.flavour(strategy) == "fabric" and dl.flavour(TrainerStrategy()) == "trainer"


def test_install_checks_its_options() -> None:
    strategy = FabricStrategy(parallelize_fn=_shard)
    with pytest.raises(dcpstore.InvalidArgument, match="verify must be a bool"):
        dl.install(strategy, verify="yes")
    with pytest.raises(TypeError, match="workes"):
        dl.install(strategy, workes=4)
    assert "save_checkpoint" not in strategy.__dict__  # nothing was installed
