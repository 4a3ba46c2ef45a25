"""Save/load round trips: one suite, run on every backend target."""

from __future__ import annotations

import pickle

import pytest
import torch

import dcpstore
from dcpstore.storage import MiB
from tests.support.backends import Target
from tests.support.helpers import assert_state_equal, sample_state, zeros_like_state


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


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of ``(start, end)`` byte spans, as sorted disjoint spans."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def test_partial_load_reads_only_requested_keys(target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial load reads every byte of the requested items and nothing of
    a large item it was not asked for. Between two requested items of one
    file it may read through a gap of up to 1 MiB (one scatter read instead
    of two requests), never more."""
    state = {**sample_state(1), "big_a": torch.randn(MiB // 2), "big_b": torch.randn(MiB // 2)}  # 2 MiB each
    dcpstore.save(state, target.uri, **target.kwargs).result()
    storage = dcpstore.open_storage(target.uri, **target.kwargs)
    items = {index.fqn: info for index, info in pickle.loads(storage.read(".metadata")).storage_data.items()}
    reads: list[tuple[str, int, int]] = []  # every data-file read the load makes
    cls = type(storage)
    real_range, real_into, real_each = cls.read_range, cls.read_into, cls.read_into_each

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        reads.append((path, offset, length))
        return real_range(self, path, offset, length)

    def read_into(self, path: str, offset: int, buffers, **kwargs) -> int:
        reads.append((path, offset, sum(b.nbytes for b in buffers)))
        return real_into(self, path, offset, buffers, **kwargs)

    def read_into_each(self, path: str, offset: int, buffers, each, **kwargs) -> int:
        reads.append((path, offset, sum(b.nbytes for b in buffers)))  # a backend's default reads through read_into
        return real_each(self, path, offset, buffers, each, **kwargs)

    monkeypatch.setattr(cls, "read_range", read_range)
    monkeypatch.setattr(cls, "read_into", read_into)
    monkeypatch.setattr(cls, "read_into_each", read_into_each)
    subset = {"f32": torch.zeros(64, 33), "nested": {"w": torch.zeros(3, 3)}, "big_a": torch.zeros(MiB // 2)}
    dcpstore.load(subset, target.uri, **target.kwargs)
    monkeypatch.undo()
    assert torch.equal(subset["f32"], state["f32"]) and torch.equal(subset["big_a"], state["big_a"])
    assert torch.equal(subset["nested"]["w"], state["nested"]["w"])
    wanted = [items[k] for k in ("f32", "nested.w", "big_a")]
    for path in {info.relative_path for info in items.values()}:
        got = _merged([(o, o + n) for p, o, n in reads if p == path])
        want = _merged([(i.offset, i.offset + i.length) for i in wanted if i.relative_path == path])
        for start, end in want:  # every requested byte was read
            assert any(s <= start and end <= e for s, e in got), (path, start, end, got)
        extra = sum(e - s for s, e in got) - sum(e - s for s, e in want)
        assert extra <= max(0, len(want) - 1) * MiB, f"{path}: {extra} bytes read beyond the requested items"
    big_b = items["big_b"]
    assert not any(
        p == big_b.relative_path and o < big_b.offset + big_b.length and big_b.offset < o + n for p, o, n in reads
    )


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
