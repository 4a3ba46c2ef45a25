"""torch_checkpointing 0.1.1's own ``CheckpointManager`` on dcpstore
(:class:`dcpstore.adapters.torch_checkpointing.DcpstoreStorageConfig`), on a
local directory, S3 and MSC (moto over HTTP), and fsspec's ``memory://``
where one process suffices.

Two gloo ranks each save their own rows and a value of their own, sync and
async (torch_checkpointing's checkpoint process), and load them back; a
checkpoint saved by one process loads resharded into a DTensor sharded over
two ranks (through torch_checkpointing's offset reads); every value is
compared exactly. Saving on two ranks with a resharder needs CUDA in
torch_checkpointing 0.1.1 (it gathers the metadata in a CUDA tensor), so the
save-on-2, load-on-1 case runs only where CUDA is.

A damaged byte in a committed file fails the load naming the file; a save
that fails before its commit, or (S3) whose commit record is refused after
every file was copied, leaves the previous checkpoint loadable and the
failed one unloadable; saving over a checkpoint refuses and keeps it. The
storage itself keeps torch_checkpointing's rename table, discards a write
that did not finish, and takes ids spelt from the root URI.
"""

from __future__ import annotations

import gc
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
from dcpstore._impl.adapters import torch_checkpointing as torch_checkpointing_impl
from dcpstore.adapters.torch_checkpointing import COMMIT_FILE, DcpstoreStorageConfig
from tests.support.backends import Target, make_target
from tests.support.dist_utils import run_ranks
from tests.support.faultproxy import FaultConfig, FaultProxy, Request, s3_error
from tests.support.s3_server import FAKE_KEY_ID, FAKE_SECRET, S3Endpoint

ROWS, COLS = 8, 3


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def _manager(target: Target, async_: bool = False, *, reshard: bool = True, **config: Any) -> CheckpointManager:
    items = {"model": ItemSpec(resharder=DefaultResharder())} if reshard else {}
    return CheckpointManager(
        CheckpointManager.Config(
            items=items,
            save=AsyncCheckpointSaverConfig() if async_ else SyncCheckpointSaverConfig(),
            storage_config=DcpstoreStorageConfig(target.uri, **target.kwargs),
            **config,
        )
    )


def _save_then_load(rank: int, world: int, target: Target, async_: bool) -> None:
    """Each rank saves its own rows and a value of its own, then reads them back."""
    mine = _full().chunk(world)[rank].clone()
    manager = _manager(target, async_, reshard=False)
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


def _load_resharded(rank: int, world: int, target: Target, step: int) -> None:
    """Load ``step``'s ``model.w`` into a DTensor sharded over this group."""
    mesh = init_device_mesh("cpu", (world,))
    into = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])
    manager = _manager(target)
    try:
        out = manager.load(f"step_{step}", into={"model": {"w": into}})
    finally:
        manager.close()
    assert isinstance(out["model"]["w"], DTensor)
    assert torch.equal(out["model"]["w"].to_local(), _full().chunk(world)[rank])
    assert torch.equal(out["model"]["w"].full_tensor(), _full())


def _save_sharded(rank: int, world: int, target: Target) -> None:
    mesh = init_device_mesh("cpu", (world,))
    manager = _manager(target)
    try:
        manager.save("step_2", {"model": {"w": distribute_tensor(_full(), mesh, [Shard(0)])}})
    finally:
        manager.close()


#: Every backend for one process; ranks are processes, and ``memory://``
#: is one process's memory.
ONE_PROCESS = ["local", "s3", "msc", "memory"]
# MSC on two ranks runs with the slow suite: its quick coverage is the one-process cases.
RANKS = ["local", "s3", pytest.param("msc", marks=pytest.mark.slow)]


@pytest.fixture(params=RANKS)
def root(request: pytest.FixtureRequest) -> Target:
    return make_target(request.param, request)


@pytest.fixture(params=ONE_PROCESS)
def any_root(request: pytest.FixtureRequest) -> Target:
    return make_target(request.param, request)


@pytest.mark.parametrize(
    ("backend", "async_"),
    [
        ("local", False),
        # torch_checkpointing's async saver on two ranks: quick on S3, as the sync one is on local disk.
        pytest.param("local", True, marks=pytest.mark.slow),
        ("s3", False),
        ("s3", True),
        *(pytest.param("msc", async_, marks=pytest.mark.slow) for async_ in (False, True)),
    ],
    ids=["local-sync", "local-async", "s3-sync", "s3-async", "msc-sync", "msc-async"],
)
def test_two_ranks_save_and_load(request: pytest.FixtureRequest, backend: str, async_: bool) -> None:
    run_ranks(_save_then_load, 2, make_target(backend, request), async_)


def test_resharded_load_saved_on_one_loaded_on_two(root: Target) -> None:
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
def test_resharded_load_saved_on_two_loaded_on_one(root: Target) -> None:
    run_ranks(_save_sharded, 2, root)
    run_ranks(_load_resharded, 1, root, 2)


# -- one process: torch_checkpointing runs as a single rank without a group ----


def _save_step(target: Target, step: int, value: float, **config: Any) -> None:
    manager = _manager(target, **config)
    try:
        manager.save(f"step_{step}", {"model": {"w": torch.full((4,), value)}})
    finally:
        manager.close()


def _load_step(target: Target, step: int) -> torch.Tensor:
    manager = _manager(target)
    try:
        out = manager.load(f"step_{step}", into={"model": {"w": torch.zeros(4)}})
    finally:
        manager.close()
    w = out["model"]["w"]
    assert isinstance(w, torch.Tensor)
    return w


def _flip(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x01
    return bytes(damaged)


def _damage(target: Target, key: str, request: pytest.FixtureRequest) -> None:
    """Flip one byte in the middle of ``key`` under the target, behind dcpstore's back."""
    if target.name == "local":
        path = Path(target.uri, key)
        path.write_bytes(_flip(path.read_bytes()))
    elif target.name == "memory":
        import fsspec

        with fsspec.open(f"{target.uri}/{key}", "rb") as f:
            data = f.read()
        with fsspec.open(f"{target.uri}/{key}", "wb") as f:
            f.write(_flip(data))
    else:  # s3://bucket/prefix, or msc://profile/prefix whose profile is the bucket
        endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
        object_key = f"{target.uri.split('/', 3)[3]}/{key}"
        client = endpoint.client()
        data = client.get_object(Bucket=endpoint.bucket, Key=object_key)["Body"].read()
        client.put_object(Bucket=endpoint.bucket, Key=object_key, Body=_flip(data))


def test_a_damaged_byte_is_caught_on_load(any_root: Target, request: pytest.FixtureRequest) -> None:
    _save_step(any_root, 1, 1.5)
    assert torch.equal(_load_step(any_root, 1), torch.full((4,), 1.5))
    _damage(any_root, "step_1/model_0.pt", request)
    with pytest.raises(CheckpointCorrupt, match=r"step_1/model_0\.pt.*CRC32C"):
        _load_step(any_root, 1)


def _fail(args: Any) -> None:
    raise RuntimeError("pre-finalize refused")


def test_failed_save_and_save_over_keep_the_previous_checkpoint(any_root: Target) -> None:
    root = any_root
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
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    root = make_target("s3", request)
    _save_step(root, 1, 1.0)
    # Every file of step_2 is copied to its final name; then the commit
    # record's PUT is refused (403: not retried), as if the saver died there.
    refuse: Callable[[Request], bytes | None] = lambda req: (
        s3_error(403, "Forbidden", "AccessDenied", "denied") if _commit_put(req) else None
    )
    with FaultProxy(s3_endpoint.url, FaultConfig(answer=refuse)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        with pytest.raises(Exception, match=COMMIT_FILE.replace(".", r"\.")) as refused:
            _save_step(root, 2, 2.0)
        assert proxy.stats.requests["PutObject"] > 0
    # The refusal names the object, never the credentials that were refused.
    chain = []
    error: BaseException | None = refused.value
    while error is not None:
        chain.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    assert not any(secret in text for text in chain for secret in (FAKE_SECRET, FAKE_KEY_ID)), chain
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    listing = s3_endpoint.client().list_objects_v2(Bucket=s3_endpoint.bucket, Prefix=root.uri.split("/", 3)[3] + "/")
    keys = [o["Key"] for o in listing["Contents"]]
    assert any(k.endswith("/step_2/model_0.pt") for k in keys)  # the copy did land
    with pytest.raises(CheckpointCorrupt, match=r"step_2/\S+ has no checksum record"):
        _load_step(root, 2)
    assert torch.equal(_load_step(root, 1), torch.full((4,), 1.0))


# -- torch_checkpointing's rename table (Storage.rename's docstring), through the storage --


def test_rename_keeps_torch_checkpointings_table(any_root: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    # Object stores copy each file in chunks: several here, as a large file would.
    monkeypatch.setattr(torch_checkpointing_impl, "COPY_CHUNK", 4)
    storage = DcpstoreStorageConfig(any_root.uri, **any_root.kwargs).create_storage()
    try:
        for name, data in [("src/a.bin", b"A" * 10), ("src/sub/b.bin", b"B" * 3), ("old/x.bin", b"X")]:
            storage.mkdir(Path(name).parent)
            storage.write(Path(name), data)

        # A directory onto a populated one raises and touches neither.
        with pytest.raises(FileExistsError, match=r"src.*onto.*old"):
            storage.rename(Path("src"), Path("old"), is_directory=True)
        assert storage.ls(Path("src")) == ["a.bin", "sub"]
        assert storage.read(Path("old/x.bin")) == b"X"

        # Onto an absent one: the contents land at the destination, the source goes.
        storage.rename(Path("src"), Path("dst"), is_directory=True)
        assert not storage.exists(Path("src"))
        assert storage.ls(Path("dst")) == ["a.bin", "sub"]
        assert storage.read(Path("dst/sub/b.bin")) == b"B" * 3
        assert storage.glob("d*") == ["dst"]

        # A directory onto a file raises.
        storage.write(Path("file.bin"), b"F")
        storage.mkdir(Path("src2"))
        storage.write(Path("src2/c.bin"), b"C")
        with pytest.raises(FileExistsError):
            storage.rename(Path("src2"), Path("file.bin"), is_directory=True)
        assert storage.read(Path("file.bin")) == b"F"

        # A file onto a file replaces it; onto a populated directory raises.
        storage.write(Path("new.bin"), b"new")
        storage.rename(Path("new.bin"), Path("file.bin"))
        assert storage.read(Path("file.bin")) == b"new" and not storage.exists(Path("new.bin"))
        with pytest.raises(FileExistsError):
            storage.rename(Path("file.bin"), Path("dst"))
        assert storage.read(Path("dst/a.bin")) == b"A" * 10

        # Leaving the root is refused, naming the path.
        with pytest.raises(OSError, match=r"\.\./escape"):
            storage.write(Path("../escape"), b"no")

        # Deleting: a file (with its record), then a committed folder whole.
        storage.delete(Path("file.bin"))
        assert not storage.exists(Path("file.bin"))
        with pytest.raises(FileNotFoundError, match="file.bin"):
            storage.delete(Path("file.bin"))
        storage.rmdir(Path("dst"))
        assert not storage.exists(Path("dst")) and not storage.isdir(Path("dst"))
        assert storage.ls(Path("")) == ["old", "src2"]
    finally:
        storage.close()


def test_an_unfinished_write_leaves_nothing(any_root: Target) -> None:
    storage = DcpstoreStorageConfig(any_root.uri, **any_root.kwargs).create_storage()
    try:
        storage.mkdir(Path("d"))
        with pytest.raises(RuntimeError, match="boom"), storage.stream_write(Path("d/f.bin")) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
        dropped = storage.stream_write(Path("d/g.bin"))
        dropped.write(b"partial")
        del dropped
        gc.collect()
        storage.write(Path("d/h.bin"), b"whole")
        assert storage.ls(Path("d")) == ["h.bin"]
    finally:
        storage.close()


def test_ids_spelt_from_the_root(any_root: Target) -> None:
    # torch_checkpointing's own examples name checkpoints by full path.
    _save_step(any_root, 1, 4.0)
    manager = _manager(any_root)
    try:
        out = manager.load(f"{any_root.uri}/step_1", into={"model": {"w": torch.zeros(4)}})
        manager.save(f"{any_root.uri}/step_2", {"model": {"w": torch.full((4,), 5.0)}})
    finally:
        manager.close()
    assert torch.equal(out["model"]["w"], torch.full((4,), 4.0))
    assert torch.equal(_load_step(any_root, 2), torch.full((4,), 5.0))
    storage = DcpstoreStorageConfig(any_root.uri, **any_root.kwargs).create_storage()
    try:
        assert storage.ls(Path(any_root.uri)) == ["step_1", "step_2"]
        with pytest.raises(OSError, match="/elsewhere/step_1"):
            storage.write(Path("/elsewhere/step_1"), b"no")
    finally:
        storage.close()
