"""Keyword mistakes named with their fix, and other frameworks' names for ours.

Python's own ``TypeError`` for an unknown keyword says only that it is
unknown. :func:`hint_keywords` wraps a public function or method so that the
error also says what was probably meant: ``async_`` for ``async`` (a
reserved word, which is why the option has its trailing underscore, PEP 8),
ours for a name another framework gives it (``workers`` for
``thread_count``), what to pass instead where the entry point takes the
option another way (``options=dcpstore.SaveOptions(workers=...)``:
:func:`hint_keywords_with`), the closest accepted name for a misspelling
(``difflib``), or else the list of accepted names. The check is one set
difference per call; the error stays a ``TypeError``, as Python's is.

:data:`FRAMEWORK_NAMES` is the one table of other frameworks' names:
torch's ``FileSystemWriter`` / ``FileSystemReader``, s3torchconnector's,
NVRx's ``FileSystemWriterAsync`` and Megatron-Bridge's ``CheckpointConfig``
arguments that dcpstore's stand-ins for them take, each with dcpstore's own
name for it where it has one.

Foundation layer: imports nothing of dcpstore's.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import keyword
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def keyword_names(fn: Callable[..., object]) -> frozenset[str] | None:
    """The keyword arguments ``fn`` accepts; ``None`` if it takes ``**kwargs``."""
    names = set()
    for param in inspect.signature(fn).parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(param.name)
    names.discard("self")
    return frozenset(names)


@dataclass(frozen=True)
class ForeignName:
    """A name another framework gives one of its arguments, and what it is in dcpstore."""

    #: The framework's name.
    name: str
    #: Whose name it is.
    framework: str
    #: dcpstore's name for the same thing: an option (a field of
    #: ``SaveOptions`` / ``LoadOptions``, ``"workers"``, or of their
    #: ``StorageOptions``, ``"storage_options.region"``) or the manager's
    #: ``"keep"``; ``None``: dcpstore has none (the stand-ins take the
    #: argument as the framework does: honoured, accepted or refused naming it).
    ours: str | None
    #: dcpstore's stand-ins for the framework's classes that take the name,
    #: by ``__qualname__`` (none: no entry point takes it; an error for it names ours).
    taken_by: tuple[str, ...] = ()
    #: What to say beside ours in an error for the name, where its mere name is not enough.
    note: str = ""


_FS_WRITER, _FS_READER = "torch's FileSystemWriter", "torch's FileSystemReader"
#: FileSystemWriter's arguments: the drop-in writer's, and NVRx's writer's (which takes them too).
_WRITERS = ("StorageWriter", "FileSystemWriterAsync")
_S3 = "s3torchconnector's S3StorageWriter and S3StorageReader"
_NVRX, _NVRX_WRITER = "NVRx's FileSystemWriterAsync", ("FileSystemWriterAsync",)
_BRIDGE, _CONFIG = "Megatron-Bridge's (0.6.2) and megatron-core's (0.19.2) CheckpointConfig", ("CheckpointConfig",)
_PROCESS = "engine='process' runs the save in a checkpoint process"
_ORBAX = "Orbax's CheckpointManagerOptions"
_WHEN = "the training loop decides when to save: call save() at the steps to keep"

#: Other frameworks' names for their arguments, by name: the one table of
#: them. A stand-in takes its framework's names (``StorageWriter(thread_count=4)``
#: is ``options.workers``, ``CheckpointConfig(dist_ckpt_workers=4)`` too) and
#: names a bad value as its caller spelt it; anywhere else such a name is
#: unknown, and its error names ours. No other entry point takes another
#: name for an option.
FRAMEWORK_NAMES: Mapping[str, ForeignName] = {
    f.name: f
    for f in (
        ForeignName(
            "thread_count",
            f"{_FS_WRITER} and FileSystemReader",
            "workers",
            ("StorageWriter", "StorageReader", *_NVRX_WRITER),
        ),
        ForeignName("overwrite", _FS_WRITER, "overwrite", _WRITERS),
        ForeignName("single_file_per_rank", _FS_WRITER, None, _WRITERS),
        ForeignName("sync_files", _FS_WRITER, None, _WRITERS),
        ForeignName("per_thread_copy_ahead", _FS_WRITER, None, _WRITERS),
        ForeignName("cache_staged_state_dict", _FS_WRITER, None, _WRITERS),
        ForeignName("_extensions", _FS_WRITER, None, _WRITERS),
        ForeignName("serialization_format", _FS_WRITER, None, _WRITERS),
        ForeignName("_extension_registry", _FS_READER, None, ("StorageReader",)),
        ForeignName("region", _S3, "storage_options.region", ("StorageWriter", "StorageReader")),
        ForeignName("s3client_config", _S3, None, ("StorageWriter", "StorageReader")),
        ForeignName("prefix_strategy", _S3, None, ("StorageWriter",)),
        ForeignName("reader_constructor", _S3, None, ("StorageReader",)),
        ForeignName("use_msc", _NVRX, "storage_options.enable_msc", _NVRX_WRITER),
        ForeignName("separation_hint", _NVRX, None, _NVRX_WRITER),
        ForeignName("is_multiproc_io", _NVRX, None, _NVRX_WRITER),
        ForeignName("use_cached_data_structure", _NVRX, None, _NVRX_WRITER),
        ForeignName("use_cpu_shm_for_gpu_tensors", _NVRX, None, _NVRX_WRITER),
        ForeignName("open_file", _NVRX, None, _NVRX_WRITER),
        ForeignName("save", _BRIDGE, None, _CONFIG),
        ForeignName("load", _BRIDGE, None, _CONFIG),
        ForeignName("save_interval", _BRIDGE, None, _CONFIG, note=_WHEN),
        ForeignName("async_save", _BRIDGE, "async_", _CONFIG),
        ForeignName("ckpt_format", _BRIDGE, None, _CONFIG),
        ForeignName("dist_ckpt_workers", _BRIDGE, "workers", _CONFIG),
        ForeignName("most_recent_k", _BRIDGE, "keep", _CONFIG),
        ForeignName("ckpt_assume_constant_structure", _BRIDGE, None, _CONFIG),
        ForeignName("ckpt_step", _BRIDGE, None, _CONFIG),
        # Orbax's and torch's names a manager's or a load's caller types from habit.
        ForeignName("max_to_keep", _ORBAX, "keep"),
        ForeignName("save_interval_steps", _ORBAX, None, note=_WHEN),
        ForeignName(
            "strict",
            "torch's load_state_dict",
            None,
            note="a load restores every key of the state dict it is given and fails naming any the "
            "checkpoint lacks; pass only the keys to restore",
        ),
        # torch's dcp.async_save picks a checkpoint process with
        # async_checkpointer_type (and calls what runs it an executor);
        # dcpstore with its one option for what runs a save.
        ForeignName("async_checkpointer_type", "torch's dcp.async_save", "engine", note=_PROCESS),
        ForeignName("executor", "torch's dcp.async_save", "engine", note=_PROCESS),
    )
}


def foreign_names(entry: str) -> dict[str, str]:
    """The names of other frameworks that ``entry`` (a ``__qualname__``,
    ``"StorageWriter"``) takes for one of dcpstore's: theirs -> ours."""
    return {f.name: f.ours for f in FRAMEWORK_NAMES.values() if entry in f.taken_by and f.ours is not None}


def unknown_keyword_message(
    function: str, unknown: Iterable[str], accepted: Iterable[str], instead: Mapping[str, str] | None = None
) -> str:
    """The message for unknown keyword arguments of ``function``, each with a
    suggestion where one is likely; ``instead``: name -> what to pass instead
    (an option ``function`` takes another way)."""
    accepted = sorted(accepted)
    instead = instead or {}
    parts, hinted = [], False
    for name in sorted(unknown):
        text = f"an unexpected keyword argument {name!r}"
        foreign = FRAMEWORK_NAMES.get(name)
        ours = foreign.ours if foreign is not None else None
        ours_key = ours.rsplit(".", 1)[-1] if ours is not None else None
        hint = ""
        if keyword.iskeyword(name) and f"{name}_" in accepted:
            hint = f"did you mean {name + '_'!r}? ({name!r} is a reserved word in Python, hence the underscore)"
        elif name in instead:
            hint = instead[name]
        elif foreign is not None and ours in accepted:
            hint = f"did you mean {ours!r}? ({foreign.note or f'{name!r} is its name in {foreign.framework}'})"
        elif foreign is not None and ours_key is not None and ours_key in instead:
            hint = f"{name!r} is dcpstore's {ours!r} (its name in {foreign.framework}): {instead[ours_key]}"
        elif foreign is not None:  # a known name: what it means here, not a look-alike of ours
            where = f"dcpstore's {ours!r}, which {function}() does not take" if ours else "not an option of dcpstore's"
            hint = f"{name!r} is {foreign.framework}'s name, {where}" + (f" ({foreign.note})" if foreign.note else "")
        else:
            close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.6)
            elsewhere = difflib.get_close_matches(name, list(instead), n=1, cutoff=0.6)
            if close:
                hint = f"did you mean {close[0]!r}?"
            elif elsewhere:
                hint = f"did you mean {elsewhere[0]!r}? {instead[elsewhere[0]]}"
        parts.append(f"{text}: {hint}" if hint else text)
        hinted = hinted or bool(hint)
    if not hinted:
        parts[-1] += f" (it accepts {', '.join(accepted)})"
    return f"{function}() got " + "; ".join(parts)


def hint_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` so that an unknown keyword argument raises a ``TypeError``
    that names the likely fix (see the module docstring)."""
    return hint_keywords_with({})(fn)


def hint_keywords_with(instead: Mapping[str, str]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """:func:`hint_keywords`, also naming what to pass instead of a keyword
    the function does not take (``instead``: name -> what to pass; an entry
    point that takes an option only inside ``options=`` says how)."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        accepted = keyword_names(fn)
        if accepted is None:
            return fn
        name = fn.__qualname__

        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            unknown = kwargs.keys() - accepted
            if unknown:
                raise TypeError(unknown_keyword_message(name, unknown, accepted, instead))
            return fn(*args, **kwargs)

        return checked

    return wrap
