"""``is_stateful``: DCP's top-level ``Stateful`` test, with a shortcut for
the types no ``Stateful`` can be, which must not hide a real one."""

from __future__ import annotations

from typing import Any

import torch

from dcpstore._impl.dcp.state_checks import is_stateful


class _Counter:
    def __init__(self) -> None:
        self.n = 3

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


class _TensorWithState(torch.Tensor):
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_stateful_values_are_seen_and_plain_ones_are_not() -> None:
    assert is_stateful(_Counter())
    assert is_stateful(torch.nn.Linear(2, 2))  # a module is Stateful to DCP
    assert is_stateful(torch.randn(2).as_subclass(_TensorWithState))  # a subclass skips the shortcut
    plain = [torch.randn(2), torch.nn.Parameter(torch.randn(2)), {"a": 1}, [1], (1,), 1, 1.5, "s", True, None]
    assert [is_stateful(v) for v in plain] == [False] * len(plain)
