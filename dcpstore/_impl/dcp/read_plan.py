"""How a load reads: pure functions from DCP's read requests to read jobs.

The reader (:mod:`dcpstore._impl.dcp.reader`) groups its plan's requests by data
file and hands them here; :func:`plan_reads` returns the jobs its threads
run, largest first:

* :class:`DirectRun` -- tensors whose raw bytes the manifest locates
  (:func:`split_direct`), read straight into their destinations, one
  run of neighbouring tensors of a file per worker
  (:func:`sequential_runs`), each run read with as few scatter reads as
  the gaps between its items allow (:func:`scatter_groups`);
* :class:`Span` -- everything else: neighbouring items of a file read with
  one ranged read of at most :data:`COALESCE_LIMIT` bytes (:func:`coalesce`).

Every function returns new values and leaves its inputs as they were, and
every request lands in exactly one job (``tests/unit/test_read_plan.py`` checks
both), so the order in which the reader calls them cannot make it read an
item twice or not at all.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dcpstore._impl.format.layout import item_key
from dcpstore._impl.storage.byte_ranges import ceil_div
from dcpstore._impl.util.errors import CheckpointCorrupt
from dcpstore._impl.util.torch_compat import StorageInfo

#: One read request and where its item lies.
Request = tuple[ReadItem, StorageInfo]

MiB = 1 << 20
#: Neighbouring items of one file are read together up to this many bytes.
COALESCE_LIMIT = 64 * MiB
#: Neighbouring tensors further apart than this are read separately rather
#: than through a scratch buffer for the bytes between them.
SCATTER_GAP_LIMIT = 1 * MiB


@dataclass(frozen=True)
class Span:
    """One ranged read covering neighbouring items of one file."""

    path: str
    offset: int
    length: int
    reqs: tuple[Request, ...]


@dataclass(frozen=True)
class Direct:
    """One tensor read straight into its destination."""

    path: str
    info: StorageInfo
    req: ReadItem
    dtype: torch.dtype  # as stored
    data_offset: int  # of the tensor's bytes, within the item
    nbytes: int

    @property
    def length(self) -> int:
        return int(self.info.length)

    @property
    def start(self) -> int:
        """Where the tensor's bytes start in the file."""
        return int(self.info.offset + self.data_offset)

    @property
    def end(self) -> int:
        """Where the item (its record) ends in the file."""
        return int(self.info.offset + self.info.length)


@dataclass(frozen=True)
class DirectRun:
    """Direct reads of one file, in file order, for one worker: each worker
    then streams through its own stretch of a file, as a plain sequential
    reader would (measured faster from a cold cache than items dealt out
    across files)."""

    items: tuple[Direct, ...]

    @property
    def length(self) -> int:
        return sum(d.length for d in self.items)


def plan_reads(
    per_file: Mapping[str, Sequence[Request]],
    raw: Mapping[str, Sequence[int]],
    metadata: Metadata,
    workers: int,
    where: str,
) -> list[Span | DirectRun]:
    """The read jobs for ``per_file`` (path -> requests), largest first.

    ``raw`` is the manifest's ``tensors`` (item key -> [offset of the
    tensor's bytes in the item, nbytes]; empty: every item goes through its
    record); ``where`` names the manifest in errors.
    """
    direct, rest = split_direct(per_file, raw, metadata, where)
    jobs: list[Span | DirectRun] = [span for path, reqs in rest.items() for span in coalesce(path, reqs)]
    jobs += sequential_runs(direct, workers)
    # Stable: ties keep spans before runs.
    return sorted(jobs, key=operator.attrgetter("length"), reverse=True)


def split_direct(
    per_file: Mapping[str, Sequence[Request]], raw: Mapping[str, Sequence[int]], metadata: Metadata, where: str
) -> tuple[list[Direct], dict[str, list[Request]]]:
    """Split the requests into those that read a whole tensor whose raw bytes
    ``raw`` locates (read straight into their destination) and the rest,
    per file. Raises :class:`CheckpointCorrupt` for a location outside its
    item."""
    direct: list[Direct] = []
    rest: dict[str, list[Request]] = {}
    for path, reqs in per_file.items():
        keep: list[Request] = []
        for req, info in reqs:
            entry = raw.get(item_key(path, info.offset))
            if entry is not None and not 0 <= entry[0] <= entry[0] + entry[1] <= info.length:
                raise CheckpointCorrupt(
                    f"{where}: tensor location {list(entry)} lies outside its item "
                    f"({path} at offset {info.offset}, {info.length} bytes)"
                )
            dtype = whole_tensor_dtype(req, metadata, entry[1]) if entry is not None else None
            if entry is not None and dtype is not None:
                direct.append(Direct(path, info, req, dtype, entry[0], entry[1]))
            else:
                keep.append((req, info))
        if keep:
            rest[path] = keep
    return direct, rest


def whole_tensor_dtype(req: ReadItem, metadata: Metadata, nbytes: int) -> torch.dtype | None:
    """The stored dtype, if ``req`` asks for the whole stored tensor of
    ``nbytes`` bytes (else None)."""
    if req.type != LoadItemType.TENSOR or any(req.storage_offsets):
        return None
    md = metadata.state_dict_metadata.get(req.storage_index.fqn)
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    numel = 1
    for n in req.lengths:
        numel *= n
    # A sub-box that starts at 0 and is as large as the stored chunk is all of it.
    return dtype if numel * dtype.itemsize == nbytes else None


def coalesce(path: str, reqs: Sequence[Request], limit: int = COALESCE_LIMIT) -> list[Span]:
    """Ranged reads covering ``reqs`` (items of file ``path``), in file
    order: neighbouring or overlapping items share one read while it stays
    within ``limit`` bytes."""
    groups: list[tuple[int, int, list[Request]]] = []  # (offset, length, requests)
    for req, info in sorted(reqs, key=lambda r: r[1].offset):
        end = info.offset + info.length
        if groups:
            offset, length, members = groups[-1]
            if info.offset <= offset + length and end - offset <= limit:
                groups[-1] = (offset, max(length, end - offset), [*members, (req, info)])
                continue
        groups.append((info.offset, info.length, [(req, info)]))
    return [Span(path, offset, length, tuple(members)) for offset, length, members in groups]


def sequential_runs(direct: Sequence[Direct], workers: int) -> list[DirectRun]:
    """Split each file's direct reads, in offset order, into runs of about
    equal bytes: one run per file, or more when workers outnumber files."""
    per_file: dict[str, list[Direct]] = defaultdict(list)
    for d in direct:
        per_file[d.path].append(d)
    per_worker = ceil_div(workers, max(1, len(per_file)))
    runs: list[DirectRun] = []
    for items in per_file.values():
        ordered = sorted(items, key=lambda d: d.info.offset)
        share = ceil_div(sum(d.length for d in ordered), per_worker)
        run: list[Direct] = []
        run_bytes = 0
        for d in ordered:
            run.append(d)
            run_bytes += d.length
            if run_bytes >= share:
                runs.append(DirectRun(tuple(run)))
                run, run_bytes = [], 0
        if run:
            runs.append(DirectRun(tuple(run)))
    return runs


Placed = TypeVar("Placed", bound=tuple[Any, ...])


def scatter_groups(placed: Sequence[Placed], gap_limit: int = SCATTER_GAP_LIMIT) -> list[list[Placed]]:
    """Split file-ordered direct reads (tuples whose first element is the
    :class:`Direct`) where the gap between neighbouring items exceeds
    ``gap_limit`` bytes: each group is read with one scatter read."""
    groups: list[list[Placed]] = []
    end = -1
    for entry in placed:
        d: Direct = entry[0]
        if groups and 0 <= d.info.offset - end <= gap_limit:
            groups[-1].append(entry)
        else:
            groups.append([entry])
        end = d.end
    return groups
