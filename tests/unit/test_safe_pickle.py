"""The restricted unpicklers against what torch itself writes.

The ``.metadata`` allowlist is checked against the pickles real saves
produce -- stock ``dcp.save`` (with and without ``use_collectives``) and
dcpstore's engines, on two gloo ranks, for every kind of state dict we
support: plain tensors, DTensor, ShardedTensor, bytes items, nested dicts
flattened by DCP's planner and kept nested -- and against the shapes older
torch releases write (no ``version``, no ``transform_descriptors``, no
``storage_meta``, TensorProperties from the sharded-tensor module of torch
<= 2.1, ``pathlib._local`` of Python 3.13, every pickle protocol). The item
allowlist is checked against the training state people save.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import decimal
import fractions
import io
import os
import pathlib
import pickle
import random
import uuid
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
from dcpstore._impl.format.safe_pickle import TOOLS, Trust, load_metadata, load_object
from tests.support.dist_utils import run_ranks

KINDS = ("plain", "dtensor", "sharded", "bytes", "nested", "nested_unflattened")
WRITERS = ("stock", "stock_rank_local", "dcpstore", "dcpstore_async")


def _state(kind: str, rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    if kind == "plain":
        return {"a": torch.randn(4, 3, generator=g), "b": torch.arange(6, dtype=torch.int64), "h": torch.ones(2).half()}
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        full = torch.randn(8, 4, generator=g)
        return {"w": distribute_tensor(full, mesh, [Shard(0)]), "r": distribute_tensor(full, mesh, [Replicate()])}
    if kind == "sharded":
        from torch.distributed._shard.sharded_tensor import empty
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec

        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
        return {"s": empty(spec, 8, 4)}
    if kind == "bytes":
        return {"step": 7, "name": "run", "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "none": None}, "t": torch.ones(3)}
    model = {"layer": {"w": torch.randn(2, 2, generator=g), "b": torch.zeros(2)}}
    optim = {
        "state": {0: {"m": torch.zeros(2), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    return {"model": model, "optim": optim}


def _write_all(rank: int, world: int, root: str) -> None:
    for kind in KINDS:
        state = _state(kind, rank, world)
        planner = DefaultSavePlanner(flatten_state_dict=False) if kind == "nested_unflattened" else None
        dcp.save(state, storage_writer=FileSystemWriter(f"{root}/stock-{kind}"), planner=planner)
        dcp.save(
            state,
            storage_writer=FileSystemWriter(f"{root}/stock_rank_local-{kind}"),
            planner=planner,
            use_collectives=False,
        )
        dcpstore.save(state, f"{root}/dcpstore-{kind}", planner=planner).result()
        dcpstore.save(state, f"{root}/dcpstore_async-{kind}", async_=True, engine="native", planner=planner).result()
    dist.barrier()


@pytest.fixture(scope="module")
def torch_written(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("torch_written"))
    run_ranks(_write_all, 2, root, timeout=300)
    return root


def _metadata_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".metadata"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("writer", WRITERS)
def test_metadata_allowlist_reads_what_torch_writes(torch_written: str, writer: str, kind: str) -> None:
    files = _metadata_files(os.path.join(torch_written, f"{writer}-{kind}"))
    assert len(files) == (2 if writer == "stock_rank_local" else 1), files
    for path in files:
        blob = open(path, "rb").read()
        ours, stored = load_metadata(blob, path)
        assert ours == pickle.loads(blob)  # every field, as plain pickle builds it
        assert stored and all(length > 0 for _, _, _, length in stored)


def _retyped(blob: bytes, old: bytes, new: bytes) -> bytes:
    """Rename a global in a protocol-2 pickle (GLOBAL is newline-delimited text)."""
    assert old in blob, old
    return blob.replace(old, new)


def _stock_metadata(tmp_path: Any) -> Any:
    dcp.save({"a": torch.ones(3), "n": {"x": 1}}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    return pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_metadata_of_older_releases_and_every_protocol(tmp_path: Any, protocol: int) -> None:
    """torch 2.6 .. 2.13 write the same classes from the same modules (read
    from their sources); what changed is which fields exist. Drop those the
    older ones lack, and rename what other Pythons call differently."""
    md = _stock_metadata(tmp_path)
    variants = {"current": md}
    old = dataclasses.replace(md)
    del old.__dict__["version"]  # before the field existed
    for info in old.storage_data.values():
        info.__dict__.pop("transform_descriptors", None)  # before DCP extensions
    variants["no version, no transform_descriptors"] = old
    variants["no storage_meta"] = dataclasses.replace(md, storage_meta=None)
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as LegacyProperties

    legacy = pickle.loads(pickle.dumps(md))
    legacy.state_dict_metadata["a"].properties = LegacyProperties(dtype=torch.float32)
    variants["TensorProperties of torch <= 2.1"] = legacy
    for name, variant in variants.items():
        blob = pickle.dumps(variant, protocol=protocol)
        ours, _ = load_metadata(blob, name)
        assert ours == pickle.loads(blob), name
    if protocol == 2:  # Python 3.13 pickles pathlib classes from pathlib._local
        blob = _retyped(pickle.dumps(md, protocol=2), b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n")
        assert load_metadata(blob, "py313")[0].storage_meta.checkpoint_id == md.storage_meta.checkpoint_id
        # A Windows-written checkpoint_id loads on Linux (as a pure path).
        blob = _retyped(pickle.dumps(md, protocol=2), b"cpathlib\nPosixPath\n", b"cpathlib\nWindowsPath\n")
        assert str(load_metadata(blob, "windows")[0].storage_meta.checkpoint_id).endswith("ck")


def _training_state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    return {
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state(),
        "numpy_generator": np.random.default_rng(1).bit_generator.state,
        "python_rng": random.Random(1).getstate(),
        "args": argparse.Namespace(lr=0.1, layers=[1, 2], name="x"),
        "when": datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
        "elapsed": datetime.timedelta(seconds=90),
        "collections": [collections.deque([1, 2]), collections.OrderedDict(a=1), collections.Counter("aab")],
        "defaultdict": collections.defaultdict(list, {"k": [1]}),
        "sets": [{1, 2}, frozenset({3})],
        "numbers": [complex(1, 2), decimal.Decimal("1.25"), fractions.Fraction(1, 3), float("inf")],
        "ids": [uuid.UUID(int=5), pathlib.PurePosixPath("/a/b"), pathlib.Path("/c")],
        "blobs": [b"\x00\x01", bytearray(b"xy"), bytearray()],
        "empty_bytes": b"",  # protocol 2 writes it as a call to builtins.bytes()
        "arrays": [np.arange(5, dtype=np.float32), np.float64(1.5), np.int32(3), np.array([[1, 2]], dtype=np.uint8)],
        "torch_values": [torch.float16, torch.device("cpu"), torch.Size([2, 3]), torch.nn.Parameter(torch.ones(2))],
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (torch.Tensor, np.ndarray)):
        return type(a) is type(b) and bool((a == b).all()) and a.dtype == b.dtype
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace):
        return vars(a) == vars(b)
    return bool(a == b) and type(a) is type(b)


@pytest.mark.parametrize("key", list(_training_state()))
def test_item_allowlist_reads_training_state(key: str) -> None:
    value = _training_state()[key]
    buf = io.BytesIO()
    torch.save(value, buf)  # exactly what DCP's planner writes for a non-tensor item
    assert _equal(value, load_object(buf.getvalue(), f"checkpoint item {key!r}"))


@dataclasses.dataclass
class Custom:
    """A class of the user's own: not on the allowlist."""

    depth: int


def test_custom_classes_need_an_opt_in_that_names_them() -> None:
    buf = io.BytesIO()
    torch.save({"cfg": Custom(3)}, buf)
    with pytest.raises(dcpstore.UnsafeCheckpoint) as info:
        load_object(buf.getvalue(), "checkpoint item 'cfg'", Trust.of())
    assert str(info.value) == (
        "checkpoint item 'cfg' holds class tests.unit.test_safe_pickle.Custom: "
        "pass safe_globals=[tests.unit.test_safe_pickle.Custom] (or trusted=True) if you trust this checkpoint"
    )
    with pytest.raises(dcpstore.UnsafeCheckpoint, match="tools never unpickle"):
        load_object(buf.getvalue(), "checkpoint item 'cfg'", TOOLS)
    assert load_object(buf.getvalue(), "x", Trust.of([Custom])) == {"cfg": Custom(3)}
    assert load_object(buf.getvalue(), "x", Trust.of([(Custom, "tests.unit.test_safe_pickle.Custom")])) == {
        "cfg": Custom(3)
    }
    assert load_object(buf.getvalue(), "x", Trust.of(trusted=True)) == {"cfg": Custom(3)}


def _load_through(entry: str, root: str, dest: dict[str, Any], **opt_in: Any) -> None:
    """Load step 1 under ``root`` into ``dest`` through one public entry point."""
    uri = dcpstore.CheckpointManager(root).step_uri(1)
    if entry == "dcpstore.load":
        dcpstore.load(dest, uri, **opt_in)
    elif entry == "CheckpointManager.load":
        assert dcpstore.CheckpointManager(root).load(dest, **opt_in) == 1
    elif entry == "tiered CheckpointManager.load":  # the local tier serves it
        with dcpstore.CheckpointManager(root + "-durable", local_dir=root) as mgr:
            assert mgr.load(dest, **opt_in) == 1
    else:  # the drop-in reader under stock dcp.load
        dcp.load(dest, storage_reader=dcpstore.StorageReader(uri, options=dcpstore.LoadOptions(**opt_in)))


@pytest.mark.parametrize(
    "entry", ["dcpstore.load", "CheckpointManager.load", "tiered CheckpointManager.load", "StorageReader"]
)
@pytest.mark.parametrize("opt_in", ["none", "safe_globals", "trusted"])
def test_every_load_entry_point_needs_the_opt_in_for_a_custom_class(
    tmp_path: pathlib.Path, entry: str, opt_in: str
) -> None:
    """``safe_globals=`` and ``trusted=`` as each public entry point takes
    them: without either, a user's class in a non-tensor item is refused
    naming it, and the item is not loaded; with either, it loads whole."""
    root = str(tmp_path)
    saved = {"w": torch.arange(6.0), "cfg": Custom(3)}
    dcpstore.save(saved, dcpstore.CheckpointManager(root).step_uri(1))
    dest: dict[str, Any] = {"w": torch.zeros(6), "cfg": None}
    if opt_in == "none":
        with pytest.raises(BaseException) as info:  # DCP wraps the drop-in reader's error in its own BaseException
            _load_through(entry, root, dest)
        name = "tests.unit.test_safe_pickle.Custom"
        assert f"{name}: pass safe_globals=[{name}]" in str(info.value), info.value
        if entry != "StorageReader":  # dcpstore's own entry points raise dcpstore's error
            assert isinstance(info.value, dcpstore.UnsafeCheckpoint), type(info.value)
        assert dest["cfg"] is None
        return
    _load_through(entry, root, dest, **({"safe_globals": [Custom]} if opt_in == "safe_globals" else {"trusted": True}))
    assert dest["cfg"] == Custom(3) and torch.equal(dest["w"], saved["w"])


@pytest.mark.parametrize("bad", ["mypkg.Foo", [3], ["str"], {"x": 1}.items(), 5])
def test_bad_opt_in_arguments_are_named(bad: Any) -> None:
    with pytest.raises(dcpstore.InvalidArgument, match="safe_globals"):
        Trust.of(bad)
    with pytest.raises(dcpstore.InvalidArgument, match="trusted"):
        Trust.of(None, trusted="yes")  # type: ignore[arg-type]


def test_bytearray_of_a_size_allocates_nothing() -> None:
    """torch's own weights_only list allows ``bytearray`` (and protocol 2
    writes an empty ``bytes`` as ``bytes()``); ``bytearray(n)`` or
    ``bytes(n)`` from one small int in a pickle would allocate n bytes."""

    class Bomb:
        def __reduce__(self) -> Any:
            return (bytearray, (1 << 40,))

    class BytesBomb:
        def __reduce__(self) -> Any:
            return (bytes, (1 << 40,))

    for bomb, name in ((Bomb(), "bytearray"), (BytesBomb(), "bytes")):
        buf = io.BytesIO()
        torch.save(bomb, buf)
        with pytest.raises(dcpstore.CheckpointCorrupt, match=rf"{name}\(int\) is not allowed"):
            load_object(buf.getvalue(), "checkpoint item 'b'")
