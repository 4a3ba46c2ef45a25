"""Loads read a whole tensor's bytes straight into the destination tensor.

The manifest locates each row-major tensor's raw bytes inside its record; the
reader lands them in place with ``Storage.read_into`` and verifies their
CRC32C. Destinations that cannot take raw bytes (another dtype, a
non-contiguous view, a slice of the stored tensor) go through the record.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl.engines.nvrx import NvrxTarget, nvrx_save
from dcpstore._impl.engines.staging import Stager
from dcpstore._impl.format.layout import MANIFEST
from dcpstore.storage import Storage
from tests.support.backends import Target
from tests.support.oracle import needs_nvrx


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(640, 512, generator=g),  # 1.25 MiB
        "bf16": torch.randn(1024, 600, generator=g).bfloat16(),
        "small": torch.randn(10, generator=g),
        "t": torch.randn(512, 700, generator=g).t(),  # non-contiguous source
    }


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the address of every buffer ``read_into`` (or ``read_into_each``,
    a verifying load's) fills, on every backend."""
    addresses: list[int] = []

    def spy_on(cls: type[Storage]) -> None:
        for name in ("read_into", "read_into_each"):
            if name in vars(cls):
                monkeypatch.setattr(cls, name, _spying(vars(cls)[name], addresses))
        for sub in cls.__subclasses__():
            spy_on(sub)

    spy_on(Storage)
    return addresses


def _spying(original: Any, addresses: list[int]) -> Any:
    def spy(self: Storage, path: str, offset: int, buffers: list[memoryview], *args: Any, **kwargs: Any) -> int:
        addresses.extend(torch.frombuffer(b, dtype=torch.uint8).data_ptr() for b in buffers if b.nbytes)
        return original(self, path, offset, buffers, *args, **kwargs)  # type: ignore[no-any-return]

    return spy


def test_large_contiguous_tensors_load_in_place(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    dcpstore.save(state, target.uri, workers=2, **target.kwargs).result()
    manifest = json.loads(dcpstore.open_storage(target.uri, **target.kwargs).read(MANIFEST))
    # Every row-major tensor is located, whatever its size; the transposed one is not.
    assert len(manifest["tensors"]) == 3
    filled = _spy(monkeypatch)
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    in_place = {dest["big"].data_ptr(), dest["bf16"].data_ptr()}
    dcpstore.load(dest, target.uri, **target.kwargs)
    assert in_place <= set(filled)
    # Small tensors come with their record and are copied out; "t" goes through torch.load.
    assert dest["small"].data_ptr() not in filled and dest["t"].data_ptr() not in filled
    for key, want in state.items():
        assert torch.equal(dest[key], want), key


def test_other_destinations_go_through_the_record(local_target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    dcpstore.save(state, local_target.uri).result()
    filled = _spy(monkeypatch)
    dest = {
        "big": torch.zeros(640, 512, dtype=torch.float64),  # another dtype: converted
        "bf16": torch.zeros(600, 1024, dtype=torch.bfloat16).t(),  # non-contiguous view
        "small": torch.zeros(10, dtype=torch.float64),
        "t": torch.zeros(700, 512),
    }
    dcpstore.load(dest, local_target.uri)
    assert filled == []
    assert torch.equal(dest["small"], state["small"].double())
    assert torch.equal(dest["big"], state["big"].double())
    assert torch.equal(dest["bf16"], state["bf16"])
    assert torch.equal(dest["t"], state["t"])


def test_damage_in_a_tensor_read_in_place_is_named(local_target: Target) -> None:
    state = _state()
    dcpstore.save(state, local_target.uri, workers=1).result()
    manifest = json.loads(open(os.path.join(local_target.uri, MANIFEST), "rb").read())
    key, (data_offset, nbytes) = next(iter(manifest["tensors"].items()))
    name, _, item_offset = key.rpartition("@")
    with open(os.path.join(local_target.uri, name), "r+b") as f:
        f.seek(int(item_offset) + data_offset + nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(dcpstore.CheckpointCorrupt, match=rf"{name}.*checksum mismatch"):
        dcpstore.load({k: torch.zeros_like(v.contiguous()) for k, v in state.items()}, local_target.uri)


def test_manifest_without_tensor_locations_still_loads(local_target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest written before ``tensors`` existed loads through the records."""
    state = _state()
    dcpstore.save(state, local_target.uri).result()
    path = os.path.join(local_target.uri, MANIFEST)
    manifest = json.loads(open(path, "rb").read())
    del manifest["tensors"]
    with open(path, "w") as f:
        json.dump(manifest, f)
    filled = _spy(monkeypatch)
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    dcpstore.load(dest, local_target.uri)
    assert filled == [] and all(torch.equal(dest[k], v) for k, v in state.items())


def test_a_run_with_a_destination_that_needs_the_record(local_target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """One file, its tensors in one run: the odd destination drops out of the
    scatter read and the others still land in place."""
    state = _state()
    dcpstore.save(state, local_target.uri, workers=1).result()
    filled = _spy(monkeypatch)
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    dest["bf16"] = torch.zeros(600, 1024, dtype=torch.bfloat16).t()
    dcpstore.load(dest, local_target.uri, workers=1)
    assert dest["big"].data_ptr() in filled and dest["bf16"].data_ptr() not in filled
    for key, want in state.items():
        assert torch.equal(dest[key], want), key


@pytest.mark.parametrize(
    "tensor",
    [torch.tensor(True), torch.tensor([7], dtype=torch.int8), torch.arange(6, dtype=torch.uint8), torch.tensor(2.5)],
    ids=["bool-scalar", "one-byte", "six-bytes", "f32-scalar"],
)
def test_tiny_tensors_are_located_by_address_not_by_size(local_target: Target, tensor: torch.Tensor) -> None:
    """A record's header writes are 1-6 bytes long too ("1", "64", "little");
    only the write from the tensor's own memory is its data."""
    state = {"x": tensor, "pad": torch.randn(300)}
    dcpstore.save(state, local_target.uri, workers=1).result()
    manifest = json.loads(open(os.path.join(local_target.uri, MANIFEST), "rb").read())
    offsets = {v[0] for v in manifest["tensors"].values()}
    assert len(manifest["tensors"]) == 2 and all(o % 64 == 0 for o in offsets)  # torch aligns data records
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcpstore.load(dest, local_target.uri)
    assert torch.equal(dest["x"], tensor) and torch.equal(dest["pad"], state["pad"])


def test_a_tensor_location_outside_its_item_is_named(local_target: Target) -> None:
    state = _state()
    dcpstore.save(state, local_target.uri).result()
    path = os.path.join(local_target.uri, MANIFEST)
    manifest = json.loads(open(path, "rb").read())
    key = next(iter(manifest["tensors"]))
    manifest["tensors"][key][0] += 10 << 20
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(dcpstore.CheckpointCorrupt, match=r"\.dcpstore\.json.*outside its item"):
        dcpstore.load({k: torch.zeros_like(v.contiguous()) for k, v in state.items()}, local_target.uri)


@needs_nvrx
@pytest.mark.parametrize("through_msc", [False, True], ids=["posix", "msc"])
def test_nvrx_checkpoints_locate_tensors_like_native_ones(
    local_target: Target, monkeypatch: pytest.MonkeyPatch, through_msc: bool
) -> None:
    """NVRx writes its records with stock torch.save; the engine locates
    each tensor's bytes on the way, so its checkpoints load in place too,
    and the locations are the native writer's (torch's records are laid out
    alike, whoever writes them)."""
    if through_msc:
        pytest.importorskip("multistorageclient")
    state = _state()
    native_uri = local_target.uri + "-native"
    dcpstore.save(state, native_uri, workers=1).result()
    storage = dcpstore.open_storage(local_target.uri)
    staged = Stager().stage(state)
    nvrx_save(
        staged.state_dict,
        storage,
        workers=1,
        process_group=None,
        planner=None,
        cache=None,
        target=NvrxTarget(storage.url.path, use_msc=through_msc),
    )

    def located(uri: str) -> list[int]:
        manifest = json.loads(open(os.path.join(uri, MANIFEST), "rb").read())
        return sorted(nbytes for _, nbytes in manifest["tensors"].values())

    assert located(local_target.uri) == located(native_uri) == sorted(state[k].nbytes for k in ("big", "bf16", "small"))
    filled = _spy(monkeypatch)
    dest = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    dcpstore.load(dest, local_target.uri)
    assert {dest["big"].data_ptr(), dest["bf16"].data_ptr()} <= set(filled)
    for key, want in state.items():
        assert torch.equal(dest[key], want), key
    # Stock DCP reads the same files.
    plain = {k: torch.zeros_like(v.contiguous()) for k, v in state.items()}
    dcp.load(plain, checkpoint_id=local_target.uri)
    assert all(torch.equal(plain[k], v) for k, v in state.items())


@needs_nvrx
def test_nvrx_tensor_locations_point_at_the_bytes(local_target: Target) -> None:
    """Each located span holds exactly the tensor's bytes, item by item."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(64 * (i + 1), 33, generator=g) for i in range(5)}
    state["i8"] = torch.randint(-100, 100, (4097,), dtype=torch.int8, generator=g)
    dcpstore.save(state, local_target.uri, async_=True, engine="nvrx", workers=2).result(timeout=60)
    manifest = json.loads(open(os.path.join(local_target.uri, MANIFEST), "rb").read())
    assert len(manifest["tensors"]) == len(state)
    blobs = set()
    for key, (offset, nbytes) in manifest["tensors"].items():
        name, _, item_offset = key.rpartition("@")
        with open(os.path.join(local_target.uri, name), "rb") as f:
            f.seek(int(item_offset) + offset)
            blobs.add(f.read(nbytes))
    assert blobs == {v.numpy().tobytes() for v in state.values()}
