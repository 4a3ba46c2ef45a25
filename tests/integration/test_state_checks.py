"""What save refuses up front, and what load refuses before reading a byte.

Save: values DCP cannot write or read back raise InvalidArgument naming the
key from ``save`` itself, on every engine, and nothing is written (stock DCP
fails on each of them too, deep inside its planner or torch.save).
Load: a stored object where the destination holds a tensor, and lossy dtype
conversions, raise StateDictMismatch naming the key and both types, with
the destination untouched; the conversions stock DCP allows and that lose
nothing but precision still load, equal to stock dcp.load's result.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from tests.support.backends import Target
from tests.support.dist_utils import run_ranks
from tests.support.oracle import SAVE_ENGINES, assert_same_state, save_with

UNSAVEABLE: dict[str, tuple[Callable[[], dict[Any, Any]], str]] = {
    "sparse_coo": (lambda: {"w": {"s": torch.eye(4).to_sparse()}}, r"'w\.s'.*sparse_coo"),
    "sparse_csr": (lambda: {"s": torch.eye(4).to_sparse_csr()}, r"'s'.*sparse_csr"),
    "meta": (lambda: {"layer": [torch.ones(2), torch.empty(3, device="meta")]}, r"'layer\.1'.*meta tensor"),
    "nested": (lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, r"'n'.*nested"),
    "sub_byte_dtype": (lambda: {"q": torch.empty(4, dtype=torch.uint4)}, r"'q'.*torch\.uint4"),
    "mixed_top_keys": (lambda: {1: torch.ones(2), "a": torch.ones(2)}, r"top-level keys mix int and str"),
    "same_name": (lambda: {"a.b": torch.ones(2), "a": {"b": torch.ones(2)}}, r"both stored under the name 'a\.b'"),
}


@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
@pytest.mark.parametrize("case", list(UNSAVEABLE))
def test_save_refuses_up_front_naming_the_key(local_target: Target, engine: str, case: str) -> None:
    make, message = UNSAVEABLE[case]
    with pytest.raises(dcpstore.InvalidArgument, match=message):
        save_with(engine, make(), local_target)
    assert not os.path.exists(local_target.uri)  # refused before anything was written


def test_stock_dcp_cannot_save_them_either(local_target: Target) -> None:
    """The refusals above are not dcpstore limits: stock dcp.save fails on
    each (or, for mixed keys, stock dcp.load fails on what it saved)."""
    for case, (make, _) in UNSAVEABLE.items():
        uri = os.path.join(local_target.uri, case)
        with pytest.raises(BaseException):  # DCP's CheckpointException is a BaseException
            state = make()
            dcp.save(state, checkpoint_id=uri)
            dcp.load(state, checkpoint_id=uri)


@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
def test_quantized_tensors_round_trip_on_every_engine(local_target: Target, engine: str) -> None:
    """Async staging used to die in an INTERNAL ASSERT (an empty quantized
    buffer has no quantizer); now every engine saves what stock DCP saves."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    state = {
        "per_tensor": torch.quantize_per_tensor(x, 0.05, 3, torch.quint8),
        "per_channel": torch.quantize_per_channel(
            x.reshape(10, 100), torch.rand(10, generator=g) + 0.01, torch.arange(10), 0, torch.qint8
        ),
    }
    save_with(engine, state, local_target)

    def blank() -> dict[str, torch.Tensor]:  # quantized destinations, other values and scales
        return {
            "per_tensor": torch.quantize_per_tensor(torch.zeros(1000), 1.0, 0, torch.quint8),
            "per_channel": torch.quantize_per_channel(
                torch.zeros(10, 100), torch.ones(10), torch.zeros(10, dtype=torch.long), 0, torch.qint8
            ),
        }

    ours, stock = blank(), blank()
    dcpstore.load(ours, local_target.uri)
    dcp.load(stock, checkpoint_id=local_target.uri)
    for key, value in state.items():
        # DCP copies the stored integer values into the destination, which
        # keeps its own scale and zero point: stock and ours alike.
        assert torch.equal(stock[key].int_repr(), value.int_repr()), key  # the oracle
        assert torch.equal(ours[key].int_repr(), value.int_repr()), key
        assert torch.equal(ours[key].dequantize(), stock[key].dequantize()), key


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def _saved(target: Target) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    state = {
        "z": torch.randn(300, dtype=torch.complex64, generator=g),
        "f": torch.randn(20_000, generator=g) * 100,  # >= 64 KiB: the in-place read path
        "i": torch.randint(-5, 5, (30,), generator=g),
        "obj": {"lr": 0.1},
        "n": 7,
    }
    dcpstore.save(state, target.uri).result()
    return state


LOSSY = {
    "object_into_tensor": ("n", torch.zeros(3), r"'n'.*non-tensor object.*torch\.float32, shape \(3,\)"),
    "complex_to_real": ("z", torch.zeros(300), r"'z'.*torch\.complex64.*torch\.float32.*imaginary part"),
    "float_to_int": ("f", torch.zeros(20_000, dtype=torch.int32), r"'f'.*torch\.float32.*torch\.int32.*fractions"),
    "float_to_bool": ("f", torch.zeros(20_000, dtype=torch.bool), r"'f'.*torch\.float32.*torch\.bool"),
    "int_to_bool": ("i", torch.zeros(30, dtype=torch.bool), r"'i'.*torch\.int64.*torch\.bool"),
    "complex_to_int": ("z", torch.zeros(300, dtype=torch.int16), r"'z'.*complex64.*int16"),
}


@pytest.mark.parametrize("case", list(LOSSY))
def test_lossy_load_refused_naming_key_and_types_nothing_loaded(local_target: Target, case: str) -> None:
    _saved(local_target)
    key, dest_value, message = LOSSY[case]
    before = {"f": torch.full((20_000,), 3.0), "i": torch.full((30,), 9), "n": None}
    dest = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in before.items()}
    dest[key] = dest_value
    with pytest.raises(dcpstore.StateDictMismatch, match=message):
        dcpstore.load(dest, local_target.uri)
    for k, v in before.items():
        if k != key:
            assert_same_state(dest[k], v, k)  # nothing was loaded


ALLOWED = {
    "f32_to_bf16": ("f", torch.bfloat16),
    "f32_to_f64": ("f", torch.float64),
    "f32_to_f8": ("f", torch.float8_e4m3fn),
    "f32_to_complex": ("f", torch.complex128),
    "c64_to_c128": ("z", torch.complex128),
    "int_to_float": ("i", torch.float16),
    "int_to_int8": ("i", torch.int8),
}


@pytest.mark.parametrize("case", list(ALLOWED))
def test_allowed_conversions_load_like_stock_dcp(local_target: Target, case: str) -> None:
    state = _saved(local_target)
    key, dtype = ALLOWED[case]
    ours = {key: torch.zeros(state[key].shape, dtype=dtype)}
    stock = {key: torch.zeros(state[key].shape, dtype=dtype)}
    dcpstore.load(ours, local_target.uri)
    dcp.load(stock, checkpoint_id=local_target.uri)
    assert_same_state(ours, stock)
    assert not torch.equal(ours[key], torch.zeros_like(ours[key]))


def test_load_into_mixed_top_level_keys_is_an_invalid_argument(local_target: Target) -> None:
    _saved(local_target)
    with pytest.raises(dcpstore.InvalidArgument, match="top-level keys mix int and str"):
        dcpstore.load({"f": torch.zeros(20_000), 3: torch.zeros(1)}, local_target.uri)


def _mismatch_on_rank1(rank: int, world_size: int, uri: str) -> None:
    dest: dict[str, Any] = {"f": torch.zeros(20_000), "i": torch.zeros(30, dtype=torch.int64)}
    if rank == 1:
        dest["i"] = torch.zeros(30, dtype=torch.bool)
    with pytest.raises(dcpstore.StateDictMismatch, match=r"'i'.*torch\.int64.*torch\.bool"):
        dcpstore.load(dest, uri)
    assert torch.equal(dest["f"], torch.zeros(20_000))


def test_a_mismatch_on_one_rank_fails_every_rank_without_a_hang(local_target: Target) -> None:
    """The check runs inside DCP's planning step, which gathers failures:
    rank 0 (whose destination matches) raises too instead of waiting for
    rank 1 in a collective."""
    _saved(local_target)
    run_ranks(_mismatch_on_rank1, 2, local_target.uri, timeout=120)
