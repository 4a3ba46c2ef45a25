"""Beneath DCP's own entry points: :class:`StorageWriter` and :class:`StorageReader`.

Code that calls ``torch.distributed.checkpoint`` directly switches to dcpstore
by changing one constructor::

    dcp.save(state_dict, storage_writer=dcpstore.StorageWriter("s3://b/run/step100"))
    dcp.load(state_dict, storage_reader=dcpstore.StorageReader("s3://b/run/step100"))
    dcp.async_save(state_dict, storage_writer=dcpstore.StorageWriter(path))

They take ``FileSystemWriter``'s and ``FileSystemReader``'s keyword arguments
(each is honoured, or refused with :class:`~dcpstore.InvalidArgument` naming
it; see the class docstrings), s3torchconnector's ``region`` (their rows in
:data:`dcpstore._impl.util.keyword_hints.FRAMEWORK_NAMES`), and dcpstore's options
whole (``options=``: :class:`~dcpstore.SaveOptions` /
:class:`~dcpstore.LoadOptions`, what :func:`dcpstore.save` and
:func:`dcpstore.load` take as keywords). One writer or reader
serves any number of checkpoints: ``checkpoint_id=`` re-points it, as
torchtitan and Megatron-Bridge reuse one writer across steps, also while
``dcp.async_save`` calls made through it earlier still run (each save keeps
its own URI, session and staged copy: see :mod:`dcpstore._impl.dcp.writer`).

The writer is also DCP's ``AsyncStager``: ``dcp.async_save`` stages through
it the way ``dcpstore.save(async_=True)`` stages (a consistent host copy of
every tensor, CPU tensors included; see :mod:`dcpstore._impl.engines.staging`), on
either executor DCP offers (thread or process: the writer pickles to the
checkpoint process and reopens its storage there).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dcpstore._impl.dcp.liveness.retried_cleanups import Leftovers, with_leftovers
from dcpstore._impl.dcp.load_progress import LoadProgress
from dcpstore._impl.dcp.reader import DcpStorageReader
from dcpstore._impl.dcp.writer import DcpStorageWriter
from dcpstore._impl.engines.exit import Stage, watch
from dcpstore._impl.engines.staging import Staging
from dcpstore._impl.storage import Storage, StorageOptions, open_storage
from dcpstore._impl.storage.backend_registry import registered_backends, restore_backends
from dcpstore._impl.util.errors import CheckpointError, InvalidArgument
from dcpstore._impl.util.keyword_hints import hint_keywords_with
from dcpstore._impl.util.progress import NO_PROGRESS
from dcpstore._impl.util.torch_compat import ExtensionRegistry, StreamTransformExtension
from dcpstore._impl.values.keywords import OptionsT, pass_whole, resolve_options
from dcpstore._impl.values.options import AUTO, LoadOptions, SaveOptions

#: What to use instead of s3torchconnector's arguments that select its own
#: client and readers.
_S3TORCH_INSTEAD = {
    "s3client_config": "pass options=dcpstore.SaveOptions(storage_options=dcpstore.StorageOptions(...)) "
    "(part size, concurrency, retries, timeouts)",
    "reader_constructor": "dcpstore plans its own ranged reads; leave it out",
    "prefix_strategy": "dcpstore writes every file under the checkpoint's own prefix; leave it out",
}


def _refuse_s3torch(**given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            raise InvalidArgument(
                f"{name} is s3torchconnector's and has no meaning for dcpstore: {_S3TORCH_INSTEAD[name]}"
            )


def _storage_options(storage_options: StorageOptions | None, region: str | None) -> StorageOptions | None:
    """``storage_options`` with s3torchconnector's ``region`` folded in."""
    if region is None:
        return storage_options
    if storage_options is not None and storage_options.region not in (None, region):
        raise InvalidArgument(
            f"region={region!r} contradicts storage_options.region={storage_options.region!r}; pass one of them"
        )
    return dataclasses.replace(storage_options or StorageOptions(), region=region)


#: What an options value may say that the call to DCP decides, not its
#: writer or reader: option -> what to do instead (``async_`` and
#: ``max_in_flight`` are the choice of ``dcp.save`` or ``dcp.async_save``
#: and are not read).
_THE_CALLS = {
    "process_group": "pass process_group= to dcp.save / dcp.load",
    "planner": "pass planner= to dcp.save / dcp.load",
    "progress": "the drop-ins draw no progress bar (dcpstore.save and load do)",
    "save_id": "each save through the writer gets its own id",
}


def _refuse_the_calls(options: SaveOptions | LoadOptions) -> None:
    """Refuse what ``options`` set that a writer or reader under DCP cannot honour."""
    for name, instead in _THE_CALLS.items():
        value = getattr(options, name, None)
        if value not in (None, False):
            raise InvalidArgument(f"options.{name}={value!r} is not the drop-in's to honour: {instead}")
    engine = getattr(options, "engine", AUTO)
    if engine not in (AUTO, "native"):
        raise InvalidArgument(
            f"options.engine={engine!r}: the drop-in is dcpstore's native writer under DCP's own save; "
            "dcpstore.save(engine=...) runs other engines (NVRx's drop-in: "
            "dcpstore.adapters.megatron.FileSystemWriterAsync)"
        )


def _resolved(
    fn: Callable[..., Any],
    options: OptionsT | None,
    base: OptionsT,
    thread_count: int | None,
    region: str | None,
    given: dict[str, Any] | None = None,
) -> tuple[OptionsT, _Opener]:
    """A drop-in's options (``FileSystemWriter``'s ``thread_count`` is their
    ``workers``), refused where DCP's call decides, and its opener."""
    given = {**(given or {}), **({"workers": thread_count} if thread_count is not None else {})}
    resolved = resolve_options(fn, options, base=base, given=given)
    _refuse_the_calls(resolved)
    return resolved, _Opener(_storage_options(resolved.storage_options, region))


class _Opener:
    """Opens a checkpoint URI with fixed storage options; picklable, so a
    writer or reader sent to DCP's checkpoint process reopens it there."""

    def __init__(self, storage_options: StorageOptions | None) -> None:
        self.storage_options = storage_options

    def __call__(self, uri: str | os.PathLike[str]) -> Storage:
        return open_storage(uri, storage_options=self.storage_options)


class StorageWriter(DcpStorageWriter, AsyncStager):
    """DCP's ``StorageWriter`` for any URI dcpstore serves; a drop-in for
    ``FileSystemWriter`` (and s3torchconnector's ``S3StorageWriter``).

    ``path``: a local path or a URI (``s3://``, ``msc://``, ``file://``, an
    fsspec scheme). ``dcp.save(..., checkpoint_id=...)`` re-points it.

    ``FileSystemWriter``'s arguments:

    * ``thread_count``: writer threads per rank, one data file each
      (default: dcpstore's, 2 to 8 by core count on a local disk and 4
      on object stores; stock DCP's is 1).
    * ``single_file_per_rank``: ``False`` writes one file per item.
    * ``sync_files``: dcpstore makes every data file durable before the
      commit whatever it says (``False`` only *permits* skipping that, and
      skipping it would let a power loss take the previous checkpoint).
    * ``per_thread_copy_ahead``: the bytes a thread may copy off the GPU
      ahead of writing; dcpstore's threads copy one item at a time.
    * ``cache_staged_state_dict``: keep the staging buffers of
      ``dcp.async_save`` for the next save of the same structure (a set is
      reused only once nothing references it any more: never while a save
      still reads it, whatever the executor and however saves overlap).
    * ``overwrite``: ``False`` refuses a URI that holds a committed
      checkpoint with :class:`~dcpstore.CheckpointExists`.
    * ``_extensions``: DCP's stream transforms (e.g. ``ZStandard()``),
      applied to each item as stock DCP applies them.
    * ``serialization_format``: only ``TORCH_SAVE`` (DCP's default);
      for Hugging Face safetensors use :class:`~dcpstore.SafetensorsWriter`.

    s3torchconnector's ``region`` sets the native S3 backend's region;
    its ``s3client_config`` and ``prefix_strategy`` are refused with what to
    use instead. dcpstore's own: ``options`` (a
    :class:`~dcpstore.SaveOptions`, passed whole: where the bytes go,
    ``storage_options``, and ``spread_prefixes``; its ``workers`` and
    ``overwrite`` where ``thread_count`` and ``overwrite`` are left at their
    defaults; what ``dcp.save`` decides -- ``process_group``, ``planner``,
    an engine other than the native one -- is refused naming it, and
    ``async_`` is the choice of ``dcp.save`` or ``dcp.async_save``), and
    ``commit_files`` (name -> bytes: small files of the caller's that the
    coordinator writes with the commit, before ``.metadata``, recorded with
    their CRC32C in the manifest; Lightning's ``meta.pt`` goes this way).
    Any other option is passed in ``options``: a keyword for one is a
    ``TypeError`` saying how (``options=dcpstore.SaveOptions(...)``).

    ``use_collectives=False`` (of ``dcp.save``) is refused: see
    :data:`~dcpstore._impl.dcp.writer.NO_COLLECTIVES_WHY`.
    """

    @hint_keywords_with(pass_whole(SaveOptions()))
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        region: str | None = None,
        s3client_config: Any = None,
        prefix_strategy: Any = None,
        commit_files: Mapping[str, bytes] | None = None,
        options: SaveOptions | None = None,
    ) -> None:
        _refuse_s3torch(s3client_config=s3client_config, prefix_strategy=prefix_strategy)
        check_writer_args(
            per_thread_copy_ahead=per_thread_copy_ahead,
            serialization_format=serialization_format,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
        )
        options, opener = _resolved(
            StorageWriter,
            options,
            SaveOptions(),
            thread_count,
            region,
            given={} if overwrite is True else {"overwrite": overwrite},
        )
        super().__init__(
            opener(path),
            workers=options.workers,
            reopen=opener,
            single_file_per_rank=single_file_per_rank,
            overwrite=options.overwrite,
            extensions=_extensions or (),
            commit_files=commit_files,
            spread_prefixes=options.spread_prefixes,
        )
        self.sync_files = sync_files
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.cache_staged_state_dict = cache_staged_state_dict
        self._opener = opener
        self._staging = _staging(cache_staged_state_dict)
        self._leftovers = _leftovers(self)

    # -- a failed save's clean-up: kept, said, tried again -------------------
    # A save that fails while the endpoint is down cannot abort its uploads
    # or remove its alive file either: as dcpstore's own savers do, the
    # writer keeps those clean-ups and tries them again at its next save,
    # at close() and at exit (dcpstore._impl.dcp.liveness.retried_cleanups), and the error
    # says so.
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._leftovers.retry_in_background()
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage = self._save().storage
        done = super().write_data(plan, planner)  # complete when it returns
        try:
            done.wait()
        except CheckpointError as error:
            said = with_leftovers(error, storage, self._leftovers)
            if said is not error:
                said.__cause__ = error
                told: Future[list[WriteResult]] = Future()
                told.set_exception(said)  # type: ignore[arg-type]  # torch's stub types it as the value
                return told
        except BaseException:  # noqa: BLE001 -- DCP gathers it from the future, as before
            pass
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = self._save().storage
        try:
            super().finish(metadata, results)
        except CheckpointError as e:
            said = with_leftovers(e, storage, self._leftovers)
            if said is e:
                raise
            raise said from e

    def finish_at_exit(self) -> None:
        """At interpreter exit (the one exit hook calls it): try what failed
        saves could not clean up once more, and log what is still left."""
        self._leftovers.finish("at interpreter exit")

    # -- AsyncStager: what dcp.async_save calls ------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A consistent host copy of ``state_dict`` (as ``dcpstore.save(async_=True)``
        takes one); ``dcp.async_save`` saves the copy while training goes on."""
        return self._staging.hand_out(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Drop the staging buffers kept for the next save (saves still in
        flight keep theirs until they finish), and try once more what failed
        saves could not clean up (waiting for it, within the storage's own
        timeouts)."""
        self._staging.clear()
        self._leftovers.finish("at close()")

    # -- pickling: DCP's process executor sends the writer to its process ----
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["storage"] = self.storage.url.uri
        state["backends"] = registered_backends()  # DCP's process executor opens the URI in its process
        del state["progress"], state["_staging"], state["_leftovers"]  # this process's: they hold locks
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore_backends(state.pop("backends", {}))
        super().__setstate__(state)
        self.storage = self._opener(state["storage"])
        self.progress = NO_PROGRESS
        self._staging = _staging(self.cache_staged_state_dict)
        self._leftovers = _leftovers(self)


def _leftovers(writer: StorageWriter) -> Leftovers:
    """A writer's keeper of its failed saves' clean-ups, finished at exit."""
    watch(writer, Stage.SAVERS)
    return Leftovers()


class StorageReader(DcpStorageReader):
    """DCP's ``StorageReader`` for any URI dcpstore serves; a drop-in for
    ``FileSystemReader`` (and s3torchconnector's ``S3StorageReader``).

    Verifies every item's CRC32C as it reads (``options.verify=False``:
    sizes and checksums unchecked). ``dcp.load(..., checkpoint_id=...)``
    re-points it. Nothing in the checkpoint is executed:
    ``options.safe_globals`` allows more classes in ``.metadata`` and
    non-tensor items, ``options.trusted`` any (as :func:`dcpstore.load`).

    Args:
        path: a local path or a URI dcpstore serves.
        thread_count: reader threads (``FileSystemReader``'s name for
            ``options.workers``; default: dcpstore's).
        _extension_registry: ``FileSystemReader``'s: the stream transforms
            the checkpoint's items may name.
        region: s3torchconnector's: the native S3 backend's region.
        s3client_config, reader_constructor: s3torchconnector's; refused
            with :class:`~dcpstore.InvalidArgument` saying what to use.
        options: how to read, whole (a :class:`~dcpstore.LoadOptions`:
            ``storage_options``, ``verify``, ``safe_globals``, ``trusted``);
            what ``dcp.load`` decides (``process_group``, ``planner``) is
            refused naming it. A keyword for one of them is a
            ``TypeError`` saying how to pass it here.
    """

    @hint_keywords_with(pass_whole(LoadOptions()))
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        thread_count: int | None = None,
        _extension_registry: ExtensionRegistry | None = None,
        region: str | None = None,
        s3client_config: Any = None,
        reader_constructor: Any = None,
        options: LoadOptions | None = None,
    ) -> None:
        _refuse_s3torch(s3client_config=s3client_config, reader_constructor=reader_constructor)
        options, opener = _resolved(StorageReader, options, LoadOptions(), thread_count, region)
        super().__init__(
            opener(path),
            workers=options.workers,
            reopen=opener,
            verify=options.verify,
            extension_registry=_extension_registry,
            safe_globals=options.safe_globals,
            trusted=options.trusted,
        )
        self._opener = opener

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(storage=self.storage.url.uri, _metadata=None, _manifest=None, _preloaded=False)
        state["backends"] = registered_backends()
        del state["_progress"], state["bar"]  # per load and per process, and they hold locks
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore_backends(state.pop("backends", {}))
        self.__dict__.update(state)
        self.storage = self._opener(state["storage"])
        self._progress = LoadProgress(())
        self.bar = NO_PROGRESS


def check_writer_args(*, per_thread_copy_ahead: Any, serialization_format: Any, **flags: Any) -> None:
    """``FileSystemWriter``'s arguments as dcpstore's writers take them (this
    one and Megatron's drop-in): ``flags`` are bools, ``per_thread_copy_ahead``
    an int >= 0, ``serialization_format`` TORCH_SAVE."""
    _check_flags(**flags)
    if (
        isinstance(per_thread_copy_ahead, bool)
        or not isinstance(per_thread_copy_ahead, int)
        or per_thread_copy_ahead < 0
    ):
        raise InvalidArgument(f"per_thread_copy_ahead must be an int >= 0, got {per_thread_copy_ahead!r}")
    if serialization_format != SerializationFormat.TORCH_SAVE:
        raise InvalidArgument(
            f"serialization_format={serialization_format!r} is not supported: dcpstore writes DCP's "
            "torch.save data files (SerializationFormat.TORCH_SAVE); Hugging Face safetensors through any "
            "backend: dcpstore.SafetensorsWriter(uri) with dcpstore.SafetensorsReader(uri)"
        )


def _check_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name} must be a bool, got {value!r}")


def _staging(cache: bool) -> Staging:
    """The writer's staging for ``dcp.async_save`` (:meth:`Staging.hand_out`):
    with ``cache`` the buffers of one structure are kept for the next save."""
    return Staging(max_structures=1 if cache else 0, max_sets=1)
