"""Save/load round trips: one suite, run on every backend target."""

from __future__ import annotations

import pytest
import torch

import dcpstore
from backends import Target
from helpers import assert_state_equal, sample_state, zeros_like_state
from dcpstore.storage import MiB


def test_roundtrip_all_value_kinds(target: Target) -> None:
    state = sample_state()
    info = dcpstore.save(state, target.uri, **target.kwargs).result()
    assert info.bytes_written > 0 and info.files
    assert set(info.phases) >= {"plan", "stage", "write", "commit"}
    restored = zeros_like_state(state)
    dcpstore.load(restored, target.uri, **target.kwargs)
    assert_state_equal(state, restored)


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_workers_split_files(target: Target, workers: int) -> None:
    state = {f"t{i}": torch.full((1000 + i,), float(i)) for i in range(12)}
    info = dcpstore.save(state, target.uri, workers=workers, **target.kwargs).result()
    assert len(info.files) == min(workers, 12)
    restored = zeros_like_state(state)
    dcpstore.load(restored, target.uri, workers=workers, **target.kwargs)
    assert_state_equal(state, restored)


def test_multi_file_objects_larger_than_a_part(target: Target) -> None:
    # 3 files of ~12 MiB each: above the 5 MiB minimum part size object
    # stores use, so multipart uploads and ranged reads are exercised.
    state = {f"big{i}": torch.randn(3 * MiB) for i in range(3)}  # 12 MiB each
    dcpstore.save(state, target.uri, workers=3, **target.kwargs).result()
    restored = zeros_like_state(state)
    dcpstore.load(restored, target.uri, workers=4, **target.kwargs)
    assert_state_equal(state, restored)


def test_partial_load_reads_only_requested_keys(target: Target) -> None:
    state = sample_state(1)
    dcpstore.save(state, target.uri, **target.kwargs).result()
    subset = {"f32": torch.zeros(64, 33), "nested": {"w": torch.zeros(3, 3)}}
    dcpstore.load(subset, target.uri, **target.kwargs)
    assert torch.equal(subset["f32"], state["f32"])
    assert torch.equal(subset["nested"]["w"], state["nested"]["w"])


def test_overwrite_same_uri_keeps_only_the_new_checkpoint(target: Target) -> None:
    first = {f"t{i}": torch.full((100,), 1.0) for i in range(8)}
    dcpstore.save(first, target.uri, workers=8, **target.kwargs).result()
    second = {"t0": torch.full((100,), 2.0)}
    info = dcpstore.save(second, target.uri, workers=1, **target.kwargs).result()
    restored = {"t0": torch.zeros(100)}
    dcpstore.load(restored, target.uri, **target.kwargs)
    assert torch.equal(restored["t0"], second["t0"])
    listed = {o["path"] for o in dcpstore.open_storage(target.uri, **target.kwargs).list()}
    assert {p for p in listed if p.endswith(".distcp")} == set(info.files)
    assert ".dcpstore.inflight" not in listed  # the commit removed its marker


def test_reshape_mismatch_is_reported(target: Target) -> None:
    dcpstore.save({"w": torch.ones(4, 4)}, target.uri, **target.kwargs).result()
    with pytest.raises(dcpstore.CheckpointError):
        dcpstore.load({"w": torch.zeros(5, 4)}, target.uri, **target.kwargs)


@pytest.mark.slow
def test_large_tensor_256mib(target: Target) -> None:
    big = torch.arange(64 * MiB, dtype=torch.int32)  # 256 MiB
    dcpstore.save({"big": big, "small": torch.ones(3)}, target.uri, workers=2, **target.kwargs).result()
    restored = {"big": torch.empty_like(big), "small": torch.zeros(3)}
    dcpstore.load(restored, target.uri, **target.kwargs)
    assert torch.equal(restored["big"], big)


def test_large_tensor_256mib_local(local_target: Target) -> None:
    """The >= 256 MiB case on the local backend in the default run."""
    test_large_tensor_256mib(local_target)
