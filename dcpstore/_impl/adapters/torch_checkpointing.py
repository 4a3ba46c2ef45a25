"""torch_checkpointing 0.1.1's ``Storage`` over any dcpstore backend.

See :mod:`dcpstore.adapters.torch_checkpointing` for what it guarantees and
why the commit is built the way it is.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from torch_checkpointing.storage.base_storage import ReadArgs, StorageConfig
from torch_checkpointing.storage.base_storage import Storage as TCStorage
from typing_extensions import Buffer

from dcpstore._impl.storage.backend_registry import open_storage
from dcpstore._impl.storage.base import ObjectWriter
from dcpstore._impl.storage.base import Storage as DcpStorage
from dcpstore._impl.storage.storage_options import StorageOptions
from dcpstore._impl.storage.uri import redact
from dcpstore._impl.util.checksum import crc32c
from dcpstore._impl.util.errors import CheckpointCorrupt, StorageNotFound

#: The commit record of a directory that a ``rename`` published: every file's
#: size and CRC32C. Written last, so a directory is committed exactly when
#: this object exists in it.
COMMIT_FILE = ".dcpstore-commit.json"
#: Beside each file while it is staged: its size and CRC32C, computed from
#: the bytes as they were written, which the commit gathers into COMMIT_FILE.
CHECKSUM_SUFFIX = ".dcpstore-crc32c"
#: Objects copied per read on an object store's rename: bounds the memory a
#: copy holds to one chunk, whatever the file's size.
COPY_CHUNK = 64 * 1024 * 1024


def _hidden(name: str) -> bool:
    """dcpstore's own records, which torch_checkpointing never asked for."""
    return name == COMMIT_FILE or name.endswith(CHECKSUM_SUFFIX)


def _checksum_name(key: str) -> str:
    parent, _, name = key.rpartition("/")
    side = f".{name}{CHECKSUM_SUFFIX}"
    return f"{parent}/{side}" if parent else side


def _record(size: int, crc: int) -> dict[str, int | str]:
    return {"size": size, "crc32c": f"{crc:08x}"}


@dataclass
class DcpstoreStorageConfig(StorageConfig):
    """Where torch_checkpointing's files go: ``uri`` is the root every
    checkpoint id is relative to (``"step_1"`` is ``<uri>/step_1``).

    Picklable, so torch_checkpointing's async checkpoint process builds its
    own storage from it.
    """

    uri: str
    enable_msc: bool = False
    storage_options: StorageOptions | None = field(default=None)

    def create_storage(self) -> DcpstoreStorage:
        return DcpstoreStorage(self.uri, enable_msc=self.enable_msc, storage_options=self.storage_options)

    def __repr__(self) -> str:
        # torch_checkpointing logs its configs; a URI is printed redacted.
        return f"DcpstoreStorageConfig(uri={redact(self.uri)!r}, enable_msc={self.enable_msc})"


class _WriteStream(io.RawIOBase):
    """One object, written through dcpstore's atomic writer, checksummed as
    the bytes pass. A clean close commits the object and then its checksum
    record; leaving a ``with`` block on an exception aborts both (``IOBase``
    would close, i.e. commit a truncated object)."""

    def __init__(self, store: DcpstoreStorage, key: str) -> None:
        super().__init__()
        self._store = store
        self._key = key
        self._writer: ObjectWriter = store.dcp.open_write(key)
        self._crc = 0
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        self._crc = crc32c(view, self._crc)
        self._size += view.nbytes
        self._writer.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self._size

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._writer.commit()
        # The record follows the object: a record always describes bytes
        # that are there, and a file without one never commits.
        self._store.dcp.put(_checksum_name(self._key), json.dumps(_record(self._size, self._crc)).encode())

    def abort(self) -> None:
        if not self.closed:
            io.RawIOBase.close(self)
            # Absent when open_write itself refused (a path outside the root).
            writer: ObjectWriter | None = getattr(self, "_writer", None)
            if writer is not None:
                writer.abort()

    def __del__(self) -> None:
        # IOBase's would close, i.e. commit whatever was written: a stream
        # dropped without close() was not finished.
        self.abort()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class DcpstoreStorage(TCStorage):
    """torch_checkpointing's storage interface on dcpstore's :class:`Storage`."""

    def __init__(self, uri: str, *, enable_msc: bool = False, storage_options: StorageOptions | None = None) -> None:
        self.dcp: DcpStorage = open_storage(uri, enable_msc=enable_msc, storage_options=storage_options)
        self._rename_lock = threading.Lock()
        # The spellings of the root an id may start with: the URI as given,
        # as pathlib leaves it (``Path("s3://b/x")`` is ``s3:/b/x``), and the
        # local directory it is. torch_checkpointing passes every id through
        # Path, so the URI's ``//`` is gone by the time it reaches us.
        root = uri.rstrip("/")
        self._roots = {root, str(PurePosixPath(root)), root.replace("://", ":/", 1)}
        local = self.dcp.local_path()
        if local is not None:
            self._roots.add(os.path.abspath(local).rstrip("/") or "/")

    # Every full read is verified, so each stream reads its file whole: one
    # stream per file, not one per range.
    @property
    def mmap_fill_workers(self) -> int | None:
        return 1

    def close(self) -> None:
        self.dcp.close()

    # -- paths -------------------------------------------------------------------
    def _key(self, path: Path | str) -> str:
        """The key under the root of ``path``: relative to the root, or
        spelt from it (the URI, or the local directory). dcpstore refuses one
        that leaves it (another absolute path, ``..``) naming it."""
        spelt = str(path)
        for root in self._roots:
            if spelt == root:
                return ""
            if spelt.startswith(root.rstrip("/") + "/"):
                spelt = spelt[len(root.rstrip("/")) + 1 :]
                break
        parts = [p for p in PurePosixPath(spelt).parts if p not in (".", "")]
        if parts and parts[0] == "/":
            # Outside the root: left for dcpstore's containment check to
            # refuse, by name.
            return spelt
        return "/".join(parts)

    def _under(self, key: str) -> Iterator[str]:
        prefix = key + "/" if key else ""
        for info in self.dcp.list(key):
            # A backend may list the object ``key`` itself: a file is no folder.
            if info["path"].startswith(prefix):
                yield info["path"][len(prefix) :]

    # -- reading -------------------------------------------------------------------
    def _expected(self, key: str) -> dict[str, Any]:
        """What ``key`` was recorded as: its committed directory's record, or
        (a file outside any commit, e.g. ``write_to_temp_dir=False``) the
        record written beside it."""
        parts = key.split("/")
        for depth in range(len(parts) - 1, -1, -1):
            folder = "/".join(parts[:depth])
            commit = f"{folder}/{COMMIT_FILE}" if folder else COMMIT_FILE
            try:
                files = json.loads(self.dcp.read(commit))["files"]
            except StorageNotFound:
                continue
            rel = "/".join(parts[depth:])
            if rel not in files:
                raise CheckpointCorrupt(
                    f"{self.dcp.describe(key)} is not in the commit record {self.dcp.describe(commit)}"
                )
            return dict(files[rel])
        try:
            return dict(json.loads(self.dcp.read(_checksum_name(key))))
        except StorageNotFound:
            pass
        if not self.dcp.exists(key):
            raise StorageNotFound(f"{self.dcp.describe(key)} does not exist")
        raise CheckpointCorrupt(
            f"{self.dcp.describe(key)} has no checksum record: it was not written through "
            "dcpstore's torch_checkpointing storage, or its save did not finish"
        )

    def _read_verified(self, key: str) -> bytes:
        expected = self._expected(key)
        data = self.dcp.read(key)
        crc = f"{crc32c(data):08x}"
        if len(data) != expected["size"] or crc != expected["crc32c"]:
            raise CheckpointCorrupt(
                f"{self.dcp.describe(key)}: {len(data)} bytes with CRC32C {crc}, "
                f"recorded {expected['size']} bytes with CRC32C {expected['crc32c']}"
            )
        return data

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        # A range cannot be checked against a whole-file CRC, so even an
        # offset read (the resharder's) reads and checks the file whole
        # first; positions and lengths are then exact.
        return io.BytesIO(self._read_verified(self._key(path)))  # type: ignore[return-value]

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self._read_verified(self._key(path))

    # -- writing -------------------------------------------------------------------
    def stream_write(self, path: Path) -> io.IOBase:
        return _WriteStream(self, self._key(path))

    def write(self, path: Path, data: Buffer) -> None:
        with _WriteStream(self, self._key(path)) as stream:
            stream.write(data)

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        self.dcp.makedirs(self._key(path))

    # -- deleting ------------------------------------------------------------------
    def delete(self, path: Path) -> None:
        key = self._key(path)
        if not self.dcp.exists(key):
            raise StorageNotFound(f"{self.dcp.describe(key)} does not exist")
        self.dcp.delete([key, _checksum_name(key)])

    def rmdir(self, path: Path) -> None:
        key = self._key(path)
        prefix = f"{key}/" if key else ""
        # The commit record goes first: a directory half deleted is then an
        # uncommitted one, which no read accepts.
        self.dcp.delete([prefix + COMMIT_FILE])
        self.dcp.delete([prefix + rel for rel in list(self._under(key))])
        local = self.dcp.local_path()
        if local is not None and key:
            shutil.rmtree(os.path.join(local, key), ignore_errors=True)

    # -- the commit ---------------------------------------------------------------
    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        src, dst = self._key(src_path), self._key(dst_path)
        with self._rename_lock:
            if self._has_children(src):
                self._commit_directory(src, dst, str(src_path), str(dst_path))
            else:
                self._rename_file(src, dst, str(src_path), str(dst_path))

    def _has_children(self, key: str) -> bool:
        return any(True for _ in self._under(key))

    def _occupied(self, src: str, dst: str, why: int) -> FileExistsError:
        return FileExistsError(
            why,
            f"refusing to rename {self.dcp.describe(src)} onto {self.dcp.describe(dst)}: the destination "
            "is occupied, and a commit never replaces or merges into a checkpoint; delete it first",
        )

    def _commit_directory(self, src: str, dst: str, src_name: str, dst_name: str) -> None:
        if self.dcp.exists(dst):
            raise self._occupied(src, dst, errno.ENOTDIR)
        if self._has_children(dst):
            raise self._occupied(src, dst, errno.ENOTEMPTY)
        names = sorted(self._under(src))
        files: dict[str, Any] = {}
        for rel in names:
            if _hidden(rel.rpartition("/")[2]):
                continue
            try:
                record = json.loads(self.dcp.read(_checksum_name(f"{src}/{rel}")))
            except StorageNotFound:
                raise CheckpointCorrupt(
                    f"{self.dcp.describe(f'{src}/{rel}')} has no checksum record (its write did not "
                    f"finish); {dst_name!r} is not committed"
                ) from None
            files[rel] = record
        commit = json.dumps({"version": 1, "files": files}, sort_keys=True).encode()
        local = self.dcp.local_path()
        if local is not None:
            # A local directory renames atomically: the record goes in first,
            # so the directory appears complete, with it, or not at all.
            self.dcp.put(f"{src}/{COMMIT_FILE}", commit)
            try:
                self._rename_local(os.path.join(local, src), os.path.join(local, dst), src, dst)
            except BaseException:
                # The staging folder is not committed: a retry writes into it
                # again, and a stale record would refuse its new files.
                self.dcp.delete([f"{src}/{COMMIT_FILE}"])
                raise
            return
        # An object store has no rename: each file is copied (and checked
        # against its record on the way), then the record is written last.
        # Until it lands the destination is no checkpoint to a read.
        for rel, record in files.items():
            self._copy_verified(f"{src}/{rel}", f"{dst}/{rel}", record)
        self.dcp.put(f"{dst}/{COMMIT_FILE}", commit)
        self.dcp.delete([f"{src}/{rel}" for rel in names])

    def _rename_local(self, src_local: str, dst_local: str, src: str, dst: str) -> None:
        try:
            os.rename(src_local, dst_local)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise self._occupied(src, dst, e.errno) from e
            raise
        parent = os.path.dirname(dst_local) or "."
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename is the commit: it must survive a crash
        finally:
            os.close(fd)

    def _copy_verified(self, src: str, dst: str, record: dict[str, Any]) -> None:
        size = int(record["size"])
        if self.dcp.size(src) != size:
            raise CheckpointCorrupt(f"{self.dcp.describe(src)}: {self.dcp.size(src)} bytes, recorded {size} bytes")
        crc, offset = 0, 0
        with self.dcp.open_write(dst, size_hint=size) as writer:
            # Stop at the recorded size: a range past the end is an error on
            # some stores (MSC answers 416), not an empty read.
            while offset < size:
                chunk = self.dcp.read_range(src, offset, min(COPY_CHUNK, size - offset))
                if not chunk:
                    break
                crc = crc32c(chunk, crc)
                writer.write(chunk)
                offset += len(chunk)
            if offset != size or f"{crc:08x}" != record["crc32c"]:
                # Raised inside the writer's block: the copy is discarded.
                raise CheckpointCorrupt(
                    f"{self.dcp.describe(src)}: {offset} bytes with CRC32C {crc:08x}, recorded "
                    f"{size} bytes with CRC32C {record['crc32c']}"
                )

    def _rename_file(self, src: str, dst: str, src_name: str, dst_name: str) -> None:
        if self._has_children(dst):
            raise self._occupied(src, dst, errno.EISDIR)
        try:
            record = json.loads(self.dcp.read(_checksum_name(src)))
        except StorageNotFound:
            if not self.dcp.exists(src):
                raise StorageNotFound(f"{self.dcp.describe(src)} does not exist") from None
            raise CheckpointCorrupt(f"{self.dcp.describe(src)} has no checksum record") from None
        # A file onto a file replaces it (the table in torch_checkpointing's
        # Storage.rename); dcpstore's writer makes the replacement atomic.
        self._copy_verified(src, dst, record)
        self.dcp.put(_checksum_name(dst), json.dumps(record).encode())
        self.dcp.delete([src, _checksum_name(src)])

    # -- looking -------------------------------------------------------------------
    def ls(self, path: Path) -> list[str]:
        key = self._key(path)
        names = {rel.split("/", 1)[0] for rel in self._under(key)}
        if not names and not self.isdir(path):
            raise StorageNotFound(f"{self.dcp.describe(key)} is not a directory")
        return sorted(n for n in names if not _hidden(n))

    def exists(self, path: Path) -> bool:
        key = self._key(path)
        return self.dcp.exists(key) or self.isdir(path)

    def getsize(self, path: Path) -> int:
        return self.dcp.size(self._key(path))

    def isdir(self, path: Path) -> bool:
        key = self._key(path)
        if self._has_children(key):
            return True
        local = self.dcp.local_path()
        # An empty local directory (``mkdir``) is one; on an object store
        # a prefix exists only through its objects.
        return local is not None and os.path.isdir(os.path.join(local, key))

    def remap_path(self, path: Path) -> str:
        return self.dcp.describe(self._key(path))
