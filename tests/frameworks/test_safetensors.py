"""Hugging Face safetensors through dcpstore (:class:`dcpstore.SafetensorsWriter`
and :class:`dcpstore.SafetensorsReader` under ``dcp.save`` / ``dcp.load``) on
a local directory, S3 and MSC (moto over HTTP), and fsspec's ``memory://``
where one process suffices.

Two gloo ranks save a DTensor sharded over them (one shard file per rank,
DCP's chunk offsets in each header) and load it back resharded, on two
ranks and on one; one process exports whole tensors over two files with
Hugging Face's index, which Hugging Face's ``safetensors`` library loads
from a downloaded copy. Every value is compared exactly. A damaged byte
fails the load naming the file; a save that fails while writing leaves the
previous checkpoint (shards and index) loadable; saving over one replaces
its shards, leaving nothing of the old save behind; ``dcp.async_save``
saves the values it was given; ``consolidate_safetensors`` turns a 2-rank
sharded save into whole-tensor files on the same backend; ``gc`` takes a
killed save's tagged shards and never plainly named weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.extras import skip_module_unless

skip_module_unless("safetensors")

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcpstore
import dcpstore.tools
from dcpstore import InvalidArgument, LoadError, SafetensorsReader, SafetensorsWriter, consolidate_safetensors
from dcpstore.storage import open_storage
from tests.support.backends import Target, make_target
from tests.support.dist_utils import run_ranks

ROWS, COLS = 8, 3
INDEX = "model.safetensors.index.json"
MAPPING = {"embed": 1, "head.weight": 2, "head.bias": 2, "steps": 2}


def _full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 7


def _model(shift: float = 0.0) -> dict[str, torch.Tensor]:
    return {
        "embed": _full() + shift,
        "head.weight": (torch.arange(6, dtype=torch.float32).reshape(2, 3) + shift).to(torch.bfloat16),
        "head.bias": torch.tensor([shift, -shift], dtype=torch.float16),
        "steps": torch.tensor([7, int(shift)], dtype=torch.int64),
    }


def _writer(target: Target, **kwargs: object) -> SafetensorsWriter:
    return SafetensorsWriter(target.uri, options=target.save_options(), **kwargs)  # type: ignore[arg-type]


def _reader(target: Target) -> SafetensorsReader:
    return SafetensorsReader(target.uri, storage_options=target.load_options().storage_options)


def _load(target: Target, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=_reader(target), no_dist=True)
    return out


def _download(target: Target, tmp_path: Path) -> Path:
    """Every file of the checkpoint, copied to a local folder (as a user
    pulls a model from an object store before ``from_pretrained``)."""
    storage = open_storage(target.uri, storage_options=target.load_options().storage_options)
    where = tmp_path / "download"
    where.mkdir()
    for obj in storage.list():
        (where / obj["path"]).write_bytes(storage.read(obj["path"]))
    return where


def _save_sharded(rank: int, world: int, target: Target) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = {"embed": distribute_tensor(_full(), mesh, [Shard(0)])}
    dcp.save(state, storage_writer=_writer(target))


def _load_sharded(rank: int, world: int, target: Target) -> None:
    mesh = init_device_mesh("cpu", (world,))
    into = {"embed": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])}
    dcp.load(into, storage_reader=_reader(target))
    assert isinstance(into["embed"], DTensor)
    assert torch.equal(into["embed"].to_local(), _full().chunk(world)[rank])
    assert torch.equal(into["embed"].full_tensor(), _full())


RANKS = ["local", "s3", "msc"]
ONE_PROCESS = ["local", "s3", "msc", "memory"]


@pytest.fixture(params=RANKS)
def root(request: pytest.FixtureRequest) -> Target:
    return make_target(request.param, request)


@pytest.fixture(params=ONE_PROCESS)
def any_root(request: pytest.FixtureRequest) -> Target:
    return make_target(request.param, request)


def test_two_ranks_save_shards_that_load_resharded(root: Target, tmp_path: Path) -> None:
    run_ranks(_save_sharded, 2, root)
    run_ranks(_load_sharded, 2, root)  # the same sharding
    out = _load(root, {"embed": _full()})  # one process, whole
    assert torch.equal(out["embed"], _full())

    files = _download(root, tmp_path)
    shards = sorted(p.name for p in files.glob("*.safetensors"))
    assert shards == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    assert not (files / INDEX).exists()  # a tensor in two files: Hugging Face's index cannot say so
    for rank, name in enumerate(shards):
        assert torch.equal(load_file(files / name)["embed"], _full().chunk(2)[rank])
        with safe_open(str(files / name), framework="pt") as f:
            sharding = json.loads(f.metadata()["DCP_SHARDING_INFO"])
        assert sharding == {"embed": {"saved_offsets": [rank * ROWS // 2, 0]}}


def _save_sharded_model(rank: int, world: int, target: Target) -> None:
    """The model with its two matrices sharded by rows over the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    model = _model(3.0)
    for key in ("embed", "head.weight"):
        model[key] = distribute_tensor(model[key], mesh, [Shard(0)])  # type: ignore[assignment]
    dcp.save(model, storage_writer=_writer(target))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "elsewhere"])
def test_a_sharded_save_consolidates_on_its_backend(root: Target, in_place: bool, tmp_path: Path) -> None:
    run_ranks(_save_sharded_model, 2, root)
    out = root if in_place else root.child("whole")
    consolidate_safetensors(
        root.uri,
        None if in_place else out.uri,
        fqn_to_index_mapping=MAPPING,
        storage_options=root.load_options().storage_options,
    )

    files = _download(out, tmp_path)
    index = json.loads((files / INDEX).read_text())
    assert sorted(p.name for p in files.glob("*.safetensors")) == sorted(set(index["weight_map"].values()))
    assert all(not name.startswith("shard-") for name in index["weight_map"].values())  # the rank shards are gone
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(files / name))
    for key, value in _model(3.0).items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    back = _load(out, _model())
    assert all(torch.equal(back[k], v) for k, v in _model(3.0).items())
    if not in_place:  # the source is untouched
        assert torch.equal(_load(root, _model())["embed"], _full() + 3.0)


def test_an_export_loads_with_hugging_faces_library(any_root: Target, tmp_path: Path) -> None:
    model = _model(1.0)
    writer = _writer(any_root, fqn_to_index_mapping=MAPPING)
    dcp.save(model, storage_writer=writer, no_dist=True)

    files = _download(any_root, tmp_path)
    assert writer.stats.bytes_written == sum(p.stat().st_size for p in files.glob("*.safetensors"))
    index = json.loads((files / INDEX).read_text())
    assert index["weight_map"] == {
        "embed": "model-00001-of-00002.safetensors",
        "head.bias": "model-00002-of-00002.safetensors",
        "head.weight": "model-00002-of-00002.safetensors",
        "steps": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.values())
    loaded: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(files / name))
    assert loaded.keys() == model.keys()
    for key, value in model.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key

    out = _load(any_root, model)  # through the reader, checksums checked
    assert all(torch.equal(out[k], model[k]) for k in model)


def test_async_save_stages_a_copy(any_root: Target) -> None:
    model = _model(1.0)
    future = dcp.async_save(model, storage_writer=_writer(any_root, fqn_to_index_mapping=MAPPING))
    for value in model.values():
        value.add_(10)  # after async_save returns: the export holds the values it was given
    future.result()
    out = _load(any_root, _model())
    assert all(torch.equal(out[k], v) for k, v in _model(1.0).items())


def test_saving_over_an_export_replaces_it_whole(any_root: Target, tmp_path: Path) -> None:
    dcp.save(_model(1.0), storage_writer=_writer(any_root, fqn_to_index_mapping=MAPPING), no_dist=True)
    dcp.save(_model(2.0), storage_writer=_writer(any_root, fqn_to_index_mapping=MAPPING), no_dist=True)
    out = _load(any_root, _model())
    assert all(torch.equal(out[k], v) for k, v in _model(2.0).items())

    files = _download(any_root, tmp_path)
    index = json.loads((files / INDEX).read_text())
    shards = sorted(p.name for p in files.glob("*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values()))  # the replaced save's shards are gone
    assert all(".safetensors" in s and s.count(".") == 2 for s in shards)  # save-unique: model-…-of-….{tag}.safetensors
    assert torch.equal(load_file(files / index["weight_map"]["embed"])["embed"], _full() + 2.0)


def _flip_in_data(target: Target, name: str) -> None:
    """Flip the last byte of ``name`` (tensor data, not the header), behind
    dcpstore's commit."""
    storage = open_storage(target.uri, storage_options=target.load_options().storage_options)
    blob = bytearray(storage.read(name))
    blob[-1] ^= 0x01
    storage.put(name, bytes(blob))


def test_a_damaged_byte_is_caught_on_load(any_root: Target) -> None:
    dcp.save(_model(1.0), storage_writer=_writer(any_root, fqn_to_index_mapping=MAPPING), no_dist=True)
    _flip_in_data(any_root, "model-00002-of-00002.safetensors")
    with pytest.raises(
        CheckpointException, match=r"CheckpointCorrupt: .*model-00002-of-00002\.safetensors: checksum mismatch"
    ):
        _load(any_root, _model())


def test_a_failed_save_leaves_the_previous_export_loadable(any_root: Target, tmp_path: Path) -> None:
    dcp.save(_model(1.0), storage_writer=_writer(any_root, fqn_to_index_mapping=MAPPING), no_dist=True)
    # File 2 cannot be written (no safetensors dtype for complex): the save
    # fails after its claim, while file 1 is being written.
    broken = {**_model(2.0), "head.bias": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(CheckpointException, match="head.bias"):
        dcp.save(broken, storage_writer=_writer(any_root, fqn_to_index_mapping=MAPPING), no_dist=True)

    out = _load(any_root, _model())
    assert all(torch.equal(out[k], v) for k, v in _model(1.0).items())
    files = _download(any_root, tmp_path)
    index = json.loads((files / INDEX).read_text())
    assert index["weight_map"]["embed"] == "model-00001-of-00002.safetensors"
    assert torch.equal(load_file(files / "model-00001-of-00002.safetensors")["embed"], _full() + 1.0)


def test_dcpstores_own_loads_point_at_the_safetensors_reader(tmp_path: Path) -> None:
    target = Target("local", str(tmp_path / "ckpt"))
    dcp.save(_model(1.0), storage_writer=_writer(target), no_dist=True)
    with pytest.raises(LoadError, match=r"holds safetensors shards.*SafetensorsReader"):
        dcpstore.load(_model(), target.uri)


def test_gc_takes_a_killed_saves_shards_and_never_plain_weights(tmp_path: Path) -> None:
    root = tmp_path / "root"
    ours = Target("local", str(root / "ours"))
    dcp.save(_model(1.0), storage_writer=_writer(ours, fqn_to_index_mapping=MAPPING), no_dist=True)
    # What a save over it killed before its commit leaves: a shard with its save tag.
    (root / "ours" / "model-00001-of-00002.deadbeef.safetensors").write_bytes(b"half a shard")
    theirs = root / "theirs"  # someone's weights: plain names, no commit
    theirs.mkdir()
    save_file({"w": torch.ones(2)}, str(theirs / "model-00001-of-00001.safetensors"))

    report = dcpstore.tools.gc(str(root), older_than_s=0)

    assert report.removed == ["ours/model-00001-of-00002.deadbeef.safetensors"]
    assert os.listdir(theirs) == ["model-00001-of-00001.safetensors"]
    assert torch.equal(_load(ours, _model())["embed"], _full() + 1.0)


def test_overwrite_false_refuses_a_committed_export(tmp_path: Path) -> None:
    target = Target("local", str(tmp_path / "ckpt"))
    dcp.save(_model(1.0), storage_writer=_writer(target), no_dist=True)
    with pytest.raises(CheckpointException, match="CheckpointExists: Checkpoint already exists"):
        dcp.save(_model(2.0), storage_writer=_writer(target, overwrite=False), no_dist=True)
    assert torch.equal(_load(target, _model())["embed"], _full() + 1.0)


def test_what_safetensors_cannot_hold_is_refused_naming_it(tmp_path: Path) -> None:
    target = Target("local", str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointException, match=r"InvalidArgument: 'epoch' is not a tensor"):
        dcp.save({**_model(), "epoch": 3}, storage_writer=_writer(target), no_dist=True)
    with pytest.raises(InvalidArgument, match=r"fqn_to_index_mapping\['embed'\]"):
        _writer(target, fqn_to_index_mapping={"embed": 0})
    assert not (tmp_path / "ckpt" / ".metadata").exists()
