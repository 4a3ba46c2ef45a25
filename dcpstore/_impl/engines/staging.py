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

One driver. :class:`Staging` is where both kinds of caller stage: the
:class:`~dcpstore.AsyncSaver` (told when each save ends) and the drop-in
writer as DCP's ``AsyncStager`` (not told: :meth:`Staging.hand_out`).

Shared memory. For an engine that writes from another process (the process
engine) a set is staged into one block of shared memory
(:class:`~dcpstore._impl.engines.shared_memory.Slab`) instead of one buffer per tensor, and
:attr:`StagedState.shared` describes the copy as that process rebuilds it
(:class:`SharedState`: the skeleton and each buffer's offset).
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

from dcpstore._impl.dcp.state_checks import check_saveable, is_stateful
from dcpstore._impl.engines.buffers import BufferSet, BufferSpec, StagingPool, allocate, allocate_shared, buffer_spec
from dcpstore._impl.engines.shared_memory import Slab, view_at
from dcpstore._impl.format.bitcopy import copy_values
from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.torch_compat import Shard, ShardedTensor, storage_use_count

try:  # DTensor and ShardedTensor exist on every torch that dcpstore supports,
    from torch.distributed.tensor import DTensor  # but keep import failures local.
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

#: Values that are immutable: staged by reference.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


@dataclass
class _Walk:
    """State of one staging pass: the structure key and the copies to make."""

    key: list[Hashable] = field(default_factory=list)
    specs: list[BufferSpec] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    paths: list[tuple[Any, ...]] = field(default_factory=list)  # per buffer, for messages
    seen: dict[int, int] = field(default_factory=dict)  # id(tensor) -> buffer index


@dataclass(frozen=True)
class SharedState:
    """A staged copy in shared memory, as another process rebuilds it: the
    state dict's skeleton (placeholders where the buffers go; DTensor and
    ShardedTensor wrappers with their metadata; every other value as
    staged), and each buffer's place in the slab. Picklable; the slab's
    memory goes by file descriptor (:mod:`.shared_memory`)."""

    slab_id: int
    slab_nbytes: int
    skeleton: Any
    layout: tuple[tuple[int, BufferSpec], ...]

    def rebuild(self, block: torch.Tensor) -> dict[str, Any]:
        """The state dict over ``block``, this process's mapping of the slab."""
        buffers = [view_at(block, offset, spec.shape, spec.stride, spec.dtype) for offset, spec in self.layout]
        state: dict[str, Any] = _fill(self.skeleton, buffers)
        return state


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
        buffers: BufferSet,
        pool: StagingPool | None,
        watched: list[tuple[StorageWeakRef, int]],
        shared: SharedState | None = None,
    ) -> None:
        self.state_dict = state_dict
        self.key = key
        self.nbytes = buffers.nbytes
        self._buffers: BufferSet | None = buffers
        self._pool = pool
        #: Each buffer's storage and its reference count when only the
        #: buffers held it (see _watch).
        self._watched = watched
        #: The copy as another process rebuilds it (staged with ``shared=True``).
        self.shared = shared

    @property
    def slab(self) -> Slab | None:
        """The shared memory the buffers live in (staged with ``shared=True``)."""
        return self._buffers.slab if self._buffers is not None else None

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


class Stager:
    """Stages state dicts into pooled host buffers (see the module docstring).

    ``alias_cpu=True`` skips copying CPU tensors (CUDA tensors are still
    moved to host memory): only for callers that block until the write is
    done, i.e. synchronous saves through a background engine. ``shared=True``
    stages every tensor into one block of shared memory that another
    process can map (:mod:`.shared_memory`; :attr:`StagedState.shared` says how it
    rebuilds the state dict), and copies CPU tensors whatever ``alias_cpu``
    says.
    """

    def __init__(self, pool: StagingPool | None = None) -> None:
        self.pool = pool if pool is not None else StagingPool()

    @torch.no_grad()
    def stage(self, state_dict: Mapping[str, Any], *, alias_cpu: bool = False, shared: bool = False) -> StagedState:
        walk = _Walk()
        resolved = {k: (v.state_dict() if is_stateful(v) else v) for k, v in state_dict.items()}
        check_saveable(resolved)
        skeleton = self._walk(resolved, (), walk, alias_cpu and not shared)
        key = ("shared" if shared else "private", tuple(walk.key))
        taken = self.pool.take(key) if walk.specs else None
        if taken is not None:
            buffers = taken
        elif shared:
            buffers = allocate_shared(walk.specs)
        else:
            buffers = BufferSet([allocate(spec, path) for spec, path in zip(walk.specs, walk.paths)])
        self._copy(buffers.buffers, walk.sources)
        watched = _watch(buffers.buffers)
        # The state dict gets aliases (one per buffer, so tied tensors stay
        # one object): each holds a reference of its own, which in_use counts.
        staged = _fill(skeleton, [b.detach() for b in buffers.buffers])
        portable = None
        if buffers.slab is not None:
            layout = tuple(zip(buffers.offsets, walk.specs))
            portable = SharedState(buffers.slab.id, buffers.slab.nbytes, skeleton, layout)
        return StagedState(staged, key, buffers, self.pool if walk.specs else None, watched, portable)

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
            return _AsDTensor([local], spec)
        if ShardedTensor is not None and isinstance(t, ShardedTensor):
            shards = t.local_shards()
            locals_ = [self._leaf(s.tensor, (*path, i), walk, alias_cpu) for i, s in enumerate(shards)]
            walk.key.append((path, "sharded", repr(t.metadata())))
            return _AsSharded(locals_, [s.metadata for s in shards], t.metadata(), t._process_group)
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
        spec = buffer_spec(t)
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
            if src.device.type == "cuda":  # pragma: no cover - needs a GPU (tests/integration/test_cuda.py)
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


class Staging:
    """Where every staging of dcpstore's is driven: a :class:`Stager` over a
    bounded :class:`StagingPool`, for a caller that knows when the save of
    a staged set is over (:meth:`stage`, then the set's ``release()``: an
    :class:`~dcpstore.AsyncSaver`) and for one that is not told
    (:meth:`hand_out`: the drop-in writer as DCP's ``AsyncStager``)."""

    def __init__(self, max_structures: int = 2, max_sets: int = 1) -> None:
        self.pool = StagingPool(max_structures=max_structures, max_sets=max_sets)
        self._stager = Stager(self.pool)
        #: Sets handed out that a save may still read (see :meth:`hand_out`).
        self._handed: list[StagedState] = []
        self._lock = threading.Lock()

    def stage(self, state_dict: Mapping[str, Any], *, alias_cpu: bool = False, shared: bool = False) -> StagedState:
        """A staged copy (:meth:`Stager.stage`); release it when its save is over."""
        return self._stager.stage(state_dict, alias_cpu=alias_cpu, shared=shared)

    def hand_out(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A staged copy of ``state_dict`` for a save this object is told
        nothing about (saves may overlap, on either of DCP's executors, and
        the writing may happen in another process): a set goes back to the
        pool only once nothing but this object references its memory
        (:meth:`StagedState.in_use`), i.e. every save that could still read
        it has dropped it; until then the next staging allocates its own."""
        if self.pool.max_structures == 0:
            return self._stager.stage(state_dict).hand_out()
        with self._lock:
            busy = []
            for staged in self._handed:
                if staged.in_use():
                    busy.append(staged)
                else:
                    staged.release()  # back to the pool for this copy
            staged = self._stager.stage(state_dict)
            self._handed = [*busy, staged]
            return staged.hand_out()

    def clear(self) -> None:
        """Drop every buffer kept for later saves (sets a save still holds
        stay its own until it drops them)."""
        with self._lock:
            self._handed = []
            self.pool.clear()


def _use_count() -> Any:
    """torch's count of the strong references to a storage (None where this
    torch has none)."""
    return storage_use_count()


def _watch(buffers: list[torch.Tensor]) -> list[tuple[StorageWeakRef, int]]:
    """A weak reference to each buffer's storage and its reference count now,
    while only the caller's buffer list (and the storage object torch keeps
    for it) holds it: a larger count later means another holder."""
    refs = [StorageWeakRef(b.untyped_storage()) for b in buffers]  # type: ignore[no-untyped-call]  # torch leaves it untyped
    count = _use_count()
    return [(ref, count(ref.cdata) if count is not None else 0) for ref in refs]


@dataclass
class _Slot:
    """Placeholder in the skeleton for buffer ``index``."""

    index: int


@dataclass
class _Rewrap:
    """Placeholder for a wrapper (DTensor, ShardedTensor) around staged
    locals; picklable, for :class:`SharedState`."""

    parts: list[Any]

    def build(self, *tensors: torch.Tensor) -> Any:
        raise NotImplementedError


@dataclass
class _AsDTensor(_Rewrap):
    spec: Any

    def build(self, *tensors: torch.Tensor) -> Any:
        return DTensor(tensors[0], self.spec, requires_grad=False)  # type: ignore[no-untyped-call]


@dataclass
class _AsSharded(_Rewrap):
    metas: list[Any]
    metadata: Any
    #: The tensor's group here; rebuilt elsewhere, the default group there.
    process_group: Any

    def build(self, *tensors: torch.Tensor) -> Any:
        shards = [Shard(x, m) for x, m in zip(tensors, self.metas)]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, self.metadata, process_group=self.process_group
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process_group": None}  # a group is this process's only


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
