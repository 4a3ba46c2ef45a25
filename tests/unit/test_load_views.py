"""The reader's zero-copy path: a saved item viewed in place equals torch.load's copy."""

from __future__ import annotations

import io

import pytest
import torch

from dcpstore._impl.format import record as dcp_writer
from dcpstore._impl.format.record import item_tensor


@pytest.fixture(autouse=True)
def view_every_item(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small test tensors take the view path too (it is size-gated in use)."""
    monkeypatch.setattr(dcp_writer, "VIEW_MIN_BYTES", 0)


def _saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


base = torch.randn(16, 12)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(1000),
        torch.randn(7, 5).half(),
        torch.randn(8, 30).bfloat16(),
        torch.randint(-(2**40), 2**40, (9,)),
        torch.rand(40) > 0.5,
        torch.tensor(3.25),
        base.t(),  # transposed: strides are kept
        torch.randint(0, 255, (3, 4), dtype=torch.uint8),
    ],
    ids=["f32", "f16", "bf16", "i64", "bool", "scalar", "transposed", "u8"],
)
def test_item_tensor_is_a_view_equal_to_torch_load(tensor: torch.Tensor) -> None:
    blob = _saved(tensor)
    got = item_tensor(memoryview(blob))
    want = torch.load(io.BytesIO(blob), weights_only=True)
    assert got.dtype == want.dtype and got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)
    # No copy: the tensor's bytes lie inside the item's buffer.
    start = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    assert start <= got.untyped_storage().data_ptr() < start + len(blob)


@pytest.mark.parametrize("tensor", [torch.empty(0, 4), torch.randn(3)[1:]], ids=["empty", "offset-view"])
def test_item_tensor_edge_cases_match_torch_load(tensor: torch.Tensor) -> None:
    blob = _saved(tensor)
    got, want = item_tensor(memoryview(blob)), torch.load(io.BytesIO(blob), weights_only=True)
    assert got.shape == want.shape and torch.equal(got, want)


def test_small_items_are_copied_by_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dcp_writer, "VIEW_MIN_BYTES", 1 << 20)
    blob = _saved(torch.randn(100))
    got = item_tensor(memoryview(blob))
    start = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
    assert not (start <= got.untyped_storage().data_ptr() < start + len(blob))
    assert torch.equal(got, torch.load(io.BytesIO(blob), weights_only=True))


def test_item_tensor_damaged_header_falls_back_to_torch_loads_error() -> None:
    blob = b"not a torch.save archive"
    with pytest.raises(Exception) as stock:
        torch.load(io.BytesIO(blob), weights_only=True)
    with pytest.raises(type(stock.value)) as ours:
        item_tensor(memoryview(blob))
    assert type(ours.value) is type(stock.value) and str(ours.value) == str(stock.value)
