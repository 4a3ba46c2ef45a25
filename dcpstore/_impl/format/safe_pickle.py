"""Restricted unpicklers: ``.metadata`` and non-tensor items without running code.

Stock DCP reads ``.metadata`` with ``pickle.load`` and every non-tensor item
with ``torch.load(weights_only=False)``: a crafted checkpoint runs its payload
on load. Here every global a pickle names must be on an allowlist, so what
an unpickle can build is fixed in advance and nothing of the checkpoint's
choosing is ever called:

- ``.metadata`` (:func:`load_metadata`): DCP's metadata dataclasses,
  ``torch.Size``, dtypes, layouts, devices, ``pathlib`` paths (the
  ``checkpoint_id`` stock DCP records), the path classes other writers
  record there (MSC's ``MultiStoragePath``), read as inert data without
  importing their module or running their code (:mod:`.peer_paths` says
  how and which) and builtin containers -- what torch
  2.6 and newer write for plain tensors, DTensor, ShardedTensor, bytes items
  and flattened or nested state dicts (the tests check it against the pickles
  torch writes). It is then validated field by field
  (:func:`validate_metadata`), so that a damaged or crafted file is a
  :class:`CheckpointCorrupt` naming the field, never an ``AttributeError``
  deep in DCP.
- non-tensor items (:func:`load_object`): torch's own ``weights_only``
  allowlist plus the plain values training state holds (sets, deques,
  ``datetime``, ``Decimal``, numpy arrays and RNG states, ``argparse.Namespace``).

Anything else raises :class:`UnsafeCheckpoint` naming the item and the class,
and how to opt in: ``safe_globals=[cls]`` for named classes, ``trusted=True``
for all (:class:`Trust`). The command line tools never opt in.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import collections
import datetime
import decimal
import fractions
import functools
import io
import os
import pathlib
import pickle
import sys
import types
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, cast

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpstore._impl.format.manifest import StoredItem, check_relative_name
from dcpstore._impl.format.peer_paths import stand_ins
from dcpstore._impl.format.record import BYTES_ITEM_LIMIT
from dcpstore._impl.storage.base import Storage
from dcpstore._impl.util.errors import CheckpointCorrupt, UnsafeCheckpoint
from dcpstore._impl.util.torch_compat import (
    MEM_FORMAT_ENCODING,
    StorageInfo,
    get_layout,
    sharded_tensor_metadata,
    weights_only_globals,
)
from dcpstore._impl.values.options import check_safe_globals, check_trusted

#: A tensor item's ``torch.save`` record is its bytes plus ~1.5 KiB of zip
#: and pickle; an item declared larger than its tensor by more than this is
#: refused before anything is read (a 4-element tensor declared as a 3 GiB
#: item of a sparse file would otherwise be read in full).
RECORD_SLACK = 1 << 20
#: Non-tensor items larger than this are checked to end as a torch.save
#: record does (a zip end record: its last 22 bytes) before they are read.
RECORD_PEEK_MIN = 16 << 20
_ZIP_END = b"PK\x05\x06"
_ZIP_END_SIZE = 22


def _name_of(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


@dataclass(frozen=True)
class Trust:
    """What a caller lets an unpickle build beyond the built-in allowlists.

    ``extra``: ``"module.Name" -> object`` from ``safe_globals``; ``trusted``:
    no restriction at all; ``can_opt_in``: False for the command line tools,
    whose errors then say they never unpickle such content.
    """

    extra: Mapping[str, Any] = field(default_factory=dict)
    trusted: bool = False
    can_opt_in: bool = True

    @classmethod
    def of(cls, safe_globals: Iterable[Any] | None = None, trusted: bool = False) -> Trust:
        """From ``load``'s ``safe_globals`` / ``trusted`` arguments (validated
        as :class:`~dcpstore._impl.values.options.LoadOptions` validates them)."""
        check_trusted(trusted)
        extra: dict[str, Any] = {}
        for entry in check_safe_globals(safe_globals):
            if isinstance(entry, tuple):
                extra[entry[1]] = entry[0]  # (obj, "module.Name"), as torch.serialization takes them
            else:
                extra[_name_of(entry)] = entry
        return cls(extra=extra, trusted=trusted)


#: The CLI (inspect, verify): built-in allowlists only, and it says so.
TOOLS = Trust(can_opt_in=False)


def _refusal(subject: str, name: str, trust: Trust) -> UnsafeCheckpoint:
    if trust.can_opt_in:
        how = f"pass safe_globals=[{name}] (or trusted=True) if you trust this checkpoint"
    else:
        how = (
            "dcpstore's tools never unpickle what is not on its allowlist; "
            f"dcpstore.load(..., safe_globals=[{name}]) loads it if you trust this checkpoint"
        )
    return UnsafeCheckpoint(f"{subject} holds class {name}: {how}")


class _Refused(Exception):
    """Raised inside an unpickle; becomes :class:`UnsafeCheckpoint` outside."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose every global comes from ``allowed`` (a class attribute
    of the subclass built per load). Persistent ids only where the loader
    sets ``persistent_load`` (torch.load, for a record's storages); plain
    pickle refuses them otherwise."""

    allowed: Mapping[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 (torch.save's) names Python 2 modules: map them as
        # pickle's own find_class does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        key = f"{module}.{name}"
        if key in self.allowed:
            return self.allowed[key]
        raise _Refused(key)


def _unpickler(allowed: Mapping[str, Any]) -> type[_RestrictedUnpickler]:
    return type("Unpickler", (_RestrictedUnpickler,), {"allowed": allowed})


def _paths(*, pure: bool) -> dict[str, Any]:
    """``pathlib`` classes under both the names Python <= 3.12 and >= 3.13
    pickle them as; ``pure``: map the other OS's concrete class to its pure
    twin (a Windows-written ``checkpoint_id`` loads on Linux)."""
    out: dict[str, Any] = {}
    for name in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath"):
        cls: Any = getattr(pathlib, name)
        if pure and name in ("PosixPath", "WindowsPath") and name != type(pathlib.Path()).__name__:
            cls = getattr(pathlib, "Pure" + name)
        out[f"pathlib.{name}"] = out[f"pathlib._local.{name}"] = cls
    return out


@functools.cache
def _metadata_globals() -> dict[str, Any]:
    classes: list[Any] = [
        Metadata,
        MetadataIndex,
        ChunkStorageMetadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        TensorProperties,
        StorageMeta,
        MEM_FORMAT_ENCODING,
        StorageInfo,
        # torch <= 2.1 pickled TensorProperties from the sharded-tensor module.
        sharded_tensor_metadata.TensorProperties,
        sharded_tensor_metadata.MEM_FORMAT_ENCODING,
        torch.Size,
        torch.device,
        get_layout,  # how every torch.layout pickles
        collections.OrderedDict,
        set,
        frozenset,
    ]
    allowed = {_name_of(c): c for c in classes}
    allowed.update((f"torch.{name}", v) for name, v in vars(torch).items() if isinstance(v, torch.dtype))
    allowed.update(_paths(pure=True))
    allowed.update(stand_ins())
    return allowed


def _safe_bytearray(*args: Any) -> bytearray:
    # bytearray(n) would allocate n bytes from one small int in the pickle.
    if args and isinstance(args[0], int):
        raise pickle.UnpicklingError("bytearray(int) is not allowed (it allocates without data)")
    return bytearray(*args)


def _safe_bytes(*args: Any) -> bytes:
    # Pickle protocol 2 (torch.save's) writes an empty bytes as a call to
    # builtins.bytes(); bytes(n) would allocate n bytes, as bytearray(n).
    if args and isinstance(args[0], int):
        raise pickle.UnpicklingError("bytes(int) is not allowed (it allocates without data)")
    return bytes(*args)


@functools.cache
def _item_globals() -> dict[str, Any]:
    allowed = weights_only_globals()
    allowed["builtins.bytearray"] = _safe_bytearray
    allowed["builtins.bytes"] = _safe_bytes
    plain: list[Any] = [
        set,
        frozenset,
        complex,
        slice,
        list,
        dict,
        tuple,
        int,
        float,
        str,
        bool,
        collections.OrderedDict,
        collections.Counter,
        collections.defaultdict,
        collections.deque,
        datetime.datetime,
        datetime.date,
        datetime.time,
        datetime.timedelta,
        datetime.timezone,
        decimal.Decimal,
        fractions.Fraction,
        uuid.UUID,
        argparse.Namespace,
    ]
    allowed.update((_name_of(c), c) for c in plain)
    allowed.update(_paths(pure=False))
    allowed.update(_numpy_globals())
    return allowed


def _numpy_globals() -> dict[str, Any]:
    """numpy arrays, scalars and dtypes (RNG states are arrays), under the
    module names numpy 1.x and 2.x pickle them as."""
    core = getattr(np, "_core", None) or np.core
    out: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{mod}._reconstruct"] = core.multiarray._reconstruct
        out[f"{mod}.scalar"] = core.multiarray.scalar
    dtypes = getattr(np, "dtypes", None)
    for name in dir(dtypes) if dtypes is not None else ():
        value = getattr(dtypes, name)
        if isinstance(value, type) and issubclass(value, np.dtype):
            out[f"numpy.dtypes.{name}"] = value
    return out


def _restricted_loads(blob: bytes | memoryview, allowed: Mapping[str, Any]) -> Any:
    return _unpickler(allowed)(io.BytesIO(blob)).load()


# ---------------------------------------------------------------------------
# .metadata
# ---------------------------------------------------------------------------


def load_metadata(blob: bytes, where: str, trust: Trust = TOOLS) -> tuple[Metadata, list[StoredItem]]:
    """Unpickle ``.metadata`` through the allowlist and validate it
    (:func:`validate_metadata`); returns it and its stored items.

    ``where`` names the file in errors. :class:`UnsafeCheckpoint` for a
    global off the allowlist, :class:`CheckpointCorrupt` for anything else
    wrong (never another exception).
    """
    try:
        if trust.trusted:
            metadata = pickle.loads(blob)
        else:
            metadata = _restricted_loads(blob, {**_metadata_globals(), **trust.extra})
    except _Refused as e:
        raise _refusal(where, e.name, trust) from None
    except Exception as e:  # pickle errors, and whatever an allowed __setstate__ raises
        raise CheckpointCorrupt(f"{where}: cannot be unpickled ({type(e).__name__}: {e})") from e
    stored = validate_metadata(metadata, where)
    return cast(Metadata, metadata), stored


class _Fields:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, want: str, got: Any) -> CheckpointCorrupt:
        shown = repr(got) if isinstance(got, (int, str)) and len(repr(got)) < 60 else f"a {type(got).__name__}"
        return CheckpointCorrupt(f"{self.where}: {field} must be {want}, got {shown}")

    def attr(self, obj: Any, name: str, default: Any = None) -> Any:
        # __dict__, not getattr: a crafted BUILD may leave fields out, and a
        # dataclass default on the class is what the object then has.
        return vars(obj).get(name, getattr(type(obj), name, default))

    def shape(self, field: str, value: Any, ndim: int | None = None) -> tuple[int, ...]:
        ok = isinstance(value, (torch.Size, tuple)) and all(type(v) is int and v >= 0 for v in value)
        if not ok or (ndim is not None and len(value) != ndim):
            want = "a torch.Size of non-negative ints" + (f" with {ndim} dims" if ndim is not None else "")
            raise self.fail(field, want, value)
        return tuple(value)

    def uint(self, field: str, value: Any) -> int:
        if type(value) is not int or value < 0:
            raise self.fail(field, "a non-negative int", value)
        return value


def stored_limit(nbytes: int, transformed: bool) -> int:
    """The most bytes an item may be stored in: its tensor's ``nbytes`` plus
    a record's headers; under stream transforms a compressor's framing too
    (zstd's worst case is 1/256). ``nbytes`` -1: a non-tensor item, unbounded
    as stored (:func:`check_record_end` checks it cheaply before it is read),
    bounded by what it may decode to under transforms."""
    if nbytes < 0:
        if not transformed:
            return sys.maxsize
        nbytes = BYTES_ITEM_LIMIT
    return nbytes + RECORD_SLACK + (nbytes // 64 + RECORD_SLACK if transformed else 0)


def validate_metadata(metadata: Any, where: str) -> list[StoredItem]:
    """Check every field a load relies on; returns every stored item as
    ``(label, path, offset, length)`` for checking against the manifest.

    Beyond types and ranges: every chunk lies inside its tensor (that the
    chunks of a global ``.metadata`` tile it is :func:`~.chunks.check_tiling`'s);
    every chunk and bytes
    item has a storage entry, and every storage entry is a declared chunk or
    bytes item; every item is stored in no more than
    :func:`stored_limit` bytes (so nothing larger is ever read or allocated
    for it). Iterative: nothing here recurses on checkpoint content.
    """
    f = _Fields(where)
    if type(metadata) is not Metadata:
        raise CheckpointCorrupt(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    entries = f.attr(metadata, "state_dict_metadata")
    if not isinstance(entries, dict):
        raise f.fail("state_dict_metadata", "a dict", entries)
    chunk_bytes: dict[tuple[str, tuple[int, ...] | None], int] = {}
    for fqn, md in entries.items():
        if not isinstance(fqn, str):
            raise f.fail("a state_dict_metadata key", "a str", fqn)
        field = f"state_dict_metadata[{fqn!r}]"
        if type(md) is BytesStorageMetadata:
            chunk_bytes[(fqn, None)] = -1
            continue
        if type(md) is not TensorStorageMetadata:
            raise f.fail(field, "TensorStorageMetadata or BytesStorageMetadata", md)
        props = f.attr(md, "properties")
        dtype = f.attr(props, "dtype") if type(props).__name__ == "TensorProperties" else None
        if not isinstance(dtype, torch.dtype):
            raise f.fail(f"{field}.properties.dtype", "a torch.dtype", dtype)
        size = f.shape(f"{field}.size", f.attr(md, "size"))
        chunks = f.attr(md, "chunks")
        if not isinstance(chunks, list):
            raise f.fail(f"{field}.chunks", "a list", chunks)
        for i, chunk in enumerate(chunks):
            if type(chunk) is not ChunkStorageMetadata:
                raise f.fail(f"{field}.chunks[{i}]", "ChunkStorageMetadata", chunk)
            offsets = f.shape(f"{field}.chunks[{i}].offsets", f.attr(chunk, "offsets"), len(size))
            sizes = f.shape(f"{field}.chunks[{i}].sizes", f.attr(chunk, "sizes"), len(size))
            if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise f.fail(f"{field}.chunks[{i}]", f"inside the tensor's size {list(size)}", chunk)
            numel = 1
            for s in sizes:
                numel *= s
            chunk_bytes[(fqn, offsets)] = numel * dtype.itemsize
    storage = f.attr(metadata, "storage_data")
    if not isinstance(storage, dict):
        raise CheckpointCorrupt(f"{where}: no storage_data (not written by a file-based DCP writer)")
    stored: list[StoredItem] = []
    for index, info in storage.items():
        if type(index) is not MetadataIndex or not isinstance(f.attr(index, "fqn"), str):
            raise f.fail("a storage_data key", "a MetadataIndex", index)
        offset = f.attr(index, "offset")
        key = (index.fqn, None if offset is None else f.shape(f"storage_data key {index.fqn!r}", offset))
        label = index.fqn if offset is None else f"{index.fqn} chunk at {list(offset)}"
        if type(info) is not StorageInfo:
            raise f.fail(f"storage_data[{label!r}]", "a StorageInfo", info)
        path = f.attr(info, "relative_path")
        why = check_relative_name(path)
        if why:
            raise f.fail(f"storage_data[{label!r}].relative_path", why.removeprefix("must be "), path)
        start = f.uint(f"storage_data[{label!r}].offset", f.attr(info, "offset"))
        length = f.uint(f"storage_data[{label!r}].length", f.attr(info, "length"))
        transforms = f.attr(info, "transform_descriptors")
        if transforms is not None and not (
            isinstance(transforms, (list, tuple)) and all(isinstance(t, str) for t in transforms)
        ):
            raise f.fail(f"storage_data[{label!r}].transform_descriptors", "None or a list of str", transforms)
        nbytes = chunk_bytes.get(key)
        if nbytes is None:  # no load ever reads it, and verify must not judge what no load reads
            raise CheckpointCorrupt(f"{where}: storage entry for {label}, which state_dict_metadata does not declare")
        if length > stored_limit(nbytes, bool(transforms)):
            what = "its tensor holds" if nbytes >= 0 else "a non-tensor item under stream transforms decodes to at most"
            shown = nbytes if nbytes >= 0 else BYTES_ITEM_LIMIT
            raise CheckpointCorrupt(
                f"{where}: item {label} is declared {length} bytes, but {what} {shown} (a record adds at most "
                f"{RECORD_SLACK}{', its stream transforms 1/64 more' if transforms else ''}); refusing to read it"
            )
        stored.append((label, path, start, length))
    have = {(i.fqn, None if i.offset is None else tuple(i.offset)) for i in storage}
    missing = [k for k in chunk_bytes if k not in have]
    if missing:
        name, at = missing[0]
        what = repr(name) if at is None else f"{name!r} chunk at {list(at)}"
        raise CheckpointCorrupt(f"{where}: no storage entry for {what} ({len(missing)} missing in all)")
    meta = f.attr(metadata, "storage_meta")
    if meta is not None and type(meta) is not StorageMeta:
        raise f.fail("storage_meta", "None or a StorageMeta", meta)
    return stored


# ---------------------------------------------------------------------------
# Non-tensor items
# ---------------------------------------------------------------------------


def _pickle_module(allowed: Mapping[str, Any]) -> Any:
    """What ``torch.load(pickle_module=...)`` needs: ``Unpickler`` (torch
    subclasses it to add storages) and ``load`` (its legacy format), both
    restricted."""
    unpickler = _unpickler(allowed)
    return types.SimpleNamespace(
        __name__=__name__,
        Unpickler=unpickler,
        load=lambda f, **kw: unpickler(f, **kw).load(),
    )


def _forced_weights_only() -> bool:
    # torch refuses an explicit pickle_module when this is set; honour it with
    # torch's own (stricter) weights_only rules instead.
    return os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")


def load_object(data: bytes | memoryview, subject: str, trust: Trust = TOOLS) -> Any:
    """The object one non-tensor item (a ``torch.save`` record) holds, built
    through the allowlist. ``subject`` names the item in errors, e.g.
    ``"checkpoint item 'sched'"``."""
    stream = cast(IO[bytes], io.BytesIO(data))
    try:
        if trust.trusted:
            return torch.load(stream, map_location="cpu", weights_only=False)
        if _forced_weights_only():
            return torch.load(stream, map_location="cpu", weights_only=True)
        module = _pickle_module({**_item_globals(), **trust.extra})
        return torch.load(stream, map_location="cpu", weights_only=False, pickle_module=module)
    except _Refused as e:
        raise _refusal(subject, e.name, trust) from None
    except Exception as e:
        raise CheckpointCorrupt(
            f"{subject} is not a readable torch.save record ({type(e).__name__}: {str(e)[:300]})"
        ) from e


def check_record_end(storage: Storage, path: str, offset: int, length: int, item: str) -> None:
    """A large non-tensor item must end as a ``torch.save`` record does;
    checked with one 22-byte read before the whole item is read, so that a
    declared size over a hole of a sparse file is refused cheaply. ``item``
    names it in the error."""
    if length <= RECORD_PEEK_MIN:
        return
    tail = storage.read_range(path, offset + length - _ZIP_END_SIZE, _ZIP_END_SIZE)
    if not tail.startswith(_ZIP_END):
        raise CheckpointCorrupt(
            f"{storage.describe(path)}: item {item} ({length} bytes at offset {offset}) does not end "
            "as a torch.save record does; not read"
        )
