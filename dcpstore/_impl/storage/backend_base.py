"""The kit the built-in backends are built from: :class:`BackendBase`.

:class:`~dcpstore._impl.storage.base.Storage` is only the contract (what a
backend must implement, what it may override, what callers get). What
every built-in backend needs beyond it is written once here, as protected
members that only backends and their writers call:

* the root-containment check (:meth:`BackendBase._relpath`,
  :meth:`BackendBase._join_root`);
* the error mapping: :meth:`BackendBase._mapped` around each library call,
  or :meth:`BackendBase._error` in a handler of the backend's own, both
  translating through the backend's :meth:`BackendBase._map_error` (and
  :func:`errors_mapped`, the one the object writers use on any storage);
* one request pool per instance
  (:class:`~dcpstore._impl.storage.request_pool.RequestPool`: the connection
  budget that ranged reads, :meth:`BackendBase._in_parallel` and part uploads
  share), shut down by :meth:`BackendBase.close`;
* whole-object reads: :meth:`BackendBase.check_limit` and
  :meth:`BackendBase._read_one_version`;
* ``gc``'s conveniences over the contract's incomplete-write methods
  (:meth:`BackendBase.list_incomplete`, :meth:`BackendBase.cleanup_incomplete`).

Object writers build on :class:`~dcpstore._impl.storage.buffered.BufferedObjectWriter`,
which owns position, ``tell`` and part buffering.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from dcpstore._impl.storage.base import Storage
from dcpstore._impl.storage.error_mapping import map_os_error
from dcpstore._impl.storage.request_pool import RequestPool
from dcpstore._impl.storage.secrets import scrub_exception
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.storage.uri import StorageURL
from dcpstore._impl.util.errors import CheckpointError, ObjectTooLarge, StorageError

T = TypeVar("T")


class BackendBase(Storage):
    """A :class:`~dcpstore._impl.storage.base.Storage` with the backend kit
    (see the module docstring): every built-in backend derives from it."""

    #: What this backend's library raises, which :meth:`_mapped` translates
    #: through :meth:`_map_error`; anything else (a bug) passes unchanged.
    _library_errors: ClassVar[tuple[type[Exception], ...]] = (Exception,)

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        super().__init__(url, options)
        #: This storage's connection budget: every parallel request (ranged
        #: GETs, part uploads) of every file runs here.
        #: (A wrapping Storage may set ``backend`` only after this returns.)
        name = getattr(self, "backend", type(self).__name__)
        self._requests = RequestPool(self.options.max_concurrency, f"dcpstore-{name}-io")

    # -- paths -----------------------------------------------------------------
    def _relpath(self, path: str) -> str:
        """``path``, checked to stay under the root, without a trailing ``/``.

        Every backend resolves a path through this before it touches the
        store: an absolute path or a ``..`` component raises
        :class:`StorageError` (a crafted manifest must not reach outside the
        checkpoint).
        """
        if path.startswith("/") or ".." in path.split("/"):
            raise StorageError(f"{self.describe(path)}: path escapes the checkpoint root")
        return path.rstrip("/")

    def _join_root(self, root: str, path: str) -> str:
        """``root/path`` for an object-store style ``root`` (``""``: the bucket or
        filesystem root), ``path`` checked by :meth:`_relpath`."""
        path = self._relpath(path)
        if not root:
            return path
        return f"{root}/{path}" if path else root

    # -- errors ----------------------------------------------------------------
    def _map_error(self, e: Exception, what: str) -> CheckpointError:
        """The dcpstore exception for ``e``, one of :attr:`_library_errors`
        raised while doing ``what`` (the operation and the URI).

        Backends override this with their library's knowledge (S3 error
        codes, ...); the default reads the built-in exceptions. Callers go
        through :meth:`_error`.
        """
        return map_os_error(e, what)

    def _error(self, e: Exception, what: str) -> CheckpointError:
        """The one way a library exception becomes ours (raise it ``from e``):
        :meth:`_mapped` and a backend's own handlers all pass here, so that
        whatever every mapping must do is done here once."""
        if isinstance(e, CheckpointError):
            return e
        scrub_exception(e)  # ours is chained to it: what it quotes (an echoing endpoint) must be clean too
        return self._map_error(e, what)

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """Run the block; raise its library errors as :meth:`_error` says,
        chained to the original. dcpstore's own errors pass unchanged."""
        try:
            yield
        except CheckpointError:
            raise
        except self._library_errors as e:
            raise self._error(e, what) from e

    # -- requests --------------------------------------------------------------
    def _in_parallel(self, fn: Callable[..., T], jobs: Sequence[tuple[Any, ...]]) -> list[T]:
        """``[fn(*job) for job in jobs]`` on this storage's request pool: in
        flight with every other request of this storage, ``max_concurrency``
        at most (see :meth:`~dcpstore._impl.storage.request_pool.RequestPool.map`)."""
        return self._requests.map(fn, jobs)

    # -- whole-object reads ------------------------------------------------------
    def _read_one_version(self, path: str, seen: int, limit: int | None, head: Callable[[int | None], bytes]) -> bytes:
        """:meth:`read` for a backend whose every request returns bytes of one
        version: ``head(n)`` gives the object's first ``n`` bytes (``None``:
        all of it) in one request (``b""`` past the end), ``seen`` is its
        size as just asked, already checked against ``limit``.

        The first request asks one byte more than ``seen``: fewer back means
        the object ended there, so they are all of one version (the one asked
        about, or one that replaced it meanwhile and is no larger). All of
        them back: a larger version replaced it between the size and the
        read, and one more request asks for one byte past ``limit`` (no
        limit: the whole object), which either ends within it or is refused.
        Memory stays bounded by the version read (or ``limit`` + 1 bytes,
        only when a larger version lands in that window).
        """
        data = head(seen + 1)
        if len(data) <= seen:
            return data
        data = head(None if limit is None else limit + 1)
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(
                f"{self.describe(path)}: more than the {limit} bytes read (replaced by a larger object while read)",
                len(data),
                limit,
            )
        return data

    def check_limit(self, path: str, size: int, limit: int | None) -> None:
        """Raise :class:`~dcpstore._impl.util.errors.ObjectTooLarge` if ``size`` exceeds ``limit``."""
        if limit is not None and size > limit:
            raise ObjectTooLarge(f"{self.describe(path)}: {size} bytes, more than the {limit} read", size, limit)

    # -- incomplete writes -----------------------------------------------------
    def list_incomplete(self) -> Iterator[str]:
        """The paths of :meth:`incomplete_writes`."""
        return iter([w.path for w in self.incomplete_writes()])

    def cleanup_incomplete(self, older_than_s: float = 0.0) -> int:
        """Remove leftovers of interrupted writes older than ``older_than_s``
        (of unknown age: only with ``older_than_s`` <= 0). Returns how many
        were removed."""
        old = [
            w
            for w in self.incomplete_writes()
            if (w.age_s is None and older_than_s <= 0) or (w.age_s or 0) >= older_than_s
        ]
        return self.remove_incomplete(old, older_than_s)

    def close(self) -> None:
        """Release clients, connections and the request pool. The storage is
        unusable afterwards. Backends that hold more extend this."""
        self._requests.close()


def errors_mapped(storage: Storage, what: str) -> contextlib.AbstractContextManager[None]:
    """``storage``'s error mapping (:meth:`BackendBase._mapped`) around a
    block, for the object writers, which any :class:`Storage` may use: one
    without the kit gets the default mapping (any exception but dcpstore's
    own, as :func:`~dcpstore._impl.storage.error_mapping.map_os_error` reads
    it), the one :class:`BackendBase` itself has."""
    if isinstance(storage, BackendBase):
        return storage._mapped(what)
    return _default_mapped(what)


@contextlib.contextmanager
def _default_mapped(what: str) -> Iterator[None]:
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        scrub_exception(e)
        raise map_os_error(e, what) from e
