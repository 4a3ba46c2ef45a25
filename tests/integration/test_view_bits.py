"""Tensors whose bytes are not their values: conjugate and negative views.

torch keeps ``conj()`` and ``_neg_view`` as a flag over untouched bytes, and
torch.save writes the flag into the record. A reader that copies the raw bytes
loads the un-conjugated, un-negated tensor, silently. Stock ``dcp.load`` is the
oracle: it reads these records through torch.load.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore._impl.format import record as dcp_writer
from dcpstore._impl.format.record import item_tensor
from tests.support.backends import Target

ENGINES: dict[str, dict[str, Any]] = {
    "sync": {},
    "native": {"async_": True, "engine": "native"},
    "nvrx": {"async_": True, "engine": "nvrx"},
    "process": {"async_": True, "engine": "process"},
}


def _views() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(40_000, dtype=torch.complex64, generator=g)  # 320 KB: the in-place path
    x = torch.randn(30_000, generator=g)
    return {
        "conj": z.conj(),
        "conj_small": z[:10].conj(),  # under the small-tensor cut: read via scratch
        "neg": torch._neg_view(x),
        "neg_conj": torch._neg_view(z.conj()),
        "conj_2d_t": z.view(200, 200).conj().t(),
        "imag_of_conj": z.conj().imag,
    }


def _empty_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key, value in want.items():
        assert torch.equal(got[key], value.resolve_conj().resolve_neg()), key


@pytest.mark.parametrize("engine", list(ENGINES))
def test_view_bits_round_trip_like_stock_dcp(local_target: Target, engine: str) -> None:
    if engine == "nvrx":
        pytest.importorskip("nvidia_resiliency_ext")
    state = _views()
    dcpstore.save(dict(state), local_target.uri, **ENGINES[engine]).result(timeout=120)
    ours, stock = _empty_like(state), _empty_like(state)
    dcpstore.load(ours, local_target.uri)
    dcp.load(stock, checkpoint_id=local_target.uri)
    _assert_same(stock, state)  # the oracle reads it right ...
    _assert_same(ours, state)  # ... and so must we


def test_view_bits_round_trip_on_every_backend(target: Target) -> None:
    state = _views()
    dcpstore.save(dict(state), target.uri).result()
    ours = _empty_like(state)
    dcpstore.load(ours, target.uri)
    _assert_same(ours, state)


def test_stock_dcp_checkpoint_of_view_bits_loads_right(local_target: Target) -> None:
    state = _views()
    dcp.save(dict(state), checkpoint_id=local_target.uri)
    ours = _empty_like(state)
    dcpstore.load(ours, local_target.uri)
    _assert_same(ours, state)


@pytest.mark.parametrize("name", ["conj", "neg", "neg_conj"])
def test_item_view_keeps_the_records_view_bits(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(dcp_writer, "VIEW_MIN_BYTES", 0)
    tensor = _views()[name]
    buf = io.BytesIO()
    torch.save(tensor, buf)
    got = item_tensor(memoryview(buf.getvalue()))
    assert torch.equal(got.resolve_conj().resolve_neg(), tensor.resolve_conj().resolve_neg())
