"""Tensors that real models and hostile users hand to save and load, beyond
plain contiguous ones: flag bits, zero tensors, views as destinations,
quantized tensors. Stock DCP is the oracle wherever it can do the job.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from backends import Target
from oracle import SAVE_ENGINES, assert_same_state, destination, save_with


def _plain(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype) if not dtype.is_complex else torch.randn(n, dtype=dtype, generator=g)


def _flagged_destinations() -> dict[str, torch.Tensor]:
    """Destinations whose bytes are not their values; 40,000 elements
    (>= 64 KiB) take the reader's in-place path, 10 the scratch path."""
    return {
        "conj": torch.zeros(40_000, dtype=torch.complex64).conj(),
        "conj_small": torch.zeros(10, dtype=torch.complex64).conj(),
        "neg": torch._neg_view(torch.zeros(40_000)),
        "neg_conj": torch._neg_view(torch.zeros(40_000, dtype=torch.complex128).conj()),
        "conj_t": torch.zeros(200, 200, dtype=torch.complex64).conj().t(),
    }


def test_load_into_conjugate_and_negative_destinations_like_stock_dcp(local_target: Target) -> None:
    """A destination with the conjugate or negative bit must end up *showing*
    the stored values, as ``copy_`` (stock dcp.load) makes it; raw bytes
    written under the flag would read back conjugated / negated."""
    dests = _flagged_destinations()
    state = {k: _plain(v.numel(), v.dtype, seed=i).reshape(v.shape) for i, (k, v) in enumerate(dests.items())}
    dcpstore.save(state, local_target.uri).result()
    ours, stock = _flagged_destinations(), _flagged_destinations()
    dcpstore.load(ours, local_target.uri)
    dcp.load(stock, checkpoint_id=local_target.uri)
    assert_same_state(stock, state)  # the oracle
    assert_same_state(ours, state)
    assert all(ours[k].is_conj() == dests[k].is_conj() for k in dests)  # loaded in place, flags kept


@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
def test_zero_tensor_saves_as_zeros(local_target: Target, engine: str) -> None:
    """``torch._efficientzerotensor`` (autograd makes them) has no storage;
    stock DCP cannot save one. dcpstore writes real zeros on every engine."""
    zero = torch._efficientzerotensor((70_000,), dtype=torch.float16)
    state = {"zero": zero, "small": torch._efficientzerotensor((3, 2)), "x": torch.arange(4)}
    save_with(engine, state, local_target)
    for load in (lambda d: dcpstore.load(d, local_target.uri), lambda d: dcp.load(d, checkpoint_id=local_target.uri)):
        dest = destination(state, fill=0xFF)
        load(dest)
        assert_same_state(dest, {"zero": torch.zeros(70_000, dtype=torch.float16), "small": torch.zeros(3, 2), "x": torch.arange(4)})
