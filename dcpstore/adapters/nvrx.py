"""The seam to nvidia-resiliency-ext (NVRx) async checkpointing.

Everything that depends on *which* NVRx release is installed lives here, and
is decided by feature detection (``hasattr`` / signature checks), never by
version numbers. Tested against 0.4.1 (the newest release installable on
Python 3.11); written to also accept the 0.5+ layout, where the per-bucket
write is ``FileSystemWriterAsync._write_bucket_to_storage``.

What dcpstore takes from NVRx, and why it drives the pieces itself:

* ``save_state_dict_async_plan`` (planning, with NVRx's
  ``CheckpointMetadataCache`` so repeated saves of one structure skip the
  plan exchange) and ``save_state_dict_async_finalize`` (gather of the
  write results, failure check, coordinator ``finish``): used as they are.
  A *private* cache instance is passed per structure; NVRx's module-global
  cache is never touched. Releases whose planner lacks the
  ``metadata_cache`` parameter run without the cache.
* ``_split_by_size_and_type`` (size-balanced buckets, one file each) and the
  per-bucket writer (``write_preloaded_data``: ``torch.save`` per item into
  ``open()`` or ``msc.open()``, then ``fsync``): used as they are, but run in
  dcpstore's own thread pool. NVRx 0.4.1 forks one process per bucket and
  gathers results through a spawn-context ``Manager`` (which re-imports
  ``__main__``), its ``preload_tensors`` calls ``torch.cuda.synchronize()``
  and its ``AsyncCallsQueue`` all-reduces on a CUDA device: none of that works
  on CPU-only torch, and the staging it does is dcpstore's job anyway.
  NVRx wraps the per-bucket writer in ``_disable_gc`` (a process-wide
  ``gc.disable()`` meant for forked children); run in a thread it would
  switch the training thread's GC too, so the undecorated function is called.
"""

from __future__ import annotations

import errno
import inspect
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from ..storage import Storage

INSTALL_HINT = "pip install 'dcpstore[nvrx]' (nvidia-resiliency-ext)"
_FS_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
_SAVER_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver"


def import_error() -> str | None:
    """Why NVRx's async checkpointing cannot be imported (``None``: it can)."""
    try:
        fs = __import__(_FS_MODULE, fromlist=["FileSystemWriterAsync"])
        saver = __import__(_SAVER_MODULE, fromlist=["save_state_dict_async_plan"])
    except ImportError as e:
        return f"nvidia-resiliency-ext is not installed ({e.name or e})"
    except Exception as e:  # a broken install: say so rather than crash selection
        return f"nvidia-resiliency-ext failed to import ({type(e).__name__}: {e})"
    missing = [
        name
        for mod, name in (
            (fs, "FileSystemWriterAsync"),
            (fs, "_split_by_size_and_type"),
            (saver, "save_state_dict_async_plan"),
            (saver, "save_state_dict_async_finalize"),
        )
        if not hasattr(mod, name)
    ]
    if missing:
        return f"the installed nvidia-resiliency-ext lacks {', '.join(missing)}"
    return None


def require() -> None:
    """Raise :class:`BackendUnavailable` with the install hint if NVRx is unusable."""
    reason = import_error()
    if reason is not None:
        raise BackendUnavailable(f"engine='nvrx' needs nvidia-resiliency-ext: {reason}; {INSTALL_HINT}")


@dataclass(frozen=True)
class NvrxTarget:
    """Where NVRx writes: a POSIX directory, or an MSC URL with ``use_msc``."""

    path: str
    use_msc: bool


def target_for(storage: Storage) -> NvrxTarget | str:
    """The NVRx location for ``storage``, or the reason NVRx cannot write there.

    NVRx writes with ``open()`` (POSIX) or ``msc.open()``: dcpstore's local
    backend and its MSC backend qualify; the native S3 and fsspec backends
    do not.
    """
    if storage.backend == "local":
        return NvrxTarget(storage.url.path, use_msc=False)
    if storage.backend == "msc":
        # MSC resolves msc://profile/..., s3://bucket/... (implicit profile)
        # and POSIX paths itself.
        return NvrxTarget(storage.url.uri, use_msc=True)
    # No URI in the reason: the auto-fallback warning built from it stays
    # one message per backend, which Python's warning filter shows once.
    return (
        f"NVRx writes only POSIX paths and MSC URLs, not the {storage.backend} backend; "
        "pass enable_msc=True to go through MSC, or engine='native'"
    )


def check_target(storage: Storage) -> NvrxTarget:
    target = target_for(storage)
    if isinstance(target, str):
        raise InvalidArgument(f"engine='nvrx' cannot save to {storage.uri}: {target}")
    return target


# -- planning ---------------------------------------------------------------


def new_metadata_cache() -> Any | None:
    """A private ``CheckpointMetadataCache``, or ``None`` if this release
    cannot take one per call (then saves run uncached)."""
    saver = __import__(_SAVER_MODULE, fromlist=["save_state_dict_async_plan"])
    params = inspect.signature(saver.save_state_dict_async_plan).parameters
    if "metadata_cache" not in params or not hasattr(saver, "CheckpointMetadataCache"):
        return None
    return saver.CheckpointMetadataCache()


def plan(
    state_dict: dict[str, Any], writer: Any, process_group: Any, planner: Any, cache: Any | None
) -> tuple[Any, Any, Any]:
    """``save_state_dict_async_plan``: returns (writer, metadata, dist wrapper)."""
    saver = __import__(_SAVER_MODULE, fromlist=["save_state_dict_async_plan"])
    kwargs: dict[str, Any] = {"process_group": process_group, "coordinator_rank": 0, "planner": planner}
    if cache is not None:
        kwargs.update(enable_cache=True, metadata_cache=cache)
    writer, metadata, wrapper = saver.save_state_dict_async_plan(state_dict, writer, **kwargs)
    return writer, metadata, wrapper


def finalize(writer: Any, metadata: Any, dist_wrapper: Any) -> None:
    saver = __import__(_SAVER_MODULE, fromlist=["save_state_dict_async_finalize"])
    saver.save_state_dict_async_finalize(writer, metadata, dist_wrapper)


# -- writing ----------------------------------------------------------------


def split_items(bins: int, items: list[Any]) -> list[list[Any]]:
    fs = __import__(_FS_MODULE, fromlist=["_split_by_size_and_type"])
    return list(fs._split_by_size_and_type(bins, items))


def writer_base() -> type:
    fs = __import__(_FS_MODULE, fromlist=["FileSystemWriterAsync"])
    return fs.FileSystemWriterAsync  # type: ignore[no-any-return]


def bucket_writer(writer: Any) -> Callable[[Any], list[Any]]:
    """A function writing one NVRx ``WriteBucket`` (file path, storage key,
    (bytes items, tensor items)) on the calling thread and returning its
    DCP write results; raises what the write raised.

    A storage error inside ``torch.save`` (ENOSPC, EIO) reaches torch's C++
    zip writer, which reports only its own ``RuntimeError`` ("unexpected
    pos ..."), and a disk that fills mid-write first returns a short write,
    which the zip writer counts as written. Where torch's ``_write_item``
    takes stream transforms (torch >= 2.7; NVRx passes them on), every write
    goes through :class:`CheckedTransforms`, which completes short writes
    and keeps the first ``OSError``: that is what this function raises then.
    """
    cls = type(writer)
    base = writer.transforms if hasattr(writer, "transforms") else None
    use_msc = bool(writer.use_msc)
    open_file = _open_file(writer, use_msc)
    direct = getattr(cls, "_write_bucket_to_storage", None)
    if direct is not None:  # 0.5+: a plain per-bucket function

        def write_direct(bucket: Any) -> list[Any]:
            checked = CheckedTransforms(base) if base is not None else None
            try:
                return list(direct([checked] if checked else [], open_file, bucket, True, use_msc))
            except BaseException:
                if checked is not None and checked.error is not None:
                    raise checked.error from None
                raise

        return write_direct
    raw = inspect.unwrap(cls.write_preloaded_data)  # skip the process-wide _disable_gc
    params = inspect.signature(raw).parameters
    idx_name = next((p for p in ("local_proc_idx", "local_thread_idx") if p in params), "local_proc_idx")
    msc_kw = "use_msc" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def write(bucket: Any) -> list[Any]:
        checked = CheckedTransforms(base) if base is not None else None
        transforms = [checked] if checked is not None else []
        lead = [transforms, open_file] if "open_file" in params else [transforms]
        results: queue.Queue[Any] = queue.Queue()
        done: queue.Queue[int] = queue.Queue()  # NVRx's count queue: get() + task_done()
        done.put(0)
        kwargs: dict[str, Any] = {
            idx_name: 0,
            "write_bucket": bucket,
            "results_queue": results,
            "count_queue": done,
            "use_fsync": True,
        }
        if msc_kw:
            kwargs["use_msc"] = use_msc
        raw(*lead, **kwargs)
        _, out = results.get_nowait()
        if isinstance(out, BaseException):
            if checked is not None and checked.error is not None:
                raise checked.error from None  # the storage's error, not torch's report of it
            raise out
        return list(out)

    return write


class CheckedTransforms:
    """torch's stream transforms for one bucket, with every write made whole
    and the first ``OSError`` kept (see :func:`bucket_writer`)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.error: OSError | None = None

    def transform_save_stream(self, write_item: Any, raw_stream: Any) -> Any:
        return self._inner.transform_save_stream(write_item, _WholeWrites(raw_stream, self))


class _WholeWrites:
    """Writes all of every buffer to ``raw`` (a short write is retried, so a
    full disk surfaces as its ENOSPC) and records the first ``OSError``.
    (Not an ``io.IOBase``: its finaliser would flush ``raw`` again at
    garbage collection, long after NVRx closed it.)"""

    def __init__(self, raw: Any, owner: CheckedTransforms) -> None:
        self._raw = raw
        self._owner = owner

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        try:
            while view.nbytes:
                n = self._raw.write(view)
                if not n:  # neither progress nor an error: say so rather than spin
                    raise OSError(errno.EIO, f"write made no progress ({view.nbytes} bytes left)")
                view = view[n:]
        except OSError as e:
            self._owner.error = self._owner.error or e
            raise
        return size

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            self._owner.error = self._owner.error or e
            raise

    def close(self) -> None:
        """The bucket's file stays open for its next item; NVRx closes it."""
        self.flush()


def _open_file(writer: Any, use_msc: bool) -> Callable[..., Any]:
    if use_msc:
        import multistorageclient as msc

        opener: Callable[..., Any] = msc.open
        return opener
    opener = getattr(writer, "open_file", open)
    return opener
