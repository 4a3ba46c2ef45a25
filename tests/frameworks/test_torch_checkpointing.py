"""torch_checkpointing 0.1.1's own ``CheckpointManager`` on dcpstore
(:class:`dcpstore.adapters.torch_checkpointing.DcpstoreStorageConfig`), on a
local directory and on S3 (moto over HTTP).

Two gloo ranks each save their own rows and a value of their own, sync and
async (torch_checkpointing's checkpoint process), and load them back; a
checkpoint saved by one process loads resharded into a DTensor sharded over
two ranks (through torch_checkpointing's offset reads); every value is
compared exactly. Saving on two ranks with a resharder needs CUDA in
torch_checkpointing 0.1.1 (it gathers the metadata in a CUDA tensor), so the
save-on-2, load-on-1 case runs only where CUDA is. A damaged byte in a committed file fails
the load naming the file; a save that fails before or during its commit
leaves the previous checkpoint loadable and the failed one unloadable, and
saving over a checkpoint refuses and keeps it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.extras import skip_module_unless  # noqa: E402

skip_module_unless("torch-checkpointing")

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder

from dcpstore import CheckpointCorrupt
from dcpstore.adapters.torch_checkpointing import COMMIT_FILE, DcpstoreStorageConfig
from tests.support.dist_utils import run_ranks
from tests.support.faultproxy import FaultConfig, FaultProxy, Request, s3_error
from tests.support.s3_server import S3Endpoint, s3_endpoint  # noqa: F401

ROWS, COLS = 8, 3


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def _manager(uri: str, async_: bool = False, *, reshard: bool = True, **config: Any) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=DefaultResharder())} if reshard else {}
    return CheckpointManager(
        CheckpointManager.Config(
            items=items,
            save=AsyncCheckpointSaverConfig() if async_ else SyncCheckpointSaverConfig(),
            storage_config=DcpstoreStorageConfig(uri),
            **config,
        )
    )


def _save_then_load(rank: int, world: int, uri: str, async_: bool) -> None:
    """Each rank saves its own rows and a value of its own, then reads them back."""
    mine = _full().chunk(world)[rank].clone()
    manager = _manager(uri, async_, reshard=False)
    try:
        future = manager.save("step_1", {"model": {"w": mine}, "rank": torch.tensor([rank, 10 + rank])})
        assert (future is None) != async_
        if future is not None:
            future.result(timeout=120)
        torch.distributed.barrier()  # rank 0's commit is done before anyone loads
        out = manager.load("step_1", into={"model": {"w": torch.zeros_like(mine)}, "rank": None})
    finally:
        manager.close()
    assert torch.equal(out["model"]["w"], mine)
    assert torch.equal(out["rank"], torch.tensor([rank, 10 + rank]))


def _load_resharded(rank: int, world: int, uri: str, step: int) -> None:
    """Load ``step``'s ``model.w`` into a DTensor sharded over this group."""
    mesh = init_device_mesh("cpu", (world,))
    target = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])
    manager = _manager(uri)
    try:
        out = manager.load(f"step_{step}", into={"model": {"w": target}})
    finally:
        manager.close()
    assert isinstance(out["model"]["w"], DTensor)
    assert torch.equal(out["model"]["w"].to_local(), _full().chunk(world)[rank])
    assert torch.equal(out["model"]["w"].full_tensor(), _full())


def _save_sharded(rank: int, world: int, uri: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    manager = _manager(uri)
    try:
        manager.save("step_2", {"model": {"w": distribute_tensor(_full(), mesh, [Shard(0)])}})
    finally:
        manager.close()


@pytest.fixture(params=["local", "s3"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    return f"s3://{endpoint.bucket}/torch-checkpointing/{uuid.uuid4().hex}"


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_two_ranks_save_and_load(root: str, async_: bool) -> None:
    run_ranks(_save_then_load, 2, root, async_)


def test_resharded_load_saved_on_one_loaded_on_two(root: str) -> None:
    # torch_checkpointing writes resharding metadata only for items with a
    # resharder, and one process needs no collective to gather it.
    manager = _manager(root)
    try:
        manager.save("step_1", {"model": {"w": _full()}})
    finally:
        manager.close()
    run_ranks(_load_resharded, 2, root, 1)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch_checkpointing 0.1.1 gathers resharding metadata across ranks in a CUDA tensor "
    "(metadata_manager.py: _all_gather_pickled_data, device='cuda'), so a save on 2 ranks with a "
    "resharder needs CUDA",
)
def test_resharded_load_saved_on_two_loaded_on_one(root: str) -> None:
    run_ranks(_save_sharded, 2, root)
    run_ranks(_load_resharded, 1, root, 2)


# -- one process: torch_checkpointing runs as a single rank without a group ----


def _save_step(uri: str, step: int, value: float, **config: Any) -> None:
    manager = _manager(uri, **config)
    try:
        manager.save(f"step_{step}", {"model": {"w": torch.full((4,), value)}})
    finally:
        manager.close()


def _load_step(uri: str, step: int) -> torch.Tensor:
    manager = _manager(uri)
    try:
        out = manager.load(f"step_{step}", into={"model": {"w": torch.zeros(4)}})
    finally:
        manager.close()
    w = out["model"]["w"]
    assert isinstance(w, torch.Tensor)
    return w


def _damage(root: str, key: str, endpoint: S3Endpoint | None) -> None:
    """Flip one byte in the middle of ``key`` under ``root``."""
    if endpoint is None:
        path = os.path.join(root, key)
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0x01
        Path(path).write_bytes(bytes(data))
        return
    client = endpoint.client()
    object_key = f"{root.split('/', 3)[3]}/{key}"
    data = bytearray(client.get_object(Bucket=endpoint.bucket, Key=object_key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=endpoint.bucket, Key=object_key, Body=bytes(data))


def test_a_damaged_byte_is_caught_on_load(root: str, request: pytest.FixtureRequest) -> None:
    endpoint = request.getfixturevalue("s3_endpoint") if root.startswith("s3://") else None
    _save_step(root, 1, 1.5)
    assert torch.equal(_load_step(root, 1), torch.full((4,), 1.5))
    _damage(root, "step_1/model_0.pt", endpoint)
    with pytest.raises(CheckpointCorrupt, match=r"step_1/model_0\.pt.*CRC32C"):
        _load_step(root, 1)


def _fail(args: Any) -> None:
    raise RuntimeError("pre-finalize refused")


def test_failed_save_and_save_over_keep_the_previous_checkpoint(root: str) -> None:
    _save_step(root, 1, 1.0)
    # Every file of step_2 written, then the save fails before its commit.
    with pytest.raises(RuntimeError, match="pre-finalize refused"):
        _save_step(root, 2, 2.0, pre_finalize_callback=_fail)
    with pytest.raises(FileNotFoundError, match="step_2"):
        _load_step(root, 2)
    # Saving over step_1 refuses, naming both folders, and keeps it.
    with pytest.raises(FileExistsError, match=r"tmp_step_1.*onto.*step_1"):
        _save_step(root, 1, 3.0)
    assert torch.equal(_load_step(root, 1), torch.full((4,), 1.0))


def _commit_put(req: Request) -> bool:
    return req.method == "PUT" and req.target.split("?")[0].endswith("/step_2/" + COMMIT_FILE)


def test_a_commit_cut_short_on_s3_leaves_no_checkpoint(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"s3://{s3_endpoint.bucket}/torch-checkpointing/{uuid.uuid4().hex}"
    _save_step(root, 1, 1.0)
    # Every file of step_2 is copied to its final name; then the commit
    # record's PUT is refused (403: not retried), as if the saver died there.
    refuse: Callable[[Request], bytes | None] = lambda req: (
        s3_error(403, "Forbidden", "AccessDenied", "denied") if _commit_put(req) else None
    )
    with FaultProxy(s3_endpoint.url, FaultConfig(answer=refuse)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with pytest.raises(Exception, match=COMMIT_FILE.replace(".", r"\.")):
            _save_step(root, 2, 2.0)
        assert proxy.stats.requests["PutObject"] > 0
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    listing = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=root.split("/", 3)[3] + "/")
    keys = [o["Key"] for o in listing["Contents"]]
    assert any(k.endswith("/step_2/model_0.pt") for k in keys)  # the copy did land
    with pytest.raises(CheckpointCorrupt, match=r"step_2/\S+ has no checksum record"):
        _load_step(root, 2)
    assert torch.equal(_load_step(root, 1), torch.full((4,), 1.0))
