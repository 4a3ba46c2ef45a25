"""Tensors that real models and hostile users hand to save and load, beyond
plain contiguous ones: flag bits, zero tensors, views as destinations,
quantized tensors. Stock DCP is the oracle wherever it can do the job.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from tests.support.backends import Target
from tests.support.oracle import SAVE_ENGINES, assert_same_state, destination, save_with


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
        assert_same_state(
            dest, {"zero": torch.zeros(70_000, dtype=torch.float16), "small": torch.zeros(3, 2), "x": torch.arange(4)}
        )


def test_load_into_a_one_element_view_with_any_stride(local_target: Target) -> None:
    """``base[:1, 2]`` is contiguous (one element) with stride 5: the in-place
    path's byte view of it must not depend on that stride (it raised)."""
    dcpstore.save({"x": torch.tensor([7.0]), "y": torch.arange(3.0)}, local_target.uri).result()
    ours, stock = torch.zeros(5, 5), torch.zeros(5, 5)
    dcpstore.load({"x": ours[:1, 2], "y": ours[2:, 0]}, local_target.uri)
    dcp.load({"x": stock[:1, 2], "y": stock[2:, 0]}, checkpoint_id=local_target.uri)
    assert torch.equal(ours, stock) and ours[0, 2] == 7.0 and torch.equal(ours[2:, 0], torch.arange(3.0))


FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)


@pytest.mark.skipif(FLOAT4 is None, reason="this torch has no float4_e2m1fn_x2")
@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
def test_strided_float4_saves_and_loads_on_every_engine(local_target: Target, engine: str) -> None:
    """torch has no copy_ kernel for float4_e2m1fn_x2 between layouts: async
    staging of a strided one failed, and so does stock dcp.load of a
    transposed one; dcpstore moves the bytes through a uint8 view."""
    assert FLOAT4 is not None
    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (300, 400), dtype=torch.uint8, generator=g)
    state = {"t": raw.view(FLOAT4).t(), "strided": raw.view(FLOAT4)[:, ::3], "plain": raw.view(FLOAT4)[:7]}
    save_with(engine, state, local_target)
    dest = destination(state)
    dcpstore.load(dest, local_target.uri)
    assert_same_state(dest, state)
    with pytest.raises(BaseException, match="copy_.* not implemented for 'Float4_e2m1fn_x2'"):
        dcp.load(destination(state), checkpoint_id=local_target.uri)  # stock DCP's gap, for the record
