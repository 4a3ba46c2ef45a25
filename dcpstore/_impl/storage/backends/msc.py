"""MSC backend: storage through NVIDIA Multi-Storage-Client.

Which URIs come here (see :func:`dcpstore._impl.storage.backend_registry.backend_name`):

* ``msc://profile/path``: always. The profile comes from the user's MSC
  config (``MSC_CONFIG``, ``~/.msc_config.yaml``, ``/etc/msc_config.yaml``,
  rclone config) exactly as MSC reads it; endpoint, credentials, retries,
  multipart thresholds and caches are MSC's settings, not dcpstore's.
* ``s3://bucket/path`` and local paths with ``enable_msc=True`` (like
  Megatron's ``--enable-msc``). They are handed to
  ``multistorageclient.resolve_storage_client`` unchanged, so MSC applies its
  ``path_mapping`` first; without a mapping MSC 1.3.1 builds an *implicit
  profile*: ``s3://bucket/...`` becomes profile ``_s3-bucket`` (an S3 provider
  with ``base_path=bucket`` and otherwise boto3's standard sources: env,
  ``AWS_ENDPOINT_URL``, profiles), and a local path becomes the reserved POSIX
  profile ``__filesystem__`` rooted at ``/``.

All I/O goes through MSC's client API (``open``, ``upload_file``, ``read``
with a byte range, ``info``, ``list``, ``delete_many``); dcpstore adds only
what its storage contract needs on top:

Whole-object reads (``.metadata``, the manifest) are one GET each, never
ranges: MSC's ``read`` neither reports nor pins the version it returned, so
two ranges of an object replaced meanwhile could come from two versions.

Commit protocol, object-store profiles (S3, GCS, ...): MSC's client has no
streaming upload, so ``write`` spools the object (in memory up to
:data:`SPOOL_MEMORY`, beyond that in a temporary file under ``TMPDIR``);
commit hands it to ``StorageClient.upload_file`` -- a large one *by name*,
which MSC sends as a boto3 (s3transfer) multipart upload that reads its
parts from the file as it sends them and aborts itself on failure. So an
object never sits in memory whole: the spool's pages are the page cache's,
not the process's (MSC's own ``open(..., "wb")`` spools to a temporary file
too). The object becomes visible atomically when that upload completes; an
abort before commit sends nothing. The spool needs free space under
``TMPDIR`` for the objects being written at once.
A process killed mid-upload can leave an open multipart upload that MSC has no
API to list: use ``dcpstore gc`` on the plain ``s3://`` URI (native backend)
or a bucket lifecycle rule to remove those.

Commit protocol, POSIX profiles: MSC's ``open(path, "wb")`` writes a
``PosixFile`` to ``.<name>.tmp`` in the target directory and renames it over
the final name on ``close`` (atomic visibility). MSC 1.3.1 does not fsync, so
dcpstore calls the file's ``fsync()`` before that close and fsyncs the
directory after it, which makes the rename durable like the local backend's.
The temporary name is fixed per object, so two concurrent writers of the
*same* object would collide (DCP never does that). ``.<name>.tmp`` files are
hidden from :meth:`MSCStorage.list` and reported by ``incomplete_writes``.
Symbolic links, POSIX profiles: a listing shows none and descends into no
linked directory (so ``gc`` never deletes through one), and a file read must
resolve inside the root, as on the local backend
(:class:`~dcpstore._impl.storage.posix.LocalRoot`).

:class:`~dcpstore._impl.storage.storage_options.StorageOptions` sets how dcpstore splits large
reads (``part_size`` ranges, ``max_concurrency`` threads). For the implicit
S3 profile it also sets what MSC's defaults would otherwise decide (60 s
timeouts, botocore's retries under MSC's own, which multiply): dcpstore builds
that profile itself (:func:`_implicit_s3_client`: the user's MSC config still
supplies cache and observability, as MSC's implicit profiles inherit them)
with ``connect_timeout_s`` and ``read_timeout_s``, and ``max_attempts``
attempts per request, botocore's retries alone (MSC's retry layer off), as the
native S3 backend counts them. ``op_timeout_s`` is the native backend's only.
A profile the user configured (by name, or through ``path_mapping``) keeps
its own settings: timeouts and retries are then MSC's config.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any

import multistorageclient as msc
from multistorageclient import types as msc_types
from multistorageclient.types import Range

from dcpstore._impl.storage.backend_base import BackendBase
from dcpstore._impl.storage.backends.s3.aws_env import aws_retry_mode, client_key
from dcpstore._impl.storage.backends.s3.error_codes import Meaning, code_in_text, meaning
from dcpstore._impl.storage.base import ObjectInfo, ObjectWriter
from dcpstore._impl.storage.buffered import BufferedObjectWriter
from dcpstore._impl.storage.byte_ranges import byte_ranges
from dcpstore._impl.storage.concurrency import disk_workers
from dcpstore._impl.storage.error_mapping import library_detail, library_text, map_os_error
from dcpstore._impl.storage.incomplete import IncompleteWrite
from dcpstore._impl.storage.posix import LocalRoot, fsync_dir
from dcpstore._impl.storage.secrets import scrub_exception
from dcpstore._impl.storage.storage_options import MiB, StorageOptions
from dcpstore._impl.storage.uri import StorageURL
from dcpstore._impl.util.errors import (
    CheckpointError,
    InvalidURI,
    StorageError,
    StorageNotFound,
    StoragePermissionError,
)

#: ``client.list``'s symlink handling that lists no link (None: an MSC
#: release without the option).
_SKIP_LINKS = getattr(getattr(msc_types, "SymlinkHandling", None), "SKIP", None)

#: Per object, spooled bytes stay in memory up to this size, then go to a
#: temporary file (see the module docstring).
SPOOL_MEMORY = 8 * MiB


_implicit_clients: dict[tuple[Any, ...], Any] = {}
_implicit_lock = threading.Lock()


def _user_profile_for(url: StorageURL) -> bool:
    """Whether the user's MSC config decides how ``url`` (``s3://``) is
    reached: a ``path_mapping`` entry, or a profile named as MSC's implicit
    one (``_s3-<bucket>``)."""
    if msc.StorageClientConfig.read_path_mapping().find_mapping(url.uri) is not None:
        return True
    config, _ = msc.StorageClientConfig.read_msc_config()
    return f"_s3-{url.netloc}" in ((config or {}).get("profiles") or {})


def _implicit_s3_client(url: StorageURL, options: StorageOptions) -> Any:
    """MSC's implicit profile for ``s3://<bucket>`` (``_s3-<bucket>``: base
    path the bucket, endpoint and credentials from boto3's standard sources),
    built with ``options``' timeouts and attempts (see the module docstring).

    One client per process, profile, options and environment, shared as
    ``resolve_storage_client`` shares its clients (building one costs a
    config read and a boto3 client)."""
    profile = f"_s3-{url.netloc}"
    key = client_key(options, profile, os.environ.get("MSC_CONFIG"))
    with _implicit_lock:
        client = _implicit_clients.get(key)
        if client is None:
            config, _ = msc.StorageClientConfig.read_msc_config()
            config = copy.deepcopy(config or {})
            config.setdefault("profiles", {})[profile] = {
                "storage_provider": {
                    "type": "s3",
                    "options": {
                        "base_path": url.netloc,
                        "connect_timeout": options.connect_timeout_s,
                        "read_timeout": options.read_timeout_s,
                        # total_max_attempts counts the first try, like max_attempts.
                        "retries": {"mode": aws_retry_mode(), "total_max_attempts": options.max_attempts},
                    },
                },
                # botocore retries each request; MSC's loop around it would
                # multiply the attempts (and the time a dead endpoint takes).
                "retry": {"attempts": 1},
            }
            built = msc.StorageClientConfig.from_dict(
                config, profile=profile, skip_validation=True, telemetry_provider=msc.get_telemetry_provider()
            )
            client = _implicit_clients[key] = msc.StorageClient(built)
        return client


def _open_client(url: StorageURL, options: StorageOptions) -> tuple[Any, str]:
    """The MSC client for ``url`` and the path in it, as
    ``resolve_storage_client`` finds them, except MSC's implicit S3 profile,
    which takes ``options`` (:func:`_implicit_s3_client`)."""
    if url.scheme == "s3" and not _user_profile_for(url):
        return _implicit_s3_client(url, options), url.path
    return msc.resolve_storage_client(url.path if url.scheme == "file" else url.uri)


def _is_posix_tmp(name: str) -> bool:
    """MSC's PosixFile writes ``.<name>.tmp`` before renaming it into place."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".") and base.endswith(".tmp") and len(base) > len("..tmp")


def _client_error(e: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status somewhere in ``e``'s cause chain.

    MSC re-raises provider errors as built-ins (FileNotFoundError for any 404,
    PermissionError for 403, RuntimeError otherwise); the original botocore
    ``ClientError`` stays in the chain and tells NoSuchBucket from NoSuchKey.
    DeleteObjects' per-key errors MSC reports only as text.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code") or "")
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code or status:
                return code, status
        cur = cur.__cause__ or cur.__context__
    return code_in_text(str(e)), 0


class MSCStorage(BackendBase):
    """A path in one MSC profile (explicit, implicit or the POSIX default)."""

    backend = "msc"

    def __init__(self, url: StorageURL, options: StorageOptions | None = None) -> None:
        super().__init__(url, options)
        try:
            self.client, root = _open_client(url, self.options)
        except ValueError as e:
            scrub_exception(e)  # a config error may quote the profile's keys
            raise InvalidURI(f"MSC cannot open {self.uri}: {library_text(str(e))}") from e
        except CheckpointError:
            raise
        except Exception as e:
            raise StorageError(f"MSC cannot open {self.uri}: {library_detail(e)}") from e
        self.root = root.rstrip("/")
        self.posix_root = self.client.get_posix_path(self.root) if self.root else self.client.get_posix_path("")
        # MSC returns listed keys relative to the profile's base path, without
        # a leading slash (also for the POSIX profile rooted at "/").
        self._key_root = self.root.strip("/")
        self._bucket = url.netloc if url.scheme == "s3" else self.client.profile
        self._local = LocalRoot(self.posix_root) if self.posix_root is not None else None

    def _check_inside(self, path: str) -> None:
        """POSIX profiles: what is read resolves inside the root (see :class:`LocalRoot`)."""
        if self._local is not None:
            target = self.client.get_posix_path(self._full(path))
            if target is not None:
                self._local.check_path(target, self.describe(path))

    @property
    def is_posix(self) -> bool:
        return self.posix_root is not None

    def local_path(self) -> str | None:
        return str(self.posix_root) if self.posix_root is not None else None

    def default_workers(self) -> int:
        """A POSIX profile is a disk (see :func:`~dcpstore._impl.storage.concurrency.disk_workers`);
        any other profile an object store (see :meth:`Storage.default_workers`)."""
        return disk_workers() if self.is_posix else super().default_workers()

    def _full(self, path: str) -> str:
        return self._join_root(self.root, path)

    def _relative(self, key: str) -> str:
        key = key.lstrip("/")
        return key[len(self._key_root) + 1 :] if self._key_root else key

    def _map_error(self, e: Exception, what: str) -> CheckpointError:
        code, status = _client_error(e)
        found = meaning(code, status)
        profile = self.client.profile
        if found is Meaning.NO_BUCKET:
            return StorageNotFound(f"{what}: bucket {self._bucket!r} does not exist (MSC profile {profile!r})")
        if found is Meaning.NOT_FOUND or isinstance(e, FileNotFoundError):
            return StorageNotFound(f"{what}: no such object")
        if found is Meaning.BAD_CREDENTIALS:
            return StoragePermissionError(
                f"{what}: the storage refused the credentials of MSC profile {profile!r} ({code})"
            )
        if found is Meaning.DENIED or isinstance(e, PermissionError):
            return StoragePermissionError(
                f"{what}: access denied for MSC profile {profile!r} ({code or status or 'permission denied'}): "
                "the credentials were refused or lack permission"
            )
        if code:
            return StorageError(f"{what}: {type(e).__name__} ({library_text(code)}): {library_text(str(e))}")
        return map_os_error(e, what)

    # -- writing -------------------------------------------------------------
    def open_write(self, path: str, *, size_hint: int | None = None, batch_hint: int | None = None) -> ObjectWriter:
        what = f"cannot write {self.describe(path)}"
        if self.is_posix:
            with self._mapped(what):
                handle = self.client.open(self._full(path), "wb")
            return _PosixWriter(self, path, handle)
        return _SpoolWriter(self, path)

    def put(self, path: str, data: bytes | bytearray | memoryview, *, durable: bool = True) -> None:
        if self.is_posix:  # always durable: dcpstore's fsyncs around MSC's own writes
            super().put(path, data)
            return
        with self._mapped(f"cannot write {self.describe(path)}"):
            self.client.write(self._full(path), bytes(data))

    def makedirs(self, path: str = "") -> None:
        full = self._full(path)  # object stores need no directories, but the path is still checked
        if self.is_posix:
            target = self.client.get_posix_path(full)
            assert target is not None
            with self._mapped(f"cannot create directory {self.describe(path)}"):
                os.makedirs(target, exist_ok=True)

    # -- reading -------------------------------------------------------------
    def _read_one(self, full: str, offset: int, length: int | None) -> bytes:
        """One GET of ``length`` bytes at ``offset`` (``None``: the whole object)."""
        try:
            if length is None:
                return bytes(self.client.read(full))
            return bytes(self.client.read(full, byte_range=Range(offset=offset, size=length)))
        except Exception as e:
            if meaning(*_client_error(e)) is Meaning.PAST_END:
                return b""  # offset at or past the end of the object
            raise

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            self.size(path)
            return b""
        full = self._full(path)
        ps = self.options.part_size_for(length)
        self._check_inside(path)
        with self._mapped(f"cannot read {self.describe(path)}"):
            if length <= ps or self.options.max_concurrency == 1:
                return self._read_one(full, offset, length)
            chunks = self._in_parallel(self._read_one, [(full, o, n) for o, n in byte_ranges(offset, length, ps)])
        return b"".join(chunks)

    def read(self, path: str, *, limit: int | None = None) -> bytes:
        """The size, then one GET for the whole object (MSC's ``read`` neither
        reports nor pins a version, so ranges of one object could be of two):
        see :meth:`BackendBase._read_one_version`."""
        try:
            size = self.size(path)
        except (StorageNotFound, StoragePermissionError):
            # A HEAD's 404/403 carries no error code; a GET's says whether the
            # key or the bucket is missing, or which credential check failed.
            # (One byte asked: it raises that error; should the object have
            # appeared meanwhile, its size is asked again.)
            with self._mapped(f"cannot read {self.describe(path)}"):
                self.client.read(self._full(path), byte_range=Range(offset=0, size=1))
            size = self.size(path)
        self.check_limit(path, size, limit)
        full = self._full(path)
        with self._mapped(f"cannot read {self.describe(path)}"):
            return self._read_one_version(path, size, limit, lambda n: self._read_one(full, 0, n))

    def size(self, path: str) -> int:
        self._check_inside(path)
        with self._mapped(f"cannot stat {self.describe(path)}"):
            info = self.client.info(self._full(path))
        if info.type != "file":
            raise StorageNotFound(f"cannot stat {self.describe(path)}: is a {info.type}, not an object")
        return int(info.content_length)

    def _walk(self, prefix: str) -> Iterator[Any]:
        prefix = prefix.strip("/")
        full = self._full(prefix) if prefix else self.root
        key_full = full.strip("/")
        listing = f"{full}/" if full else ""
        # POSIX profiles list no symbolic link: MSC's default follows them
        # (into directories outside the checkpoint, which gc would then
        # delete from) and fails the whole listing on a loop.
        no_links = {"symlink_handling": _SKIP_LINKS} if self.is_posix and _SKIP_LINKS is not None else {}
        with self._mapped(f"cannot list {self.describe(prefix)}"):
            for obj in self.client.list(path=listing, include_directories=False, **no_links):
                key = obj.key.lstrip("/")
                if key_full and key != key_full and not key.startswith(key_full + "/"):
                    continue
                yield obj

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for obj in self._walk(prefix):
            if obj.type == "file" and not (self.is_posix and _is_posix_tmp(obj.key)):
                info: ObjectInfo = {"path": self._relative(obj.key), "size": int(obj.content_length)}
                if obj.last_modified is not None:
                    info["mtime"] = obj.last_modified.timestamp()
                yield info

    # -- deleting ------------------------------------------------------------
    def delete(self, paths: Iterable[str]) -> None:
        full = [self._full(p) for p in paths]
        if not full:
            return
        with self._mapped(f"cannot delete {len(full)} object(s) under {self.uri}"):
            self.client.delete_many(full)

    def incomplete_writes(self) -> Sequence[IncompleteWrite]:
        """POSIX profiles: MSC's ``.<name>.tmp`` files. Object profiles: none
        visible through MSC (see the module docstring)."""
        if not self.is_posix:
            return []
        now = time.time()
        return [
            IncompleteWrite(self._relative(obj.key), now - obj.last_modified.timestamp())
            for obj in self._walk("")
            if _is_posix_tmp(obj.key)
        ]

    def remove_incomplete(self, writes: Iterable[IncompleteWrite], older_than_s: float = 0.0) -> int:
        """A ``.<name>.tmp`` name is reused by every write of ``name``: each
        is looked at again, and one written to within ``older_than_s`` kept."""
        stale = []
        for write in writes:
            try:
                info = self.client.info(self._full(write.path))
            except Exception:  # gone (renamed into place, or removed): nothing to do
                continue
            if time.time() - info.last_modified.timestamp() >= older_than_s:
                stale.append(write.path)
        self.delete(stale)
        return len(stale)


class _PosixWriter(BufferedObjectWriter):
    """MSC's PosixFile (temp + rename on close), made durable with fsyncs."""

    def __init__(self, storage: MSCStorage, path: str, handle: Any) -> None:
        super().__init__(storage, path)
        self._f = handle

    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        self._f.write(part)

    def _publish(self, tail: bytearray) -> None:
        self._f.flush()
        self._f.fsync()  # MSC renames without fsync; make the data durable first
        final = self._f.resolve_filesystem_path()
        self._f.close()  # renames .<name>.tmp over <name>
        fsync_dir(os.path.dirname(final) or ".")

    def _discard(self) -> None:
        with contextlib.suppress(Exception):
            self._f.discard()


class _SpoolWriter(BufferedObjectWriter):
    """Spool locally, then one MSC ``upload_file`` at commit (PUT or multipart);
    see the module docstring."""

    def __init__(self, storage: MSCStorage, path: str) -> None:
        super().__init__(storage, path)
        self._client = storage.client
        self._full = storage._full(path)
        self._memory = bytearray()
        self._file: IO[bytes] | None = None

    def _write_part(self, part: bytes | bytearray | memoryview) -> None:
        if self._file is None and len(self._memory) + len(part) <= SPOOL_MEMORY:
            self._memory += part
            return
        if self._file is None:
            self._file = tempfile.NamedTemporaryFile(prefix=".dcpstore-msc-", suffix=".spool")  # noqa: SIM115
            self._file.write(self._memory)
            self._memory = bytearray()
        self._file.write(part)

    def _publish(self, tail: bytearray) -> None:
        try:
            if self._file is None:
                self._client.write(self._full, bytes(self._memory))
            else:
                self._file.flush()
                # By name: s3transfer then reads each part from the file as it
                # sends it (given a file object, it would hold parts in memory).
                self._client.upload_file(self._full, self._file.name)
        finally:
            self._discard()

    def _discard(self) -> None:
        self._memory = bytearray()
        if self._file is not None:
            self._file.close()  # deletes it
            self._file = None
