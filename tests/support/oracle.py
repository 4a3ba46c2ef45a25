"""Stock DCP as the oracle: the engines to save with, and bitwise comparison.

What stock ``dcp.save`` / ``dcp.load`` do with a state dict is what dcpstore
must do. The suites that use this module save with every engine and load
with both readers; values are compared *bitwise* (floats with NaN payloads,
negative zeros and float8 bytes included), after resolving conjugate and
negative views into the values they stand for.
"""

from __future__ import annotations

from typing import Any

import torch

import dcpstore
from tests.support.async_helpers import skip_unless_engine_serves
from tests.support.backends import Target
from tests.support.extras import needs_nvrx  # noqa: F401  (the suites import it from here)

#: Keyword arguments of ``dcpstore.save`` per engine.
SAVE_ENGINES: dict[str, dict[str, Any]] = {
    "sync": {},
    "native": {"async_": True, "engine": "native"},
    "nvrx": {"async_": True, "engine": "nvrx"},
    "process": {"async_": True, "engine": "process"},
}


def save_with(engine: str, state: dict[str, Any], target: Target, **kwargs: Any) -> None:
    """Save ``state`` to ``target`` with ``engine``, waiting for the commit."""
    if engine != "sync":
        skip_unless_engine_serves(engine, target)
    dcpstore.save(state, target.uri, **SAVE_ENGINES[engine], **target.kwargs, **kwargs).result(timeout=120)


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def value_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values, row-major (a view's flags applied)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.dtype.is_complex and t.dim():  # an integer view first: float4 has no strided copy_ kernel
        t = t.view(_SAME_WIDTH[t.element_size()])
    t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)  # any stride on a one-element tensor


def assert_same_tensor(got: Any, want: torch.Tensor, where: str) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(value_bytes(got), value_bytes(want)), f"{where}: values differ"


def assert_same_state(got: Any, want: Any, where: str = "<root>") -> None:
    """``got`` equals ``want`` bitwise, recursively through dicts, lists, tuples."""
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want, where)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys differ"
        for k in want:
            assert_same_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want or (got != got and want != want), f"{where}: {got!r} != {want!r}"


def destination(state: Any, fill: int = 0) -> Any:
    """A fresh destination shaped like ``state`` for DCP to load into:
    tensors become plain contiguous tensors of the same shape and dtype, every
    byte ``fill``; dicts, and the lists DCP walks into, keep their structure
    (DCP loads into their leaves); any other value becomes ``None`` (DCP
    replaces it with the stored object)."""
    if isinstance(state, torch.Tensor):
        out = torch.empty(state.shape, dtype=state.dtype)
        if out.numel():
            out.reshape(-1).view(torch.uint8).fill_(fill)
        return out
    if isinstance(state, dict):
        return type(state)((k, destination(v, fill)) for k, v in state.items())
    if isinstance(state, list) and _walked(state):
        return [destination(v, fill) for v in state]
    return None


def _walked(value: list[Any]) -> bool:
    """Whether DCP's traversal walks into this list (it holds a tensor, a
    mapping, or such a list) rather than pickling it whole."""
    return any(isinstance(v, (torch.Tensor, dict)) or (isinstance(v, list) and _walked(v)) for v in value)
