"""The host buffers of staged copies: what one looks like, how it is
allocated (one per tensor in this process's memory, or all of a set carved
from one block of shared memory: :mod:`.shared_memory`), and the pool that keeps
released sets for the next save of the same structure (see
:mod:`.staging`, "Buffer reuse").
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpstore._impl.engines.shared_memory import Slab, aligned, view_at
from dcpstore._impl.util.errors import InvalidArgument, SaveError


@dataclass(frozen=True)
class BufferSpec:
    """What one host buffer looks like (the part of the key that allocates)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: compact row-major
    dtype: torch.dtype
    pinned: bool

    @property
    def nbytes(self) -> int:
        """The bytes its memory spans (a dense layout: its elements')."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize

    def allocate(self) -> torch.Tensor:
        if self.stride is None:
            # torch.empty: no zero fill; the copy that follows touches every byte.
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pinned)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, pin_memory=self.pinned)


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers its whole storage span without gaps or overlaps
    (contiguous or permuted), so a buffer with the same strides is compact."""
    if t.numel() == 0:
        return False
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def buffer_spec(t: torch.Tensor) -> BufferSpec:
    if t.device.type == "meta":
        raise InvalidArgument("cannot stage a meta tensor: it has no data to save")
    pinned = t.device.type == "cuda"
    stride = tuple(t.stride()) if is_dense(t) and not t.is_contiguous() else None
    return BufferSpec(tuple(t.shape), stride, t.dtype, pinned)


@dataclass
class BufferSet:
    """The host buffers of one staged copy, in walk order; carved from one
    :class:`~dcpstore._impl.engines.shared_memory.Slab` (at ``offsets``) when staged in
    shared memory."""

    buffers: list[torch.Tensor]
    slab: Slab | None = None
    offsets: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        if self.slab is not None:
            return self.slab.nbytes
        return sum(b.untyped_storage().nbytes() for b in self.buffers)


class StagingPool:
    """Released buffer sets, keyed by state-dict structure; bounded (see module doc)."""

    def __init__(self, max_structures: int = 2, max_sets: int = 1) -> None:
        if max_structures < 0 or max_sets < 0:
            raise InvalidArgument("max_structures and max_sets must be >= 0")
        self.max_structures = max_structures
        self.max_sets = max_sets
        self._free: OrderedDict[Hashable, list[BufferSet]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> BufferSet | None:
        with self._lock:
            sets = self._free.get(key)
            if not sets:
                return None
            self._free.move_to_end(key)
            return sets.pop()

    def put(self, key: Hashable, buffers: BufferSet) -> None:
        with self._lock:
            sets = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(sets) < self.max_sets:
                sets.append(buffers)
            while len(self._free) > self.max_structures:
                self._free.popitem(last=False)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for sets in self._free.values() for s in sets)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def allocate_shared(specs: list[BufferSpec]) -> BufferSet:
    """One slab for every buffer, each at an aligned offset."""
    offsets, end = [], 0
    for spec in specs:
        offsets.append(end)
        end += aligned(spec.nbytes)
    try:
        slab = Slab(end, pin=any(spec.pinned for spec in specs))
    except (OSError, RuntimeError) as e:
        raise SaveError(
            f"cannot stage {len(specs)} tensor(s) for an async save: no shared memory of {end} bytes: {e}"
        ) from e
    buffers = [view_at(slab.block, offset, spec.shape, spec.stride, spec.dtype) for offset, spec in zip(offsets, specs)]
    return BufferSet(buffers, slab, offsets)


def allocate(spec: BufferSpec, path: tuple[Any, ...]) -> torch.Tensor:
    """Allocate one host buffer; a failure names the key (e.g. an expanded
    view whose logical size no host can hold)."""
    try:
        return spec.allocate()
    except RuntimeError as e:  # torch's allocator errors (OutOfMemoryError too)
        where = ".".join(map(str, path)) or "<root>"
        raise SaveError(
            f"cannot stage {where!r} for an async save: no host buffer of shape {spec.shape} "
            f"{str(spec.dtype).removeprefix('torch.')} ({spec.nbytes} bytes): {e}"
        ) from e
