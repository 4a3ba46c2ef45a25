"""Staging: a consistent host-memory snapshot of a state dict.

An async save returns once its state is *staged*; from then on the caller may
mutate its tensors in place and the checkpoint still holds the values at call
time. Staging therefore copies every tensor (never aliases one, not even a
CPU tensor: aliasing is the bug of NVRx PR #376 and pytorch #144657) and
deep-copies every other value.

Per leaf of the state dict (nested dicts, lists and tuples are walked):

* CPU tensor -> ``copy_`` into a host buffer of the same shape and dtype. Dense
  tensors keep their strides; views of a larger storage get a compact buffer,
  so the writer never serialises the whole base storage.
* CUDA tensor -> a *pinned* host buffer, ``copy_(non_blocking=True)`` on the
  caller's current stream of its device (so the copy is ordered after the
  work that produced the values); once every copy is queued, one wait per
  device on that stream. The wait covers exactly the copies: other streams'
  work (a prefetch, a collective) does not lengthen the caller's block.
* DTensor -> its local shard is staged and re-wrapped with the same spec
  (mesh, placements, global shape): DCP's planner needs that metadata. A
  ShardedTensor likewise keeps its metadata around staged local shards.
* ``Stateful`` values at the top level -> ``state_dict()`` is called now, on
  the caller's thread, as ``dcp.save`` would, and the result is staged.
* anything else -> a pickle round trip (DCP pickles these values anyway).

The same tensor object appearing twice (tied weights) is staged once and
stays shared in the snapshot.

Buffer reuse. Host buffers are keyed by the *structure* of the state dict
(the path, kind, device type, shape, dtype and layout of every tensor leaf,
and the paths of the other leaves). :class:`StagingPool` keeps released
buffer sets for the ``max_structures`` most recently used structures, at
most ``max_sets`` per structure, so repeated saves of one model stage into
the same, already-faulted-in memory: no allocation, no page faults, flat RSS.
Memory held between saves is bounded by ``max_structures * max_sets`` state
copies; :meth:`StagingPool.clear` drops it all. A caller that cannot tell
when the save of a staged set is over (DCP's ``AsyncStager`` protocol says
nothing about it) asks :meth:`StagedState.in_use`: whether anything but the
set itself still references its memory.

Layer: engines. Imports only :mod:`dcpstore.errors`.
"""

from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..dcp.state_checks import check_saveable
from ..errors import InvalidArgument, SaveError
from ..format.bitcopy import copy_values

try:  # DTensor and ShardedTensor exist on every torch that dcpstore supports,
    from torch.distributed.tensor import DTensor  # but keep import failures local.
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]
try:
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    Shard = ShardedTensor = None  # type: ignore[assignment,misc]
from torch.distributed.checkpoint.stateful import Stateful

#: Values that are immutable: staged by reference.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


@dataclass(frozen=True)
class _BufferSpec:
    """What one host buffer looks like (the part of the key that allocates)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...] | None  # None: compact row-major
    dtype: torch.dtype
    pinned: bool

    def allocate(self) -> torch.Tensor:
        if self.stride is None:
            # torch.empty: no zero fill; the copy that follows touches every byte.
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pinned)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, pin_memory=self.pinned)


def _is_dense(t: torch.Tensor) -> bool:
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


def _buffer_spec(t: torch.Tensor) -> _BufferSpec:
    if t.device.type == "meta":
        raise InvalidArgument("cannot stage a meta tensor: it has no data to save")
    pinned = t.device.type == "cuda"
    stride = tuple(t.stride()) if _is_dense(t) and not t.is_contiguous() else None
    return _BufferSpec(tuple(t.shape), stride, t.dtype, pinned)


@dataclass
class _Walk:
    """State of one staging pass: the structure key and the copies to make."""

    key: list[Hashable] = field(default_factory=list)
    specs: list[_BufferSpec] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    paths: list[tuple[Any, ...]] = field(default_factory=list)  # per buffer, for messages
    seen: dict[int, int] = field(default_factory=dict)  # id(tensor) -> buffer index


class StagedState:
    """A staged snapshot: ``state_dict`` (host memory only) plus its buffers.

    Call :meth:`release` once nothing reads ``state_dict`` any more (the save
    is committed or failed); the buffers then go back to the pool and the
    next staging of the same structure overwrites them.
    """

    def __init__(
        self,
        state_dict: dict[str, Any],
        key: Hashable,
        buffers: list[torch.Tensor],
        pool: StagingPool | None,
        watched: list[tuple[StorageWeakRef, int]],
    ) -> None:
        self.state_dict = state_dict
        self.key = key
        self.nbytes = sum(b.untyped_storage().nbytes() for b in buffers)
        self._buffers: list[torch.Tensor] | None = buffers
        self._pool = pool
        #: Each buffer's storage and its reference count when only the
        #: buffers held it (see _watch).
        self._watched = watched

    def hand_out(self) -> dict[str, Any]:
        """``state_dict``, for a save this object is not told the end of:
        this object keeps only the buffers, so that :meth:`in_use` is true
        exactly while something else (the save) still references them
        (the state dict's tensors are aliases of the buffers, not the
        buffer tensors themselves)."""
        state_dict, self.state_dict = self.state_dict, {}
        return state_dict

    def in_use(self) -> bool:
        """Whether anything but this object's buffers references their
        memory: a tensor of the staged state dict (held here until
        :meth:`hand_out`), a view of one, one that a pickler shares with
        another process. False once every such reference is gone, and then
        nothing can read the buffers but this object. Where torch cannot
        count the references, always True (never reused)."""
        if self._buffers is None:
            return False
        count = _use_count()
        if count is None:  # pragma: no cover - every torch dcpstore supports has it
            return True
        return any(count(ref.cdata) > own for ref, own in self._watched)

    def release(self) -> None:
        buffers, self._buffers = self._buffers, None
        self.state_dict = {}
        self._watched = []
        if buffers is not None and self._pool is not None:
            self._pool.put(self.key, buffers)


class StagingPool:
    """Released buffer sets, keyed by state-dict structure; bounded (see module doc)."""

    def __init__(self, max_structures: int = 2, max_sets: int = 1) -> None:
        if max_structures < 0 or max_sets < 0:
            raise InvalidArgument("max_structures and max_sets must be >= 0")
        self.max_structures = max_structures
        self.max_sets = max_sets
        self._free: OrderedDict[Hashable, list[list[torch.Tensor]]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> list[torch.Tensor] | None:
        with self._lock:
            sets = self._free.get(key)
            if not sets:
                return None
            self._free.move_to_end(key)
            return sets.pop()

    def put(self, key: Hashable, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            sets = self._free.setdefault(key, [])
            self._free.move_to_end(key)
            if len(sets) < self.max_sets:
                sets.append(buffers)
            while len(self._free) > self.max_structures:
                self._free.popitem(last=False)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.untyped_storage().nbytes() for sets in self._free.values() for s in sets for b in s)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class Stager:
    """Stages state dicts into pooled host buffers (see the module docstring).

    ``alias_cpu=True`` skips copying CPU tensors (CUDA tensors are still
    moved to host memory): only for callers that block until the write is
    done, i.e. synchronous saves through a background engine.
    """

    def __init__(self, pool: StagingPool | None = None) -> None:
        self.pool = pool if pool is not None else StagingPool()

    @torch.no_grad()
    def stage(self, state_dict: Mapping[str, Any], *, alias_cpu: bool = False) -> StagedState:
        walk = _Walk()
        resolved = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}
        check_saveable(resolved)
        skeleton = self._walk(resolved, (), walk, alias_cpu)
        key = tuple(walk.key)
        buffers = self.pool.take(key) if walk.specs else []
        if buffers is None:
            buffers = [_allocate(spec, path) for spec, path in zip(walk.specs, walk.paths)]
        self._copy(buffers, walk.sources)
        watched = _watch(buffers)
        # The state dict gets aliases (one per buffer, so tied tensors stay
        # one object): each holds a reference of its own, which in_use counts.
        staged = _fill(skeleton, [b.detach() for b in buffers])
        return StagedState(staged, key, buffers, self.pool if walk.specs else None, watched)

    # -- walk: build the key, the skeleton and the list of copies ----------
    def _walk(self, obj: Any, path: tuple[Any, ...], walk: _Walk, alias_cpu: bool) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._walk_tensor(obj, path, walk, alias_cpu)
        if type(obj) is dict or type(obj) is OrderedDict:
            return type(obj)((k, self._walk(v, (*path, k), walk, alias_cpu)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(self._walk(v, (*path, i), walk, alias_cpu) for i, v in enumerate(obj))
        walk.key.append((path, "obj"))
        if isinstance(obj, _ATOMIC):
            return obj
        try:
            return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as e:
            where = ".".join(map(str, path)) or "<root>"
            raise InvalidArgument(
                f"state_dict value at {where!r} ({type(obj).__name__}) cannot be snapshotted: "
                f"it is not picklable ({e}); DCP needs to pickle it too"
            ) from e

    def _walk_tensor(self, t: torch.Tensor, path: tuple[Any, ...], walk: _Walk, alias_cpu: bool) -> Any:
        if DTensor is not None and isinstance(t, DTensor):
            local = self._leaf(t._local_tensor, path, walk, alias_cpu)
            spec = t._spec
            walk.key.append((path, "dtensor", tuple(t.shape), repr(spec.placements), tuple(spec.mesh.shape)))
            return _Rewrap(lambda loc, spec=spec: DTensor(loc, spec, requires_grad=False), [local])  # type: ignore[no-untyped-call]
        if ShardedTensor is not None and isinstance(t, ShardedTensor):
            shards = t.local_shards()
            locals_ = [self._leaf(s.tensor, (*path, i), walk, alias_cpu) for i, s in enumerate(shards)]
            walk.key.append((path, "sharded", repr(t.metadata())))
            metas = [s.metadata for s in shards]
            md, pg = t.metadata(), t._process_group

            def rebuild(*tensors: torch.Tensor) -> Any:
                return ShardedTensor._init_from_local_shards_and_global_metadata(
                    [Shard(x, m) for x, m in zip(tensors, metas)], md, process_group=pg
                )

            return _Rewrap(rebuild, locals_)
        # Plain tensors, Parameters and other subclasses: DCP writes their data.
        return self._leaf(t, path, walk, alias_cpu)

    def _leaf(self, t: torch.Tensor, path: tuple[Any, ...], walk: _Walk, alias_cpu: bool) -> Any:
        ident = id(t)  # before detach(), which makes a new object every call
        t = t.detach()
        if alias_cpu and t.device.type == "cpu":
            walk.key.append((path, "alias-cpu"))
            return t
        seen = walk.seen.get(ident)
        if seen is not None:  # the same tensor twice (tied weights): stage once
            walk.key.append((path, "same-as", seen))
            return _Slot(seen)
        if t.is_quantized:
            # No pooled buffer: an empty quantized tensor has no quantizer
            # for copy_ to fill. A fresh host copy keeps scale and zero point.
            walk.key.append((path, "quantized"))
            return t.to("cpu", copy=True)
        spec = _buffer_spec(t)
        index = len(walk.specs)
        walk.seen[ident] = index
        walk.specs.append(spec)
        walk.sources.append(t)
        walk.paths.append(path)
        walk.key.append((path, t.device.type, spec))
        return _Slot(index)

    # -- copy ----------------------------------------------------------------
    @staticmethod
    def _copy(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for buf, src in zip(buffers, sources):
            if src.device.type == "cuda":  # pragma: no cover - needs a GPU (tests/test_cuda.py)
                if src.is_conj() or src.is_neg():
                    # For a conjugate or negative view torch queues the raw
                    # bytes and then fixes the bits up *on the host* at once,
                    # racing its own non-blocking copy (aten/native/cuda/Copy.cu):
                    # resolve them on the device, in stream order, instead.
                    src = src.resolve_conj().resolve_neg()
                copy_values(buf, src, non_blocking=True)  # on the current stream of src's device
                if src.device not in streams:
                    streams[src.device] = torch.cuda.current_stream(src.device)
            else:
                copy_values(buf, src)
        # One wait per device, after every copy is queued.
        for stream in streams.values():  # pragma: no cover - needs a GPU
            stream.synchronize()


def _use_count() -> Any:
    """torch's count of the strong references to a storage (None where this
    torch has none)."""
    return getattr(torch._C, "_storage_Use_Count", None)


def _watch(buffers: list[torch.Tensor]) -> list[tuple[StorageWeakRef, int]]:
    """A weak reference to each buffer's storage and its reference count now,
    while only the caller's buffer list (and the storage object torch keeps
    for it) holds it: a larger count later means another holder."""
    refs = [StorageWeakRef(b.untyped_storage()) for b in buffers]  # type: ignore[no-untyped-call]  # torch leaves it untyped
    count = _use_count()
    return [(ref, count(ref.cdata) if count is not None else 0) for ref in refs]


def _allocate(spec: _BufferSpec, path: tuple[Any, ...]) -> torch.Tensor:
    """Allocate one host buffer; a failure names the key (e.g. an expanded
    view whose logical size no host can hold)."""
    try:
        return spec.allocate()
    except RuntimeError as e:  # torch's allocator errors (OutOfMemoryError too)
        where = ".".join(map(str, path)) or "<root>"
        numel = 1
        for dim in spec.shape:
            numel *= dim
        raise SaveError(
            f"cannot stage {where!r} for an async save: no host buffer of shape {spec.shape} "
            f"{str(spec.dtype).removeprefix('torch.')} ({numel * spec.dtype.itemsize} bytes): {e}"
        ) from e


@dataclass
class _Slot:
    """Placeholder in the skeleton for buffer ``index``."""

    index: int


@dataclass
class _Rewrap:
    """Placeholder for a wrapper (DTensor, ShardedTensor) around staged locals."""

    build: Any
    parts: list[Any]


def _fill(obj: Any, buffers: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return buffers[obj.index]
    if isinstance(obj, _Rewrap):
        return obj.build(*[_fill(p, buffers) for p in obj.parts])
    if type(obj) is dict or type(obj) is OrderedDict:
        return type(obj)((k, _fill(v, buffers)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, buffers) for v in obj)
    return obj
