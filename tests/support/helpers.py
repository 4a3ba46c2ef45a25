"""Small helpers shared by the suites: state dicts to save and compare."""

from __future__ import annotations

from typing import Any

import torch


def sample_state(seed: int = 0) -> dict[str, Any]:
    """A state dict exercising every kind of value a save must handle."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(16, 12, generator=g)
    return {
        "f32": torch.randn(64, 33, generator=g),
        "f16": torch.randn(17, 5, generator=g).half(),
        "bf16": torch.randn(8, 300, generator=g).bfloat16(),
        "f64": torch.randn(7, generator=g).double(),
        "i64": torch.randint(-(2**40), 2**40, (50,), generator=g),
        "i8": torch.randint(-128, 127, (31,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (31,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(40, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "view_col": base[:, 3],  # non-contiguous view of a larger storage
        "view_t": base.t(),  # transposed, whole storage
        "view_slice": base[2:5],
        "nested": {"w": torch.randn(3, 3, generator=g), "deeper": {"b": torch.arange(5)}},
        "step": 1234,
        "name": "run-α",
        "lr": [0.1, 0.01],
        "flags": {"amp": True},
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A destination with the same structure and different values."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value.contiguous())
        elif isinstance(value, dict):
            out[key] = zeros_like_state(value)
        else:
            out[key] = None
    return out


def assert_state_equal(expected: dict[str, Any], actual: dict[str, Any], path: str = "") -> None:
    assert expected.keys() == actual.keys(), f"keys differ at {path or '<root>'}"
    for key, want in expected.items():
        got = actual[key]
        where = f"{path}.{key}" if path else key
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), where
            assert got.dtype == want.dtype and got.shape == want.shape, where
            assert torch.equal(got, want), f"values differ at {where}"
        elif isinstance(want, dict):
            assert_state_equal(want, got, where)
        else:
            assert got == want, where
