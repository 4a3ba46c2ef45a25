"""The NVRx release seam: everything that depends on which NVRx release is
installed, decided by feature detection (``hasattr`` and signature checks),
never by version numbers.

Tested with 0.4.1 (Python 3.11, the newest release installable there) and
with 0.6.0 and 0.7.0 (Python 3.12: they ship only cp312 wheels; CI unpacks
them side by side, ``scripts/setup-nvrx312.sh``), in ``tests/integration/test_engines.py``,
``tests/processes/test_multirank_async.py`` and, for Megatron's drop-in writer,
``tests/frameworks/test_megatron_bridge.py``. What differs between them and is
detected here:

* the per-bucket write: from 0.5 the plain function
  ``FileSystemWriterAsync._write_bucket_to_storage``; on 0.4.x
  ``write_preloaded_data``, meant for a forked worker with multiprocessing
  queues, whose undecorated function :func:`bucket_writer` calls on the
  calling thread (NVRx wraps it in ``_disable_gc``, a process-wide
  ``gc.disable()`` meant for forked children);
* the planner's per-call ``metadata_cache`` (:func:`new_metadata_cache`);
* finalize: 0.6 added a failure broadcast on a CUDA device, which
  :func:`finalize` leaves out (it says why).

What dcpstore takes from NVRx and why it runs NVRx's pieces in its own
threads is in :mod:`.nvrx`. Megatron's drop-in writer
(:mod:`dcpstore._impl.adapters.megatron_async`) takes nothing from here but
the protocol: NVRx's planner, finalize and queue drive it.
"""

from __future__ import annotations

import inspect
import queue
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from dcpstore._impl.engines.nvrx_stream import CheckedTransforms
from dcpstore._impl.util.torch_compat import failure_dict

FS_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async"
SAVER_MODULE = "nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver"


def import_error() -> str | None:
    """Why NVRx's async checkpointing cannot be imported (``None``: it can)."""
    try:
        fs = __import__(FS_MODULE, fromlist=["FileSystemWriterAsync"])
        saver = __import__(SAVER_MODULE, fromlist=["save_state_dict_async_plan"])
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
        )
        if not hasattr(mod, name)
    ]
    if missing:
        return f"the installed nvidia-resiliency-ext lacks {', '.join(missing)}"
    return None


def module(name: str, attr: str) -> Any:
    return __import__(name, fromlist=[attr])


def new_metadata_cache() -> Any | None:
    """A private ``CheckpointMetadataCache``, or ``None`` if this release
    cannot take one per call (then saves run uncached)."""
    saver = module(SAVER_MODULE, "save_state_dict_async_plan")
    params = inspect.signature(saver.save_state_dict_async_plan).parameters
    if "metadata_cache" not in params or not hasattr(saver, "CheckpointMetadataCache"):
        return None
    return saver.CheckpointMetadataCache()


def plan(
    state_dict: dict[str, Any], writer: Any, process_group: Any, planner: Any, cache: Any | None
) -> tuple[Any, Any, Any]:
    """``save_state_dict_async_plan``: returns (writer, metadata, dist wrapper)."""
    saver = module(SAVER_MODULE, "save_state_dict_async_plan")
    kwargs: dict[str, Any] = {"process_group": process_group, "coordinator_rank": 0, "planner": planner}
    if cache is not None:
        kwargs.update(enable_cache=True, metadata_cache=cache)
    writer, metadata, wrapper = saver.save_state_dict_async_plan(state_dict, writer, **kwargs)
    return writer, metadata, wrapper


def finalize(writer: Any, metadata: Any, dist_wrapper: Any) -> None:
    """``save_state_dict_async_finalize`` as every release does it up to its
    report of a failure: each rank's write results (or its wrapped error)
    gathered on the coordinator, which raises ``CheckpointException``
    naming the failed ranks, or else calls ``writer.finish``.

    Not NVRx's own function: from 0.6 it then broadcasts whether the save
    failed in a one-int tensor on ``torch.cuda.current_device()``. On
    CPU-only torch that raises on every rank after the coordinator has
    committed; on a GPU machine, on the saver's background thread (whose
    CUDA device is 0 whatever the trainer bound), every rank would create a
    context on GPU 0. The engine broadcasts the outcome itself, on its gloo
    group (:func:`~.nvrx.nvrx_save`), so that step is left out.
    """
    results = writer.retrieve_write_results()
    gathered = dist_wrapper.gather_object(results)
    if not dist_wrapper.is_coordinator:
        return
    failures = failure_dict(gathered)
    if failures:
        raise CheckpointException("write", failures)
    writer.finish(metadata, gathered)


def split_items(bins: int, items: list[Any]) -> list[list[Any]]:
    return list(module(FS_MODULE, "_split_by_size_and_type")._split_by_size_and_type(bins, items))


def bucket_writer(transforms: Any, use_msc: bool) -> Callable[[Any], tuple[list[Any], dict[Any, tuple[int, int]]]]:
    """A function writing one NVRx ``WriteBucket`` (file path, storage key,
    (bytes items, tensor items)) on the calling thread with NVRx's writer
    (``transforms``: torch's ``_StorageWriterTransforms`` for every item;
    ``use_msc``: open the path with ``msc.open``), returning its DCP write
    results and the located tensors (item index -> offset of the raw bytes
    in the item, nbytes; :mod:`.nvrx_stream`); raises what the write
    raised, or the storage's ``OSError`` where torch's zip writer hid it."""
    cls = module(FS_MODULE, "FileSystemWriterAsync").FileSystemWriterAsync
    base = transforms
    open_file = _open_file(use_msc)
    write_one: Callable[[list[Any], Any], list[Any]]
    direct = getattr(cls, "_write_bucket_to_storage", None)
    if direct is not None:  # 0.5+: a plain per-bucket function
        write_one = lambda transforms, bucket: list(direct(transforms, open_file, bucket, True, use_msc))  # noqa: E731
    else:
        write_one = _preloaded_writer(cls, open_file, use_msc)

    def write(bucket: Any) -> tuple[list[Any], dict[Any, tuple[int, int]]]:
        checked = CheckedTransforms(base, bucket[2][1]) if base is not None else None
        try:
            results = write_one([checked] if checked is not None else [], bucket)
        except BaseException:
            if checked is not None and checked.error is not None:
                raise checked.error from None  # the storage's error, not torch's report of it
            raise
        return results, checked.raw if checked is not None else {}

    return write


def _preloaded_writer(cls: type, open_file: Callable[..., Any], use_msc: bool) -> Callable[[list[Any], Any], list[Any]]:
    """0.4.x: ``write_preloaded_data`` with its process-pool queues, called
    on this thread."""
    raw = inspect.unwrap(cls.write_preloaded_data)  # type: ignore[attr-defined]  # skip the process-wide _disable_gc
    params = inspect.signature(raw).parameters
    idx_name = next((p for p in ("local_proc_idx", "local_thread_idx") if p in params), "local_proc_idx")
    msc_kw = "use_msc" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def write(transforms: list[Any], bucket: Any) -> list[Any]:
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
            raise out
        return list(out)

    return write


def _open_file(use_msc: bool) -> Callable[..., Any]:
    if use_msc:
        import multistorageclient as msc

        opener: Callable[..., Any] = msc.open
        return opener
    return open
