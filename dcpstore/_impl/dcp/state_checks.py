"""What a state dict may hold, checked before any byte moves.

Save: :func:`check_saveable` refuses, with :class:`InvalidArgument` naming the
key, what DCP cannot write or read back -- so the caller hears it from
``save`` itself rather than as a torch ``RuntimeError`` (or an INTERNAL ASSERT)
from staging, a background thread, or a later load.

Load: :func:`load_mismatches` lists where a destination and the checkpoint
disagree in a way stock ``dcp.load`` lets through silently: a stored object
where the destination holds a tensor (DCP replaces the tensor with the
object), and dtype conversions that lose information (complex -> real,
floating -> integer, anything -> bool). Floating <-> floating and widening
conversions stay allowed, as in stock DCP (an fp32 checkpoint into a bf16
model is normal).

Keys are named as DCP names them: the dotted path of the flattened state
dict (``"optimizer.state.0.exp_avg"``). Both walks visit only what DCP
itself writes as tensors (its own traversal); a tensor inside a tuple is
pickled whole by DCP, which torch.save handles for any tensor.
Top-level ``Stateful`` values are skipped: DCP calls their ``state_dict()``,
and calling it here as well could be costly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from dcpstore._impl.util.errors import InvalidArgument
from dcpstore._impl.util.torch_compat import ShardedTensor, element_size, flatten_state_dict, traverse_state_dict

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------

#: Types no ``Stateful`` can be: :func:`is_stateful` answers for them without
#: the runtime Protocol check, which inspects the value's class attribute by
#: attribute (about 20 us a value; a flat state dict of tensors pays it per key).
_NEVER_STATEFUL = frozenset({torch.Tensor, torch.nn.Parameter, dict, list, tuple, int, float, str, bool, type(None)})


def is_stateful(value: Any) -> bool:
    """``isinstance(value, Stateful)``, as DCP decides which top-level values
    to call ``state_dict()`` on; exact types only take the shortcut, so a
    subclass that adds ``state_dict``/``load_state_dict`` is still seen."""
    return type(value) not in _NEVER_STATEFUL and isinstance(value, Stateful)


def check_saveable(state_dict: Mapping[Any, Any]) -> None:
    """Raise :class:`InvalidArgument` naming the first key whose value a DCP
    save cannot honour (see :func:`unsaveable_reason`), top-level keys
    ``dcp.load`` cannot read back, or two values DCP would store under one
    name. Every rank calls it before saving; ranks holding the same
    structure refuse together."""
    check_top_level_keys(state_dict)
    plain = {k: v for k, v in state_dict.items() if not is_stateful(v)}

    names: set[str] = set()

    def visit(path: tuple[Any, ...], value: Any) -> None:
        name = ".".join(map(str, path))
        if name in names:  # e.g. {"a.b": x, "a": {"b": y}}
            raise InvalidArgument(f"two values of state_dict are both stored under the name {name!r}")
        names.add(name)
        if isinstance(value, torch.Tensor):
            reason = unsaveable_reason(value)
            if reason is not None:
                raise InvalidArgument(f"cannot save {name!r}: {reason}")

    traverse_state_dict(plain, visit)


def check_top_level_keys(state_dict: Mapping[Any, Any], *, loading: bool = False) -> None:
    """``dcp.load`` sorts the top-level keys: keys that cannot be ordered
    (``1`` and ``"a"``) make a checkpoint that cannot be loaded back. Raise
    :class:`InvalidArgument` for them."""
    keys = list(state_dict)
    try:
        sorted(keys)
    except TypeError as e:
        kinds = " and ".join(sorted({type(k).__name__ for k in keys}))
        consequence = "cannot load into it" if loading else "could not load such a checkpoint back"
        raise InvalidArgument(
            f"state_dict's top-level keys mix {kinds} ({e}); dcp.load sorts them, so it {consequence}: use str keys"
        ) from e


def unsaveable_reason(tensor: torch.Tensor) -> str | None:
    """Why DCP cannot save ``tensor`` as a tensor item (``None``: it can).

    For a DTensor or ShardedTensor the local shards are what is written, so
    they are checked. Quantized and zero tensors are saveable (zero tensors
    as real zeros).
    """
    for local in _local_parts(tensor):
        reason = _local_reason(local)
        if reason is not None:
            return reason
    return None


def _local_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """What is written for ``tensor``: a DTensor's local shard, a
    ShardedTensor's local shards, else the tensor itself."""
    if DTensor is not None and isinstance(tensor, DTensor):
        return [tensor._local_tensor]
    if ShardedTensor is not None and isinstance(tensor, ShardedTensor):
        return [shard.tensor for shard in tensor.local_shards()]
    return [tensor]


def _local_reason(local: torch.Tensor) -> str | None:
    if local.device.type == "meta":
        return "it is a meta tensor, which has no data (materialise the module, e.g. to_empty() and init, first)"
    if local.layout != torch.strided:
        return f"{local.layout} tensors cannot be saved by DCP; save a dense tensor (to_dense()) or its parts"
    if local.is_nested:
        return "nested tensors cannot be saved by DCP; save their components (unbind()) instead"
    if _element_size(local.dtype) is None:
        return f"DCP cannot plan a tensor of dtype {local.dtype} (it has no whole-byte element size)"
    return None


def _element_size(dtype: torch.dtype) -> int | None:
    """The element size DCP's planner computes, or None where it raises:
    the sub-byte and ``bits`` dtypes."""
    try:
        return element_size(dtype)
    except (TypeError, RuntimeError):
        return None


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def load_mismatches(state_dict: Mapping[Any, Any], metadata: Metadata) -> list[str]:
    """Where ``state_dict`` and a checkpoint's ``metadata`` disagree in a
    way a load must refuse (see the module doc); one message per key, each
    naming the key and both types. Keys the checkpoint lacks are left to
    DCP (which names them)."""
    plain = {k: v for k, v in state_dict.items() if not is_stateful(v)}
    try:
        flat, _ = flatten_state_dict(plain)
    except ValueError:  # duplicated flattened keys: DCP reports them itself
        return []
    stored = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        md = stored.get(key)
        if md is None:
            continue
        problem = _mismatch(value, md)
        if problem is not None:
            problems.append(f"{key!r}: {problem}")
    return problems


def _mismatch(value: Any, md: Any) -> str | None:
    if isinstance(md, BytesStorageMetadata):
        if isinstance(value, torch.Tensor):
            return (
                f"the checkpoint holds a non-tensor object, the destination a tensor ({_describe(value)}); "
                "loading would replace the tensor with the object"
            )
        return None
    if isinstance(md, TensorStorageMetadata) and isinstance(value, torch.Tensor):
        # (A stored tensor into a non-tensor: DCP's planner refuses it itself.)
        lost = lossy_conversion(md.properties.dtype, value.dtype)
        if lost is not None:
            return f"checkpoint dtype {md.properties.dtype}, destination dtype {value.dtype}: {lost}"
    return None


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype}, shape {tuple(t.shape)}"


#: Rank of each kind of dtype: converting to a lower rank loses information.
_KINDS = ("bool", "integer", "floating", "complex")


def _kind(dtype: torch.dtype) -> int:
    if dtype == torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    return 1


_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def lossy_conversion(stored: torch.dtype, dest: torch.dtype) -> str | None:
    """Why copying ``stored`` values into a ``dest`` tensor loses more than
    precision (``None``: it does not). Complex -> real drops the imaginary
    part; floating -> integer the fraction, NaN and infinities; anything ->
    bool all but zero/non-zero. Quantized dtypes are left to torch."""
    if stored == dest or stored in _QUANTIZED or dest in _QUANTIZED:
        return None
    have, want = _kind(stored), _kind(dest)
    if want >= have:
        return None
    what = {3: "the imaginary part", 2: "fractions, NaN and infinities", 1: "every value but zero / non-zero"}
    lost = what[have] if want > 0 else what[1]
    return f"{_KINDS[have]} -> {_KINDS[want]} would lose {lost}; load into a {stored} tensor and convert explicitly"
