"""Path objects other DCP writers record in ``.metadata``, read as data.

A writer's ``storage_meta().checkpoint_id`` is whatever path object it was
given or built, pickled into ``.metadata``: stock ``FileSystemWriter`` and
NVRx record a ``pathlib`` path, fsspec's writer and s3torchconnector's a
``str``, and MSC's ``MultiStorageFileSystemWriter`` (Megatron's
``--enable-msc``) a ``multistorageclient.pathlib.MultiStoragePath``. That
class's ``__setstate__`` resolves an MSC storage client for the path it holds
(reads MSC's configuration, builds a client for the profile the file names):
running it to read a checkpoint would let the file choose what runs.

So the restricted unpickler (:mod:`.safe_pickle`) maps each class in
:data:`PEER_PATHS` to an inert stand-in, a :class:`PeerPath` that keeps the
class's name and the path as text. The module the file names is never
imported and none of that class's code runs: the pickle's ``NEWOBJ``
builds an empty stand-in (taking no arguments), its ``BUILD`` gives the
stand-in the pickled state, of which only the one ``str`` field that holds
the path is kept. Anything else (arguments, a state without that field or
with a non-``str`` there) fails the unpickle: the file is then damaged.

The rule for adding a class here: a peer's real writer records it (a test
writes a checkpoint with that writer and loads it, tests/frameworks/test_peer_checkpoints.py),
and its pickle is ``NEWOBJ`` without arguments plus a state ``dict`` whose
path is one ``str`` field. A class that pickles otherwise (a reduce to a
function of its own, constructor arguments) needs a stand-in of its own,
not an entry here.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any, ClassVar

#: ``"module.Name"`` of a path class peers record -> the field of its
#: pickled state that holds the path as text.
PEER_PATHS: Mapping[str, str] = {
    "multistorageclient.pathlib.MultiStoragePath": "_path",
}


class PeerPath(os.PathLike[str]):
    """A path another writer recorded: ``peer_class`` (``"module.Name"``, the
    class it was written as) and ``path`` (its text). ``os.fspath`` and
    ``str`` give the path; it pickles as itself (a load sends its metadata
    to the other ranks)."""

    __slots__ = ("peer_class", "path")

    def __init__(self, peer_class: str, path: str) -> None:
        self.peer_class = peer_class
        self.path = path

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"PeerPath({self.peer_class}, {self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerPath) and (self.peer_class, self.path) == (other.peer_class, other.path)

    def __hash__(self) -> int:
        return hash((self.peer_class, self.path))

    def __reduce__(self) -> tuple[Any, ...]:
        return PeerPath, (self.peer_class, self.path)


class _Unpickled(PeerPath):
    """What the unpickler builds for one class of :data:`PEER_PATHS`
    (``_peer``; ``_field`` holds its path): see the module docstring."""

    __slots__ = ()
    _peer: ClassVar[str] = ""
    _field: ClassVar[str] = ""

    def __new__(cls, *args: Any) -> _Unpickled:
        if args:
            raise pickle.UnpicklingError(f"{cls._peer} pickled with arguments; a path is pickled without")
        obj = object.__new__(cls)
        obj.peer_class, obj.path = cls._peer, ""
        return obj

    def __init__(self, *args: Any) -> None:
        # A REDUCE would call the class: refused here as in __new__.
        raise pickle.UnpicklingError(f"{self._peer} is not built by a call in a pickle")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots), as pickle writes for slotted classes
            state = state[0]
        value = state.get(self._field) if isinstance(state, dict) else None
        if not isinstance(value, str):
            raise pickle.UnpicklingError(f"{self._peer}: no path text in its state (field {self._field!r})")
        self.path = value


def stand_ins() -> dict[str, type[PeerPath]]:
    """``"module.Name" -> stand-in class`` for the unpickler's allowlist."""
    out: dict[str, type[PeerPath]] = {}
    for name, path_field in PEER_PATHS.items():
        out[name] = type(name.rpartition(".")[2], (_Unpickled,), {"__slots__": (), "_peer": name, "_field": path_field})
    return out
