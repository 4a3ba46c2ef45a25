"""Read planning (dcpstore._impl.dcp.read_plan) as pure functions.

The reader used to plan by editing its inputs in place (``_split_direct``
rewrote the per-file request lists, ``_coalesce`` sorted them), so reading
the plan in another order read tensors twice, silently. Here: every request
lands in exactly one job, whatever the layout; the inputs come back as they
went in; and planning twice gives the same jobs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcpstore import CheckpointCorrupt
from dcpstore._impl.dcp.read_plan import (
    Direct,
    DirectRun,
    Span,
    coalesce,
    plan_reads,
    scatter_groups,
    sequential_runs,
    split_direct,
)
from dcpstore._impl.format.layout import item_key

Request = tuple[ReadItem, _StorageInfo]


def _request(fqn: str, path: str, offset: int, length: int, numel: int, *, partial: bool = False) -> Request:
    index = MetadataIndex(fqn, torch.Size([0]))
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=torch.Size([0]),
        storage_index=index,
        storage_offsets=torch.Size([1 if partial else 0]),
        lengths=torch.Size([numel - 1 if partial else numel]),
    )
    return req, _StorageInfo(path, offset, length)


def _metadata(sizes: dict[str, int]) -> Metadata:
    return Metadata(
        state_dict_metadata={
            fqn: TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([numel]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([numel]))],
            )
            for fqn, numel in sizes.items()
        }
    )


@st.composite
def layouts(draw: Any) -> tuple[dict[str, list[Request]], dict[str, list[int]], Metadata, int]:
    """Files of back-to-back items (records of 4-byte floats plus a header and
    trailer), a random subset of them requested (some partially), some with a
    raw tensor location in the manifest."""
    per_file: dict[str, list[Request]] = {}
    raw: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for f in range(draw(st.integers(1, 4))):
        path = f"__0_{f}.distcp"
        offset = 0
        reqs: list[Request] = []
        for i in range(draw(st.integers(1, 12))):
            numel = draw(st.integers(2, 3 << 20))
            header, trailer = draw(st.integers(0, 600)), draw(st.integers(0, 300))
            length = header + 4 * numel + trailer
            fqn = f"f{f}.t{i}"
            sizes[fqn] = numel
            if draw(st.booleans()):
                reqs.append(_request(fqn, path, offset, length, numel, partial=draw(st.booleans())))
            if draw(st.booleans()):
                raw[item_key(path, offset)] = [header, 4 * numel]
            offset += length + draw(st.sampled_from([0, 0, 7, 2 << 20]))  # neighbours, or a gap
        if reqs:
            per_file[path] = draw(st.permutations(reqs))  # not in file order
    return per_file, raw, _metadata(sizes), draw(st.integers(1, 9))


def _requests_in(jobs: list[Span | DirectRun]) -> list[int]:
    ids: list[int] = []
    for job in jobs:
        if isinstance(job, Span):
            ids += [id(req) for req, _ in job.reqs]
        else:
            ids += [id(d.req) for d in job.items]
    return ids


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_request_is_read_once_and_the_inputs_stay_as_they_were(
    layout: tuple[dict[str, list[Request]], dict[str, list[int]], Metadata, int],
) -> None:
    per_file, raw, metadata, workers = layout
    before = ({p: list(reqs) for p, reqs in per_file.items()}, copy.deepcopy(raw))
    jobs = plan_reads(per_file, raw, metadata, workers, "manifest")
    assert ({p: list(reqs) for p, reqs in per_file.items()}, raw) == before  # same lists, same order
    wanted = sorted(id(req) for reqs in per_file.values() for req, _ in reqs)
    assert sorted(_requests_in(jobs)) == wanted  # each exactly once
    assert [j.length for j in jobs] == sorted((j.length for j in jobs), reverse=True)
    again = plan_reads(per_file, raw, metadata, workers, "manifest")
    assert _requests_in(again) == _requests_in(jobs)
    for job in jobs:
        if isinstance(job, Span):  # one ranged read covering its items
            for _, info in job.reqs:
                assert job.offset <= info.offset and info.offset + info.length <= job.offset + job.length
        else:  # one file, in file order; whole tensors the manifest locates
            assert len({d.path for d in job.items}) == 1
            assert [d.info.offset for d in job.items] == sorted(d.info.offset for d in job.items)
            for d in job.items:
                assert raw[item_key(d.path, d.info.offset)] == [d.data_offset, d.nbytes]
                assert not any(d.req.storage_offsets)


def test_partial_and_unlocated_requests_go_through_their_records() -> None:
    whole = _request("a", "f", 0, 100, 20)
    part = _request("b", "f", 100, 100, 20, partial=True)
    unlocated = _request("c", "f", 200, 100, 20)
    raw = {item_key("f", 0): [10, 80], item_key("f", 100): [10, 80]}
    direct, rest = split_direct({"f": [whole, part, unlocated]}, raw, _metadata({"a": 20, "b": 20, "c": 20}), "m")
    assert [d.req for d in direct] == [whole[0]]
    assert rest == {"f": [part, unlocated]}


def test_a_tensor_location_outside_its_item_is_corrupt() -> None:
    req = _request("a", "f", 0, 100, 20)
    with pytest.raises(CheckpointCorrupt, match="manifest.json: tensor location .* lies outside its item"):
        split_direct({"f": [req]}, {item_key("f", 0): [40, 80]}, _metadata({"a": 20}), "manifest.json")


def test_coalesce_joins_neighbours_up_to_the_limit_in_file_order() -> None:
    reqs = [_request(str(i), "f", off, 10, 2) for i, off in enumerate([30, 0, 10, 20, 50])]
    spans = coalesce("f", reqs, limit=30)
    assert [(s.offset, s.length) for s in spans] == [(0, 30), (30, 10), (50, 10)]
    assert [info.offset for s in spans for _, info in s.reqs] == [0, 10, 20, 30, 50]
    assert [info.offset for _, info in reqs] == [30, 0, 10, 20, 50]  # not sorted in place


def test_sequential_runs_split_a_file_when_workers_outnumber_files() -> None:
    direct = [
        Direct("f", _StorageInfo("f", i * 100, 100), _request(str(i), "f", i * 100, 100, 20)[0], torch.float32, 10, 80)
        for i in range(8)
    ]
    runs = sequential_runs(list(reversed(direct)), workers=4)
    assert [[d.info.offset for d in r.items] for r in runs] == [[0, 100], [200, 300], [400, 500], [600, 700]]
    assert len(sequential_runs(direct, workers=1)) == 1


def test_scatter_groups_split_at_large_gaps() -> None:
    def at(offset: int) -> tuple[Direct]:
        return (
            Direct("f", _StorageInfo("f", offset, 100), _request("x", "f", offset, 100, 20)[0], torch.float32, 10, 80),
        )

    groups = scatter_groups([at(0), at(100), at(250), at(10_000)], gap_limit=1000)
    assert [[g[0].info.offset for g in group] for group in groups] == [[0, 100, 250], [10_000]]
