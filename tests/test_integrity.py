"""Damage to a committed checkpoint is caught, and the error names the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from backends import Target
from helpers import assert_state_equal, sample_state, zeros_like_state
from dcpstore.dcp.commit import read_checkpoint_metadata
from dcpstore.format.layout import MANIFEST, manifest_name, save_tag
from dcpstore.storage import open_storage


@pytest.fixture
def saved(local_target: Target) -> tuple[str, dict]:
    state = sample_state(3)
    dcpstore.save(state, local_target.uri, workers=2).result()
    return local_target.uri, state


def _data_files(root: str) -> list[str]:
    return sorted(f for f in os.listdir(root) if f.endswith(".distcp"))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _load_error(root: str, state: dict) -> dcpstore.CheckpointError:
    with pytest.raises(dcpstore.CheckpointError) as info:
        dcpstore.load(zeros_like_state(state), root)
    return info.value


@pytest.mark.parametrize("where", [0.1, 0.5, 0.95])
def test_flipped_byte_is_named(saved: tuple[str, dict], where: float) -> None:
    root, state = saved
    name = _data_files(root)[0]
    path = os.path.join(root, name)
    _flip(path, int(os.path.getsize(path) * where))
    err = _load_error(root, state)
    assert isinstance(err, dcpstore.CheckpointCorrupt)
    assert name in str(err) and "checksum" in str(err)


def test_truncation_is_named(saved: tuple[str, dict]) -> None:
    root, state = saved
    name = _data_files(root)[-1]
    path = os.path.join(root, name)
    os.truncate(path, os.path.getsize(path) - 7)
    err = _load_error(root, state)
    assert isinstance(err, dcpstore.CheckpointCorrupt)
    assert name in str(err) and "truncated" in str(err)


def test_missing_data_file_is_named(saved: tuple[str, dict]) -> None:
    root, state = saved
    name = _data_files(root)[0]
    os.unlink(os.path.join(root, name))
    err = _load_error(root, state)
    assert isinstance(err, dcpstore.CheckpointCorrupt)
    assert name in str(err) and "missing" in str(err)


def test_damaged_metadata_is_named(saved: tuple[str, dict]) -> None:
    root, state = saved
    _flip(os.path.join(root, ".metadata"), 40)
    err = _load_error(root, state)
    assert isinstance(err, dcpstore.CheckpointCorrupt)
    assert ".metadata" in str(err)


def test_damaged_manifest_is_named(saved: tuple[str, dict]) -> None:
    root, state = saved
    with open(os.path.join(root, ".dcpstore.json"), "r+b") as f:
        f.write(b"{{{")
    err = _load_error(root, state)
    assert ".dcpstore.json" in str(err)


@pytest.mark.parametrize("key", ["small", "big"])  # read through its record / straight into its destination
def test_damage_in_an_overwritten_checkpoint_names_its_save_unique_manifest(local_target: Target, key: str) -> None:
    # A save over a used URI writes .dcpstore.<tag>.json: the error must name
    # the manifest the load really checked, not the plain .dcpstore.json.
    root = local_target.uri
    g = torch.Generator().manual_seed(5)
    state = {"small": torch.randn(16, generator=g), "big": torch.randn(64, 1024, generator=g)}
    dcpstore.save(state, root).result()
    state = {name: t + 1 for name, t in state.items()}
    dcpstore.save(state, root).result()
    metadata, _ = read_checkpoint_metadata(open_storage(root))
    assert metadata.storage_meta is not None
    manifest = manifest_name(save_tag(metadata.storage_meta.save_id))
    assert manifest != MANIFEST and os.path.exists(os.path.join(root, manifest))
    assert metadata.storage_data is not None
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == key)
    _flip(os.path.join(root, info.relative_path), info.offset + info.length - 4)
    err = _load_error(root, state)
    assert isinstance(err, dcpstore.CheckpointCorrupt)
    assert "checksum" in str(err) and info.relative_path in str(err) and manifest in str(err)


def test_verify_disabled_loads_without_manifest_checks(saved: tuple[str, dict]) -> None:
    """``verify=False`` skips the manifest's sizes and checksums: with every
    CRC32C and file size it records made wrong (the data untouched), a
    verifying load refuses the checkpoint and ``verify=False`` loads it
    exactly."""
    root, state = saved
    path = os.path.join(root, MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["items"] = {key: (crc + 1) % 2**32 for key, crc in manifest["items"].items()}
    for entry in manifest["files"].values():
        entry["crc32c"] = (entry["crc32c"] + 1) % 2**32
        entry["size"] += 1
    with open(path, "w") as f:
        json.dump(manifest, f)
    assert isinstance(_load_error(root, state), dcpstore.CheckpointCorrupt)
    restored = zeros_like_state(state)
    dcpstore.load(restored, root, verify=False)
    assert_state_equal(state, restored)


def test_stock_dcp_reads_dcpstore_checkpoint(saved: tuple[str, dict]) -> None:
    root, state = saved
    restored = zeros_like_state(state)
    dcp.load(restored, checkpoint_id=root)
    assert_state_equal(state, restored)


def test_dcpstore_reads_stock_dcp_checkpoint(tmp_path) -> None:
    state = sample_state(4)
    root = str(tmp_path / "stock")
    dcp.save(state, checkpoint_id=root)
    assert not os.path.exists(os.path.join(root, ".dcpstore.json"))
    restored = zeros_like_state(state)
    dcpstore.load(restored, root)
    assert_state_equal(state, restored)


def test_stock_dcp_in_fresh_process_without_dcpstore(saved: tuple[str, dict], tmp_path) -> None:
    """The .metadata must unpickle where dcpstore is not importable at all,
    and stock DCP must read every value of every key exactly."""
    root, state = saved
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    template, loaded = tmp_path / "template.pt", tmp_path / "loaded.pt"
    torch.save(zeros_like_state(state), template)
    code = (
        "import sys; sys.modules['dcpstore'] = None\n"
        "import torch, torch.distributed.checkpoint as dcp\n"
        f"sd = torch.load({str(template)!r}, weights_only=False)\n"
        f"dcp.load(sd, checkpoint_id={str(copy)!r})\n"
        f"torch.save(sd, {str(loaded)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert_state_equal(state, torch.load(loaded, weights_only=False))
