"""A load that fails says exactly what it changed.

Large tensors are read straight into their destinations and verified there,
so a damaged item is found after it has overwritten its destination (the
alternative costs a second copy of the state or a second read; see
dcpstore/_impl/dcp/load_progress.py). The promise tested here: structural
damage and mismatched destinations change nothing; content damage stops the
load, and the error's ``loaded_keys`` hold the checkpoint's values,
``damaged_keys`` hold bytes that failed verification, and every other key
holds exactly what it held before.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

import dcpstore
from dcpstore._impl.dcp.commit import read_checkpoint_metadata
from dcpstore._impl.dcp.load_progress import NO_CHANGES, merge_changes
from dcpstore.adapters import fsdp
from dcpstore.storage import open_storage
from tests.support.backends import Target
from tests.support.dist_utils import run_ranks
from tests.support.oracle import assert_same_state, destination, value_bytes
from tests.support.rss import fix_mmap_threshold, in_own_process, live_rss

FILL = 0x5A  # every byte of a destination before the load


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {f"big{i}": torch.randn(40_000 + i, generator=g) for i in range(6)}  # >= 64 KiB
    state.update({f"small{i}": torch.randn(50, generator=g) for i in range(6)})
    state["obj"] = {"lr": 0.5, "betas": (0.9, 0.99)}
    return state


def _flip_key(uri: str, key: str) -> None:
    """Flip one byte in the middle of ``key``'s stored item."""
    metadata, _ = read_checkpoint_metadata(open_storage(uri))
    assert metadata.storage_data is not None
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    path = os.path.join(uri, info.relative_path)
    with open(path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _assert_report_matches_state(err: Any, dest: dict[str, Any], saved: dict[str, Any]) -> None:
    loaded, partly, damaged = set(err.loaded_keys), set(err.partly_loaded_keys), set(err.damaged_keys)
    flat_dest = _flat(dest)
    flat_saved = _flat(saved)
    flat_before = _flat(destination(saved, FILL))
    assert not partly
    for key in flat_dest:
        if key in loaded:
            assert_same_state(flat_dest[key], flat_saved[key], key)
        elif key in damaged:
            assert not torch.equal(value_bytes(flat_dest[key]), value_bytes(flat_saved[key])), key
        else:
            assert_same_state(flat_dest[key], flat_before[key], f"{key} (reported unchanged)")
    for key in sorted(loaded)[:3] + sorted(damaged):
        assert repr(key) in str(err)
    assert "every other key is unchanged" in str(err) or not (loaded or damaged)


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in state.items() if k != "obj"}
    out["obj.lr"] = state["obj"]["lr"] if isinstance(state["obj"], dict) else None
    out["obj.betas"] = state["obj"]["betas"] if isinstance(state["obj"], dict) else None
    return out


@pytest.mark.parametrize("save_workers,load_workers", [(1, 1), (3, 4)])
@pytest.mark.parametrize("damaged", ["big1", "small2", "obj.betas"])
def test_failed_load_reports_exactly_what_it_changed(
    local_target: Target, damaged: str, save_workers: int, load_workers: int
) -> None:
    saved = _state()
    dcpstore.save(saved, local_target.uri, workers=save_workers).result()
    _flip_key(local_target.uri, damaged)
    dest = destination(saved, FILL)
    dest["obj"] = {"lr": None, "betas": None}
    with pytest.raises(dcpstore.CheckpointCorrupt, match="checksum mismatch") as info:
        dcpstore.load(dest, local_target.uri, workers=load_workers)
    err = info.value
    _assert_report_matches_state(err, dest, saved)
    # Only a large tensor's destination can receive damaged bytes: small
    # items and objects are verified before they are copied.
    assert set(err.damaged_keys) == ({damaged} if damaged.startswith("big") else set())
    # Loading a good copy again overwrites every key.
    dcpstore.save(saved, local_target.uri).result()
    dcpstore.load(dest, local_target.uri)
    assert_same_state(dest, saved)


def test_structural_damage_changes_nothing(local_target: Target) -> None:
    saved = _state()
    dcpstore.save(saved, local_target.uri, workers=3).result()
    data = sorted(f for f in os.listdir(local_target.uri) if f.endswith(".distcp"))
    os.truncate(os.path.join(local_target.uri, data[-1]), 100)
    dest = destination(saved, FILL)
    with pytest.raises(dcpstore.CheckpointCorrupt, match="truncated") as info:
        dcpstore.load(dest, local_target.uri, workers=4)
    assert_same_state(dest, destination(saved, FILL))
    assert not (info.value.__dict__.get("loaded_keys") or info.value.__dict__.get("damaged_keys"))


def test_a_missing_file_found_mid_load_changes_nothing_it_reports(local_target: Target) -> None:
    """With ``verify=False`` there are no checksums, but every file's real
    size is still checked before anything is read (nothing is allocated for
    bytes a file does not hold): the missing file is found then, and the
    error reports that nothing was changed, not its large tensors (about to
    be read in place) as damaged."""
    saved = _state()
    dcpstore.save(saved, local_target.uri, workers=3).result()
    data = sorted(f for f in os.listdir(local_target.uri) if f.endswith(".distcp"))
    os.unlink(os.path.join(local_target.uri, data[0]))
    dest = destination(saved, FILL)
    dest["obj"] = {"lr": None, "betas": None}
    with pytest.raises(dcpstore.CheckpointCorrupt, match="missing") as info:
        dcpstore.load(dest, local_target.uri, workers=1, verify=False)
    assert info.value.damaged_keys == () and info.value.loaded_keys == ()
    _assert_report_matches_state(info.value, dest, saved)


def test_what_two_tries_of_a_load_changed() -> None:
    """A load tried again (its checkpoint replaced meanwhile) reports what
    every try changed: a key as the later try left it where it touched it
    (a whole key loaded again is loaded, even over damaged bytes; a key
    loaded in part over damaged bytes stays damaged), as the earlier try left
    it elsewhere."""
    earlier = (("a", "b", "h"), ("c",), ("d", "e"))
    later = (("d",), ("e", "f", "h"), ("g",))
    assert merge_changes(earlier, later) == (("a", "b", "d"), ("c", "f", "h"), ("e", "g"))
    assert merge_changes(NO_CHANGES, later) == later and merge_changes(earlier, NO_CHANGES) == earlier


FULL = torch.arange(4 * 40_000, dtype=torch.float32).reshape(4, 40_000)


SMALL = torch.arange(4 * 10, dtype=torch.float32).reshape(4, 10)


def _save_two_shards(rank: int, world_size: int, uri: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    state = {name: distribute_tensor(full.clone(), mesh, [Shard(0)]) for name, full in (("w", FULL), ("s", SMALL))}
    dcpstore.save(state, uri, workers=1).result()


def _flip_piece(uri: str, key: str, offsets: tuple[int, ...]) -> None:
    metadata, _ = read_checkpoint_metadata(open_storage(uri))
    assert metadata.storage_data is not None
    piece = metadata.storage_data[MetadataIndex(key, torch.Size(offsets))]
    with open(os.path.join(uri, piece.relative_path), "r+b") as f:
        f.seek(piece.offset + piece.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("damaged", ["w", "s"])
def test_keys_read_in_pieces(local_target: Target, damaged: str) -> None:
    """Saved as two shards, loaded whole: each key is read in two pieces
    (rows 0-1 and 2-3). A damaged piece of the large key leaves it damaged;
    of the small key, unchanged or partly loaded (its other piece loaded)."""
    run_ranks(_save_two_shards, 2, local_target.uri)
    _flip_piece(local_target.uri, damaged, (2, 0))
    dest = {"w": torch.zeros(4, 40_000), "s": torch.zeros(4, 10)}
    with pytest.raises(dcpstore.CheckpointCorrupt) as info:
        dcpstore.load(dest, local_target.uri, workers=1)
    err = info.value
    assert err.damaged_keys == (("w",) if damaged == "w" else ())
    full = {"w": FULL, "s": SMALL}
    for key, value in dest.items():
        rows_loaded = [torch.equal(value[r], full[key][r]) for r in range(4)]
        rows_zero = [not value[r].any() for r in range(4)]
        if key in err.loaded_keys:
            assert all(rows_loaded), key
        elif key in err.partly_loaded_keys:  # one piece in, the other untouched
            assert all(rows_loaded[:2] + rows_zero[2:]) or all(rows_zero[:2] + rows_loaded[2:]), key
        elif key not in err.damaged_keys:
            assert all(rows_zero), f"{key} reported unchanged"
    assert damaged not in err.loaded_keys


def test_fsdp_adapter_load_names_what_a_damaged_checkpoint_changed(local_target: Target) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Linear(100, 300))
    optim = torch.optim.AdamW(model.parameters())
    fsdp.save_app_state(model, optim, local_target.uri).result()
    _flip_key(local_target.uri, "model.1.weight")  # 30,000 floats: read in place
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(200, 100), torch.nn.Linear(100, 300))
    before = {k: v.detach().clone() for k, v in other.state_dict().items()}
    with pytest.raises(dcpstore.CheckpointCorrupt) as info:
        fsdp.load_app_state(other, torch.optim.AdamW(other.parameters()), local_target.uri)
    err = info.value
    assert "model.1.weight" in err.damaged_keys
    after = other.state_dict()
    for key, value in before.items():
        name = f"model.{key}"
        if name not in err.loaded_keys + err.partly_loaded_keys + err.damaged_keys:
            assert torch.equal(after[key], value), f"{name} changed but was reported unchanged"


def _failed_loads_growth(root: str) -> int:
    """Live RSS growth over 10 failed loads of a damaged checkpoint (after 2 to warm up)."""
    fix_mmap_threshold()  # this process's allocator only (rss.in_own_process)
    dcpstore.save({"big": torch.randn(1 << 20), "step": 5}, root).result()
    name = sorted(f for f in os.listdir(root) if f.endswith(".distcp"))[0]
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(root, name)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    proc = psutil.Process()
    samples = []
    for _ in range(12):
        with pytest.raises(dcpstore.CheckpointCorrupt):
            dcpstore.load({"big": torch.zeros(1 << 20), "step": 0}, root)
        samples.append(live_rss(proc))
    return samples[-1] - samples[1]


def test_failed_loads_leave_nothing_in_memory(tmp_path) -> None:
    """A failed load's error was set on a torch Future, which holds it out
    of the collector's sight while the traceback leads back to the future:
    each failed load kept its read buffers and the destination (4 MiB here)
    for good. Ten more failed loads now leave live memory as it was."""
    grown = in_own_process(_failed_loads_growth, str(tmp_path / "ck"))
    assert grown < 4 << 20, f"live RSS grew {grown >> 20} MiB over 10 failed loads"
