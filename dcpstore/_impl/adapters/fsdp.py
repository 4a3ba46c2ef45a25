"""The implementation of :mod:`dcpstore.adapters.fsdp`, whose docstring says how to use it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from dcpstore._impl.adapters.megatron_formats import DEFAULT_FORMAT, check_format
from dcpstore._impl.adapters.megatron_formats import (
    FORMATS as FORMATS,  # the table save_app_state and load_app_state accept
)
from dcpstore._impl.api import load, save
from dcpstore._impl.dcp.commit.reading import read_checkpoint_metadata
from dcpstore._impl.manager import CheckpointManager
from dcpstore._impl.storage import open_storage
from dcpstore._impl.util.errors import InvalidArgument, StateDictMismatch
from dcpstore._impl.util.torch_compat import flatten_state_dict, set_element, tree_map_only
from dcpstore._impl.values.results import SaveHandle

MODEL = "model"
OPTIMIZER = "optimizer"
#: Top-level sections that belong to the model/optimizer: a checkpoint key
#: under them that this run does not want is reported as unexpected.
SECTIONS = (MODEL, OPTIMIZER)

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


# ---------------------------------------------------------------------------
# Getting and setting state
# ---------------------------------------------------------------------------


def _optimizers(optimizer: Optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def _options(*, full_state_dict: bool, cpu_offload: bool) -> StateDictOptions:
    return StateDictOptions(full_state_dict=full_state_dict, cpu_offload=cpu_offload, flatten_optimizer_state_dict=True)


def _dtensor_state(
    model: nn.Module, optimizer: Optimizers, *, full_state_dict: bool, cpu_offload: bool
) -> dict[str, Any]:
    options = _options(full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    optims = _optimizers(optimizer)
    if not optims:
        return {MODEL: get_model_state_dict(model, options=options)}
    model_sd, optim_sd = get_state_dict(model, optims, options=options)
    return {MODEL: model_sd, OPTIMIZER: optim_sd}


def get_app_state(
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    format: str = DEFAULT_FORMAT,
    full_state_dict: bool = False,
    cpu_offload: bool = False,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The dict to hand :func:`dcpstore.save` (collective: every rank calls it).

    Args:
        model: the (FSDP2-sharded) model.
        optimizer: its optimizer, a sequence of them, or ``None``.
        format: ``"fsdp_dtensor"`` (DTensor shards) or ``"torch_dist"``
            (Megatron's ShardedTensor view of the same shards); the module
            :mod:`dcpstore._impl.adapters.megatron_formats` describes both.
        full_state_dict: gather full tensors instead of shards.
        cpu_offload: move the tensors to the CPU.
        extra: entries added at the top level (step counters, RNG state,
            ...); ``"model"`` and ``"optimizer"`` are reserved.

    Returns:
        ``{"model": ..., "optimizer": ..., **extra}``.

    Raises:
        InvalidArgument: an unknown format, or a reserved key in ``extra``.
    """
    fmt = check_format(format)
    state = _dtensor_state(model, optimizer, full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    state = {name: fmt.convert(section) for name, section in state.items()}
    return _with_extra(state, extra)


def _with_extra(state: dict[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    for key, value in (extra or {}).items():
        if key in SECTIONS:
            raise InvalidArgument(f"extra may not use the reserved key {key!r}")
        state[key] = value
    return state


# ---------------------------------------------------------------------------
# Key report
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyMismatch:
    """A key both sides have, with a different shape (or kind)."""

    key: str
    saved: str
    expected: str


@dataclass(frozen=True)
class LoadReport:
    """What a load matched. Keys are DCP's flattened names
    (``model.<fqn>``, ``optimizer.state.<fqn>.exp_avg``, ``<extra key>``).

    ``missing_keys``: this run wants them, the checkpoint lacks them (left as
    they were). ``unexpected_keys``: under ``model.``/``optimizer.`` in the
    checkpoint, unknown to this run (ignored). ``mismatched_keys``: on both
    sides with another shape (left as they were).
    """

    uri: str
    step: int | None = None
    loaded_keys: tuple[str, ...] = ()
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    mismatched_keys: tuple[KeyMismatch, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not (self.missing_keys or self.unexpected_keys or self.mismatched_keys)

    def describe(self, limit: int = 8) -> str:
        """One line naming the problems (at most ``limit`` keys per kind)."""
        parts = []
        for label, keys in (
            ("missing", self.missing_keys),
            ("unexpected", self.unexpected_keys),
            ("mismatched", [f"{m.key} (saved {m.saved}, expected {m.expected})" for m in self.mismatched_keys]),
        ):
            if keys:
                shown = ", ".join(keys[:limit]) + (f", ... {len(keys) - limit} more" if len(keys) > limit else "")
                parts.append(f"{len(keys)} {label}: {shown}")
        return "; ".join(parts) or f"all {len(self.loaded_keys)} keys matched"


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        size = value.size() if callable(getattr(value, "size", None)) else value.shape
        return f"tensor{tuple(size)}"
    return "object"


def _describe_saved(md: Any) -> str:
    if isinstance(md, TensorStorageMetadata):
        return f"tensor{tuple(md.size)}"
    if isinstance(md, BytesStorageMetadata):
        return "object"
    return type(md).__name__


def compare_keys(
    flat: Mapping[str, Any],
    metadata: Metadata,
    uri: str,
    step: int | None = None,
    sections: Sequence[str] = SECTIONS,
) -> LoadReport:
    """Match a flattened template against a checkpoint's ``.metadata``.

    Checkpoint keys under ``sections`` that the template lacks are
    unexpected; other sections were not asked for (a model-only load leaves
    the optimizer section alone) and are not reported.
    """
    saved = metadata.state_dict_metadata
    loaded, missing, mismatched = [], [], []
    for key, value in flat.items():
        md = saved.get(key)
        if md is None:
            missing.append(key)
            continue
        want, have = _describe_value(value), _describe_saved(md)
        if want != have:
            mismatched.append(KeyMismatch(key, have, want))
        else:
            loaded.append(key)
    unexpected = [k for k in saved if k.split(".", 1)[0] in sections and k not in flat]
    return LoadReport(
        uri=uri,
        step=step,
        loaded_keys=tuple(sorted(loaded)),
        missing_keys=tuple(sorted(missing)),
        unexpected_keys=tuple(sorted(unexpected)),
        mismatched_keys=tuple(sorted(mismatched, key=lambda m: m.key)),
    )


# ---------------------------------------------------------------------------
# Save and load
# ---------------------------------------------------------------------------


def save_app_state(
    model: nn.Module,
    optimizer: Optimizers,
    dest: str | os.PathLike[str] | CheckpointManager,
    *,
    step: int | None = None,
    format: str = DEFAULT_FORMAT,
    full_state_dict: bool = False,
    cpu_offload: bool = False,
    extra: Mapping[str, Any] | None = None,
    **save_kwargs: Any,
) -> SaveHandle:
    """Save model + optimizer (+ ``extra``) to a URI, or as ``step`` of a
    :class:`~dcpstore.CheckpointManager` (whose options then apply).
    Collective: every rank calls it.

    Args:
        model, optimizer, format, full_state_dict, cpu_offload, extra: as
            for :func:`get_app_state`.
        dest: a URI, or a manager.
        step: the step, with a manager (required there, refused otherwise).
        **save_kwargs: :func:`dcpstore.save`'s options, with a URI only.

    Returns:
        The save's :class:`~dcpstore.SaveHandle`.

    Raises:
        InvalidArgument: ``step`` missing for a manager or given for a URI,
            save options given with a manager, or a bad option.
        SaveError: as for :func:`dcpstore.save` and
            :meth:`~dcpstore.CheckpointManager.save`.
    """
    state = get_app_state(
        model, optimizer, format=format, full_state_dict=full_state_dict, cpu_offload=cpu_offload, extra=extra
    )
    if isinstance(dest, CheckpointManager):
        if step is None:
            raise InvalidArgument("step is required when saving through a CheckpointManager")
        if save_kwargs:
            raise InvalidArgument(f"pass {sorted(save_kwargs)} to the CheckpointManager, not to save_app_state")
        return dest.save(state, step)
    if step is not None:
        raise InvalidArgument("step is only meaningful with a CheckpointManager; put it in extra={'step': ...}")
    return save(state, dest, **save_kwargs)


def load_app_state(
    model: nn.Module,
    optimizer: Optimizers,
    src: str | os.PathLike[str] | CheckpointManager,
    *,
    step: int | None = None,
    format: str = DEFAULT_FORMAT,
    full_state_dict: bool = False,
    cpu_offload: bool = False,
    strict: bool = True,
    extra: dict[str, Any] | None = None,
    **load_kwargs: Any,
) -> LoadReport:
    """Load model + optimizer (+ ``extra``, updated in place) from a URI, or
    from ``step`` (default: the newest committed) of a manager.

    Reshards to this run's layout. Collective: every rank calls it.

    Args:
        model, optimizer, format, full_state_dict, cpu_offload: as for
            :func:`get_app_state` (the format may differ from the one saved).
        src: a URI, or a manager.
        step: with a manager, the step to load (default: the newest
            committed one).
        strict: raise before anything is loaded if a key is missing,
            unexpected or of another shape (``False``: load what matches).
        extra: entries to load too, updated in place.
        **load_kwargs: :func:`dcpstore.load`'s options, with a URI only.

    Returns:
        A :class:`LoadReport`: the keys loaded, missing, unexpected and
        mismatched.

    Raises:
        StateDictMismatch: ``strict`` and the keys differ (its ``report``
            lists them).
        CheckpointNotFound, CheckpointCorrupt, LoadError: as for
            :func:`dcpstore.load`.
        InvalidArgument: load options given with a manager, or a bad format.
    """
    fmt = check_format(format)
    if isinstance(src, CheckpointManager):
        if load_kwargs:
            raise InvalidArgument(f"pass {sorted(load_kwargs)} to the CheckpointManager, not to load_app_state")
        src.wait()
        step = src.resolve_step(step)
        uri, load_kwargs = src.step_uri(step), src.io_kwargs
    else:
        uri = os.fspath(src)
    # A full-state load reads full tensors on every rank (DCP reads them
    # directly, so a rank-0 read + broadcast would only add traffic), then
    # each rank keeps its shard. Templates must then exist on every rank,
    # which torch's cpu_offload+full_state_dict would restrict to rank 0.
    template = _with_extra(
        _dtensor_state(
            model, optimizer, full_state_dict=full_state_dict, cpu_offload=cpu_offload and not full_state_dict
        ),
        extra,
    )
    if full_state_dict and cpu_offload:
        template = {
            k: (tree_map_only(torch.Tensor, torch.Tensor.cpu, v) if k in SECTIONS else v) for k, v in template.items()
        }
    flat_template, paths = flatten_state_dict(template)
    report = _report(flat_template, uri, step, load_kwargs, [k for k in SECTIONS if k in template])
    if strict and not report.ok:
        raise StateDictMismatch(
            f"checkpoint {report.uri} does not match this model/optimizer: "
            f"{report.describe()}; strict=False loads the keys that match",
            report,
        )
    # What DCP fills: only entries the checkpoint has with the right shape,
    # in the requested format (sharing storage with the template's tensors).
    converted = {k: (fmt.convert(v) if k in SECTIONS else v) for k, v in template.items()}
    flat_converted, _ = flatten_state_dict(converted)
    wanted = set(report.loaded_keys)
    to_load = {k: v for k, v in flat_converted.items() if k in wanted}
    load(to_load, uri, **load_kwargs)
    for key, value in to_load.items():  # objects are replaced, not filled: put them back
        if not isinstance(value, torch.Tensor):
            set_element(template, paths[key], value)
    _apply(model, optimizer, template, full_state_dict=full_state_dict, cpu_offload=cpu_offload)
    if extra is not None:
        for key in extra:
            extra[key] = template[key]
    return report


def _report(
    flat_template: dict[str, Any], uri: str, step: int | None, load_kwargs: dict[str, Any], sections: list[str]
) -> LoadReport:
    """Compare the template with the checkpoint's keys. Every rank holds the
    same keys and reads the same .metadata, so every rank reaches the same
    verdict and a strict failure never leaves some ranks in a collective."""
    storage = open_storage(
        uri, enable_msc=load_kwargs.get("enable_msc", False), storage_options=load_kwargs.get("storage_options")
    )
    try:
        metadata, _ = read_checkpoint_metadata(storage)
    finally:
        storage.close()
    return compare_keys(flat_template, metadata, storage.uri, step, sections)


def _apply(
    model: nn.Module, optimizer: Optimizers, template: dict[str, Any], *, full_state_dict: bool, cpu_offload: bool
) -> None:
    # Every rank holds what it needs (see load_app_state): no rank-0 broadcast.
    options = _options(full_state_dict=full_state_dict, cpu_offload=False)
    if full_state_dict:
        # torch's full-state optimizer load re-reads the *local* optimizer
        # state with these options and indexes its "param_groups", which a
        # flattened dict lacks (KeyError, torch 2.6-2.13). set_state_dict
        # recognises our flattened input by its missing "state" key either
        # way, so ask only for the nested local form.
        options.flatten_optimizer_state_dict = False
    optims = _optimizers(optimizer)
    if not optims:
        set_model_state_dict(model, template[MODEL], options=options)
        return
    set_state_dict(
        model, optims, model_state_dict=template[MODEL], optim_state_dict=template[OPTIMIZER], options=options
    )


def set_app_state(
    model: nn.Module,
    optimizer: Optimizers,
    state: dict[str, Any],
    *,
    full_state_dict: bool = False,
    cpu_offload: bool = False,
) -> None:
    """Apply a state dict shaped like :func:`get_app_state`'s (``fsdp_dtensor``
    format) to the model and optimizer (collective: every rank calls it).

    Args:
        model, optimizer, full_state_dict, cpu_offload: as for
            :func:`get_app_state`.
        state: ``{"model": ..., "optimizer": ...}``.
    """
    _apply(model, optimizer, state, full_state_dict=full_state_dict, cpu_offload=cpu_offload)
