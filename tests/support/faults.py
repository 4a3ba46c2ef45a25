"""Fault injection at the storage interface, for the reliability suites.

``EventStorage`` wraps any :class:`Storage` and calls ``hook(event)`` before
and after every operation a save performs (and before/after each chunk
written and each object commit). A hook can count events, raise an error
there, or SIGKILL the process there — the crash tests use the last.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter, Storage
from dcpstore._impl.storage.incomplete import IncompleteWrite

Hook = Callable[[str], None]


class _EventWriter(ObjectWriter):
    def __init__(self, inner: ObjectWriter, path: str, hook: Hook) -> None:
        super().__init__()
        self._inner, self._path, self._hook = inner, path, hook

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._hook(f"write:{self._path}")
        n = self._inner.write(data)
        self._hook(f"wrote:{self._path}")
        return n

    def write_lent(self, data: bytes | bytearray | memoryview, owner: object) -> int:
        self._hook(f"write:{self._path}")
        n = self._inner.write_lent(data, owner)
        self._hook(f"wrote:{self._path}")
        return n

    @property  # type: ignore[override]
    def direct_align(self) -> int | None:
        return self._inner.direct_align

    def tell(self) -> int:
        return self._inner.tell()

    def seal(self) -> None:
        self._inner.seal()

    def _commit(self) -> None:
        self._hook(f"commit:{self._path}")
        self._inner.commit()
        self._hook(f"committed:{self._path}")

    def _abort(self) -> None:
        self._inner.abort()


class EventStorage(Storage):
    """A transparent proxy around ``inner`` that reports every operation."""

    def __init__(self, inner: Storage, hook: Hook) -> None:
        super().__init__(inner.url, inner.options)
        self.inner, self.hook = inner, hook
        self.backend = inner.backend  # type: ignore[misc]

    def open_write(self, path: str, *, size_hint: int | None = None, batch_hint: int | None = None) -> ObjectWriter:
        self.hook(f"open:{path}")
        return _EventWriter(self.inner.open_write(path, size_hint=size_hint, batch_hint=batch_hint), path, self.hook)

    def makedirs(self, path: str = "") -> None:
        self.hook("makedirs")
        self.inner.makedirs(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        self.hook(f"read:{path}")
        return self.inner.read_range(path, offset, length)

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        self.hook(f"read:{path}")
        return self.inner.read(path, limit=limit)

    def size(self, path: str) -> int:
        return self.inner.size(path)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self.hook("list")
        return self.inner.list(prefix)

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        self.hook(f"delete:{','.join(paths)}")
        self.inner.delete(paths)

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        return self.inner.incomplete_writes()

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        return self.inner.remove_incomplete(writes, older_than_s)


#: Where dcpstore.save / load / AsyncSaver / CheckpointManager look up ``open_storage``.
_OPENERS = (
    "dcpstore._impl.api",
    "dcpstore._impl.engines.saver",
    "dcpstore._impl.manager.manager",
    "dcpstore._impl.engines.process",
)


def hook_all_storage(hook: Hook | dict[str, Hook], setattr: Callable[[object, str, object], None] = setattr) -> None:
    """Route every storage that ``dcpstore.save`` / ``load`` / ``AsyncSaver``
    / ``CheckpointManager`` open through :class:`EventStorage` with ``hook``
    (or ``hook[uri]`` by the URI as given; other URIs untouched). Pass pytest's ``monkeypatch.setattr`` to have it undone
    after the test; in a crash child the plain ``setattr`` is right."""
    import importlib

    from dcpstore.storage import open_storage as real

    def opener(uri: object, **kwargs: object) -> Storage:
        storage = real(uri, **kwargs)  # type: ignore[arg-type]
        if isinstance(hook, dict):
            chosen = hook.get(os.fspath(uri))  # type: ignore[arg-type]
            return storage if chosen is None else EventStorage(storage, chosen)
        return EventStorage(storage, hook)

    for name in _OPENERS:
        setattr(importlib.import_module(name), "open_storage", opener)


class Recorder:
    """A hook that only records the events, to plan where to inject."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, event: str) -> None:
        with self._lock:
            self.events.append(event)


class KillAt:
    """A hook that SIGKILLs this process at the ``n``-th event (0-based)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0
        self._lock = threading.Lock()  # events come from several writer threads

    def __call__(self, event: str) -> None:
        with self._lock:
            if self.seen == self.n:
                os.kill(os.getpid(), signal.SIGKILL)
            self.seen += 1


class SharedEvents:
    """:class:`Recorder` and :class:`KillAt` for a save that runs in two
    processes, a trainer and the process engine's checkpoint process (one
    after the other, never both at once): each event is counted in, or
    appended to, one file under a lock. ``kill_at`` None: record;
    otherwise SIGKILL the trainer (``trainer``, a pid) and this process at
    the ``kill_at``-th event of the two together (0-based)."""

    def __init__(self, path: str, trainer: int, kill_at: int | None = None) -> None:
        self.path, self.trainer, self.kill_at = path, trainer, kill_at
        self._lock = threading.Lock()  # and flock, between the processes

    def __call__(self, event: str) -> None:
        with self._lock, open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            seen = sum(1 for _ in f)
            if seen == self.kill_at:
                if self.trainer != os.getpid():
                    os.kill(self.trainer, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(json.dumps(event) + "\n")
            f.flush()

    @property
    def events(self) -> list[str]:
        with open(self.path) as f:
            return [json.loads(line) for line in f]

    def environment(self) -> dict[str, str]:
        """What a checkpoint process needs to install the same hook
        (tests/support/worker_site/sitecustomize.py)."""
        spec = {"path": self.path, "trainer": self.trainer, "kill_at": self.kill_at}
        support = os.path.dirname(os.path.abspath(__file__))
        root = os.path.dirname(os.path.dirname(support))  # where ``tests.support`` imports from
        path = os.pathsep.join(
            p for p in (os.path.join(support, "worker_site"), root, os.environ.get("PYTHONPATH")) if p
        )
        return {"DCPSTORE_CRASH_HOOK": json.dumps(spec), "PYTHONPATH": path}


def install_shared_hook() -> None:
    """In a checkpoint process of a crash run: route its storage through
    the :class:`SharedEvents` the environment names."""
    spec = json.loads(os.environ["DCPSTORE_CRASH_HOOK"])
    hook_all_storage(SharedEvents(spec["path"], spec["trainer"], spec["kill_at"]))


class KillOn:
    """A hook that SIGKILLs this process at the first event named ``event``
    (or starting with it, ``prefix=True``): a kill point that does not shift
    when the number of other events varies from run to run (parallel
    uploads interleave; a timing-dependent read comes or goes)."""

    def __init__(self, event: str, prefix: bool = False) -> None:
        self.event, self.prefix = event, prefix

    def __call__(self, event: str) -> None:
        if event == self.event or (self.prefix and event.startswith(self.event)):
            os.kill(os.getpid(), signal.SIGKILL)


class FailAt:
    """A hook that raises ``error`` at the first event matching ``predicate``."""

    def __init__(self, predicate: Callable[[str], bool], error: BaseException) -> None:
        self.predicate, self.error, self.fired = predicate, error, False

    def __call__(self, event: str) -> None:
        if not self.fired and self.predicate(event):
            self.fired = True
            raise self.error


class BlockAt:
    """A hook that hangs (like a storage call that never returns) at the
    first event matching ``predicate``, until :meth:`release`; then raises
    ``then`` if given (so the released save fails instead of committing)."""

    def __init__(self, predicate: Callable[[str], bool], then: BaseException | None = None) -> None:
        self.predicate, self.then = predicate, then
        self.reached = threading.Event()
        self._gate = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, event: str) -> None:
        with self._lock:
            hang = not self.reached.is_set() and self.predicate(event)
            if hang:
                self.reached.set()
        if hang:
            self._gate.wait()
            if self.then is not None:
                raise self.then

    def release(self) -> None:
        self._gate.set()


def spread(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(total)`` (all, if fewer)."""
    if total <= count:
        return list(range(total))
    return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)})
