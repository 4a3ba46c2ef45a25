"""fsspec backend: any scheme an installed fsspec filesystem serves.

``memory://`` (tests), ``gs://`` with gcsfs, ``az://`` with adlfs, ...
The URI goes to ``fsspec.core.url_to_fs`` unchanged; filesystem options come
from fsspec's own configuration (``FSSPEC_<PROTOCOL>_<OPTION>`` variables or
its config files), credentials from each filesystem's standard sources.

Commit protocol (how an object becomes visible), chosen per filesystem:

* **Transactional** (object-store filesystems: s3fs, gcsfs, adlfs, ...; their
  files are fsspec ``AbstractBufferedFile`` s): the object is opened under its
  final name with ``autocommit=False``; the filesystem streams it (s3fs and
  gcsfs as a multipart / resumable upload) but publishes it only in
  ``commit()``, atomically. An abort calls ``discard()``, which cancels the
  upload (s3fs aborts the multipart upload).
* **Temp + move** (every other filesystem, e.g. ``memory://``): the object is
  written under a hidden temporary name in the same directory,
  ``.<name>.dcpstore-tmp-<random>``, and moved over the final name at commit
  with ``fs.mv``. Visibility is atomic where the filesystem's move is (a
  rename; ``memory://`` swaps one dict entry); on filesystems whose move is a
  copy plus delete, a reader sees either no object or the whole one, but the
  temporary may survive a crash. Temporary names are never listed;
  ``incomplete_writes`` / ``remove_incomplete`` (``dcpstore gc``) find them.

Durability is whatever the filesystem provides on close (no fsync: local
paths use the native local backend instead). ``.metadata`` is written last
by the writer, so a crash between data and commit leaves no checkpoint.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import fsspec
from fsspec.spec import AbstractBufferedFile

from dcpstore._impl.storage.backend_base import BackendBase
from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter
from dcpstore._impl.storage.buffered import BufferedObjectWriter
from dcpstore._impl.storage.error_mapping import library_detail, map_os_error
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.posix import LocalRoot
from dcpstore._impl.storage.secrets import scrub_exception
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.storage.uri import StorageURL
from dcpstore._impl.util.errors import BackendUnavailable, CheckpointError, StorageError, StorageNotFound

_TMP_MARK = ".dcpstore-tmp-"


def _is_tmp(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith(".") and _TMP_MARK in name


class FsspecStorage(BackendBase):
    """A directory (or prefix) on an fsspec filesystem."""

    backend = "fsspec"

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        super().__init__(url, options)
        try:
            self.fs, root = fsspec.core.url_to_fs(url.uri)
        except ImportError as e:
            raise BackendUnavailable(f"no fsspec filesystem installed for {self.uri}: {e}") from e
        except (ValueError, OSError) as e:  # OSError: e.g. hdfs:// without a JVM, a host that is not there
            scrub_exception(e)  # a filesystem's options may hold keys
            first = (library_detail(e).splitlines() or [""])[0]  # pyarrow lists every JVM path it tried
            raise StorageError(f"fsspec cannot open {self.uri}: {first}") from e
        self.root = str(root).rstrip("/")
        # An AbstractBufferedFile honours autocommit=False (upload now, publish
        # at commit); memory:// and local files do not, so they use temp + mv.
        self.transactional = self._has_buffered_files()
        # A local filesystem: what is read resolves inside the root (see LocalRoot).
        self._local = LocalRoot(self.root) if {"file", "local"} & set(self._protocols()) else None

    def _protocols(self) -> tuple[str, ...]:
        protocol = self.fs.protocol
        return tuple(protocol) if isinstance(protocol, (tuple, list)) else (protocol,)

    def _check_inside(self, path: str) -> None:
        if self._local is not None:
            self._local.check_path(self._full(path), self.describe(path))

    def local_path(self) -> str | None:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return str(self.fs._strip_protocol(self.root)) if {"file", "local"} & set(protocols) else None

    def _has_buffered_files(self) -> bool:
        if {"memory", "file", "local"} & set(self._protocols()):
            return False
        return type(self.fs).__module__.split(".")[0] in _TRANSACTIONAL_MODULES

    def _full(self, path: str) -> str:
        return self._join_root(self.root, path)

    def _map_error(self, e: Exception, what: str) -> CheckpointError:
        # Object-store filesystems raise PermissionError for refused credentials too.
        return map_os_error(e, what, denied="permission denied (credentials refused or insufficient)")

    def _relative(self, full: str) -> str:
        stripped = str(self.fs._strip_protocol(full)).rstrip("/")
        root = str(self.fs._strip_protocol(self.root)).rstrip("/")
        return stripped[len(root) + 1 :] if root else stripped.lstrip("/")

    # -- writing -------------------------------------------------------------
    def open_write(self, path: str, *, size_hint: int | None = None, batch_hint: int | None = None) -> ObjectWriter:
        full = self._full(path)
        what = f"cannot write {self.describe(path)}"
        if self.transactional:
            with self._mapped(what):
                handle = self.fs.open(full, "wb", autocommit=False, block_size=self.options.part_size_for(size_hint))
            if isinstance(handle, AbstractBufferedFile) and not handle.autocommit:
                return _TransactionalWriter(self, path, handle)
            # The filesystem ignored autocommit=False: never leave it half-written.
            with contextlib.suppress(Exception):
                handle.close()
            raise StorageError(f"{what}: {type(self.fs).__name__} does not support uncommitted writes")
        directory, _, name = full.rpartition("/")
        tmp = f"{directory}/.{name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        with self._mapped(what):
            handle = self.fs.open(tmp, "wb")
        return _TempMoveWriter(self, path, handle, tmp, full)

    def makedirs(self, path: str = "") -> None:
        with self._mapped(f"cannot create directory {self.describe(path)}"):
            self.fs.makedirs(self._full(path), exist_ok=True)

    # -- reading -------------------------------------------------------------
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        full = self._full(path)
        self._check_inside(path)
        with self._mapped(f"cannot read {self.describe(path)}"):
            if length <= 0:
                self.size(path)
                return b""
            return bytes(self.fs.cat_file(full, start=offset, end=offset + length))

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """The size, then one ``cat_file`` for the whole object, never a
        ``cat_file`` cut at the size (see :meth:`BackendBase._read_one_version`):
        one GET on s3fs, gcsfs and adlfs, a slice of one file's bytes on
        ``memory://``. (A filesystem without a ``cat_file`` of its own reads
        through fsspec's buffered file, whose blocks are separate requests.)"""
        full = self._full(path)
        with self._mapped(f"cannot read {self.describe(path)}"):
            size = self.size(path)  # a directory is not an object; checks the path too
            self.check_limit(path, size, limit)
            return self._read_one_version(path, size, limit, lambda n: bytes(self.fs.cat_file(full, start=0, end=n)))

    def size(self, path: str) -> int:
        self._check_inside(path)
        with self._mapped(f"cannot stat {self.describe(path)}"):
            info = self.fs.info(self._full(path))
        if info.get("type") != "file":
            raise StorageNotFound(f"cannot stat {self.describe(path)}: is a {info.get('type')}, not an object")
        return int(info["size"])

    def _find(self, prefix: str) -> dict[str, dict[str, Any]]:
        full = self._full(prefix.strip("/"))
        with self._mapped(f"cannot list {self.describe(prefix)}"):
            self.fs.invalidate_cache(full)  # listings are cached per instance (s3fs, gcsfs)
            found: dict[str, dict[str, Any]] = self.fs.find(full, detail=True)
        return found

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for name, info in sorted(self._find(prefix).items()):
            if info.get("type") == "file" and not _is_tmp(name):
                entry: ObjectInfo = {"path": self._relative(name), "size": int(info.get("size") or 0)}
                mtime = _mtime(info)
                if mtime is not None:
                    entry["mtime"] = mtime
                yield entry

    # -- deleting ------------------------------------------------------------
    def delete(self, paths: Iterable[str]) -> None:
        for path in paths:
            with self._mapped(f"cannot delete {self.describe(path)}"), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._full(path))

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        now = time.time()
        found = []
        for name, info in sorted(self._find("").items()):
            if info.get("type") == "file" and _is_tmp(name):
                mtime = _mtime(info)
                found.append(IncompleteWrite(self._relative(name), None if mtime is None else now - mtime))
        return found

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """Each temporary name is unique to its write."""
        removed = 0
        for write in writes:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._full(write.path))
                removed += 1
        return removed


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time from an fsspec info dict; each filesystem names it differently."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None


#: Top-level modules of filesystems whose files are AbstractBufferedFiles
#: that publish only in commit() when opened with autocommit=False.
_TRANSACTIONAL_MODULES = {"s3fs", "gcsfs", "adlfs", "ossfs", "ocifs"}


class _HandleWriter(BufferedObjectWriter):
    """Streams into an open fsspec file handle (which buffers by itself);
    subclasses decide how the object lands."""

    def __init__(self, storage: FsspecStorage, path: str, handle: Any) -> None:
        super().__init__(storage, path)
        self._f = handle

    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        self._f.write(part)


class _TransactionalWriter(_HandleWriter):
    def _publish(self, tail: bytearray) -> None:
        self._f.close()  # uploads the tail; publishes nothing (autocommit=False)
        self._f.commit()

    def _discard(self) -> None:
        with contextlib.suppress(Exception):
            self._f.discard()
        with contextlib.suppress(Exception):
            self._f.closed = True  # discard() dropped the buffer; don't flush on close


class _TempMoveWriter(_HandleWriter):
    def __init__(self, storage: FsspecStorage, path: str, handle: Any, tmp: str, final: str) -> None:
        super().__init__(storage, path, handle)
        self._fs = storage.fs
        self._tmp = tmp
        self._final = final

    def _publish(self, tail: bytearray) -> None:
        self._f.close()
        self._fs.mv(self._tmp, self._final)

    def _discard(self) -> None:
        with contextlib.suppress(Exception):
            self._f.close()
        with contextlib.suppress(Exception):
            self._fs.rm_file(self._tmp)
