"""Differential tests: stock DCP is the oracle, on every engine and backend.

Hypothesis generates state dicts -- every dtype DCP can save (bf16, the
float8 variants, complex32/64/128, bool, uint16/32/64, ...), 0-d and empty
tensors, transposed, offset, strided and expanded views, conjugate and
negative views, keys sharing one storage, tensors of 64 KiB and more (the
reader's in-place path), nested dicts and lists, tuples, and non-tensor
values -- and checks, bitwise:

* saved by dcpstore (sync, native async, NVRx), they load equal through
  ``dcpstore.load`` *and* stock ``dcp.load``;
* saved by stock ``dcp.save``, they load equal through ``dcpstore.load``;
* saved by dcpstore in the odd layouts -- data files spread over key
  prefixes (``spread_prefixes``), or saved over an earlier checkpoint
  (save-unique names) -- they load equal through both, too;

on every backend: local, S3 (moto) natively and through MSC, an msc://
profile, local through MSC, fsspec ``memory://``. Stock DCP reaches the
object stores through its fsspec reader and writer (s3fs), the msc://
profile through the bucket it names.

The quick run draws two examples per engine and backend (per layout and
backend for the odd layouts, saved synchronously); the slow run (``-m
slow``) draws 6 more on each, the odd layouts on every engine.
"""

from __future__ import annotations

import os
import uuid
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import dcpstore
from dcpstore._impl.format.layout import MANIFEST, is_manifest
from tests.support.backends import TARGETS, Target
from tests.support.oracle import SAVE_ENGINES, assert_same_state, destination, save_with
from tests.support.s3_server import BUCKET

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
] + [
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
]
#: dtypes torch can negate (the negative view needs it to resolve).
NEGATABLE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128}
VIEWS = ("plain", "transposed", "offset", "strided", "expanded", "conj", "neg", "conj_transposed")
#: At least this many bytes take the reader's in-place path.
IN_PLACE = 64 * 1024


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values, every bit pattern included (NaN payloads, -0.0)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    views = [v for v in VIEWS if ("conj" not in v or dtype.is_complex) and (v != "neg" or dtype in NEGATABLE)]
    view = draw(st.sampled_from(views))
    seed = draw(st.integers(0, 2**31))
    big = draw(st.integers(0, 5)) == 0
    if big:
        rows, cols = 4, IN_PLACE // dtype.itemsize // 4 + draw(st.integers(0, 64))
    else:
        rows, cols = draw(st.integers(0, 6)), draw(st.integers(0, 9))
    if draw(st.booleans()) and view == "plain" and not big:
        return _random((), dtype, seed) if draw(st.booleans()) else _random((cols,), dtype, seed)  # 0-d, 1-d
    if view == "transposed" or view == "conj_transposed":
        t = _random((cols, rows), dtype, seed).t()
        return t.conj() if view == "conj_transposed" else t
    if view == "offset":
        return _random((rows + 2, cols), dtype, seed)[2:]
    if view == "strided":
        return _random((rows, cols * 3), dtype, seed)[:, 1::3]
    if view == "expanded":
        return _random((1, cols), dtype, seed).expand(rows, cols)
    t = _random((rows, cols), dtype, seed)
    if view == "conj":
        return t.conj()
    if view == "neg":
        return torch._neg_view(t)
    return t


KEYS = st.text(alphabet="abcwxyz_", min_size=1, max_size=4)
SCALARS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.none(),
    st.binary(max_size=6),
    st.lists(st.floats(allow_nan=False), max_size=3),
    st.booleans(),
)


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, Any]:
    leaf = st.one_of(tensors(), tensors(), SCALARS)
    inner = st.one_of(
        leaf,
        st.lists(tensors(), min_size=1, max_size=3),  # DCP walks into lists of tensors
        st.tuples(st.integers(), tensors()),  # ... and pickles tuples whole, tensors included
        st.dictionaries(KEYS, leaf, max_size=3),
    )
    state = draw(
        st.dictionaries(KEYS, st.one_of(inner, st.dictionaries(KEYS, inner, max_size=3)), min_size=1, max_size=6)
    )
    state["anchor"] = draw(tensors())  # at least one tensor
    if draw(st.booleans()):  # keys over one storage: the same tensor, and a view of it
        base = draw(tensors())
        state["shared"] = {"same": base, "again": base, "part": base[1:] if base.dim() else base}
    return state


def _stock_uri(target: Target) -> str:
    """Where stock DCP reaches ``target``: a path, or an fsspec URL."""
    if target.uri.startswith("msc://"):  # the profile's base_path is the session bucket
        return f"s3://{BUCKET}/" + target.uri.split("/", 3)[3]
    return target.uri


def _stock_io(target: Target, *, writing: bool) -> dict[str, Any]:
    """Keyword arguments for stock ``dcp.save`` / ``dcp.load`` at ``target``."""
    uri = _stock_uri(target)
    if "://" not in uri:
        return {"checkpoint_id": uri}
    return {"storage_writer": FsspecWriter(uri)} if writing else {"storage_reader": FsspecReader(uri)}


def _fresh(target: Target) -> Target:
    return target.child(uuid.uuid4().hex[:8])


QUICK = settings(
    max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
WIDER = settings(QUICK, max_examples=6)  # the slow run


#: The one thing stock dcp.load cannot do with what it saved: torch has no
#: strided copy_ kernel for float4 (a transposed float4 tensor).
STOCK_GAP = "\"copy_\" not implemented for 'Float4_e2m1fn_x2'"
FLOAT4 = getattr(torch, "float4_e2m1fn_x2", None)


#: How a checkpoint's files are laid out: stock DCP's flat layout; data files
#: spread over key prefixes (``SaveOptions.spread_prefixes``); or saved
#: over an earlier checkpoint at the URI (save-unique file and manifest names).
ODD_LAYOUTS = ("spread", "overwritten")
SPREAD = 4


def _layout_kwargs(layout: str) -> dict[str, Any]:
    """``dcpstore.save``'s further keywords that make ``layout``."""
    return {"spread_prefixes": SPREAD} if layout == "spread" else {}


def _assert_layout(where: Target, layout: str) -> None:
    """The save really made ``layout`` (a layout that silently stays flat
    would make its test a copy of the flat one)."""
    names = [o["path"] for o in dcpstore.open_storage(where.uri, **where.kwargs).list()]
    if layout == "spread":
        assert any("/" in n for n in names if n.endswith(".distcp")), names
    if layout == "overwritten":
        assert any(is_manifest(n) and n != MANIFEST for n in names), names


def _dcpstore_save_round_trip(engine: str, target: Target, state: dict[str, Any], layout: str = "flat") -> None:
    where = _fresh(target)
    if layout == "overwritten":  # the same keys, other values: a mixture of the two saves would show
        save_with(engine, destination(state, fill=0x5A), where)
    save_with(engine, state, where, **_layout_kwargs(layout))
    _assert_layout(where, layout)
    ours = destination(state, fill=0xA5)
    dcpstore.load(ours, where.uri, **where.kwargs)
    assert_same_state(ours, state)
    stock = destination(state, fill=0xA5)
    try:
        dcp.load(stock, **_stock_io(where, writing=False))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if STOCK_GAP not in str(e):
            raise
        # Stock DCP cannot copy a strided float4 tensor; dcpstore can
        # (test_odd_tensors). Everything else is still compared with stock.
        state, dropped = _without_stock_gap(state)
        assert dropped, f"stock dcp.load hit the float4 gap, but no strided float4 tensor was saved: {e}"
        warnings.warn(StockGap(f"stock dcp.load cannot load {dropped} (strided float4); compared the rest"))
        stock = destination(state, fill=0xA5)
        dcp.load(stock, **_stock_io(where, writing=False))
    assert_same_state(stock, state)


class StockGap(UserWarning):
    """Keys left out of a stock-DCP comparison, and why (shown in pytest's summary)."""


def _is_gap(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == FLOAT4 and not value.is_contiguous()


def _holds_gap(value: Any) -> bool:
    if _is_gap(value):
        return True
    if isinstance(value, dict):
        return any(map(_holds_gap, value.values()))
    return isinstance(value, list) and any(map(_holds_gap, value))


def _without_stock_gap(state: dict[str, Any], path: str = "") -> tuple[dict[str, Any], list[str]]:
    """``state`` without what stock DCP cannot load (a strided float4 tensor;
    a list holding one goes whole: DCP keys a list's items by position),
    and the keys left out."""
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in state.items():
        where = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict):
            kept[key], inner = _without_stock_gap(value, where)
            dropped += inner
        elif _holds_gap(value):
            dropped.append(where)
        else:
            kept[key] = value
    return kept, dropped


def _stock_save_round_trip(target: Target, state: dict[str, Any]) -> None:
    where = _fresh(target)
    dcp.save(dict(state), **_stock_io(where, writing=True))
    ours = destination(state, fill=0xA5)
    dcpstore.load(ours, where.uri, **where.kwargs)
    assert_same_state(ours, state)
    assert not dcpstore.open_storage(where.uri, **where.kwargs).exists(".dcpstore.json")  # really stock's files


#: Found by this suite: pickle protocol 2 (torch.save's) writes an empty
#: bytes as a call to builtins.bytes(), which the item allowlist refused.
PLAIN_VALUES = {"t": torch.arange(3.0), "empty": b"", "blob": b"\x00\xff", "none": None, "ba": bytearray()}


@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
@given(state=state_dicts())
@example(state=PLAIN_VALUES)
@QUICK
def test_dcpstore_saves_what_stock_dcp_loads(target: Target, engine: str, state: dict[str, Any]) -> None:
    _dcpstore_save_round_trip(engine, target, state)


@given(state=state_dicts())
@example(state=PLAIN_VALUES)
@QUICK
def test_dcpstore_loads_what_stock_dcp_saves(target: Target, state: dict[str, Any]) -> None:
    _stock_save_round_trip(target, state)


@pytest.mark.parametrize("layout", ODD_LAYOUTS)
@given(state=state_dicts())
@QUICK
def test_dcpstore_saves_what_stock_dcp_loads_in_odd_layouts(target: Target, layout: str, state: dict[str, Any]) -> None:
    # The layout is the writer's, the same on every engine: the quick run
    # saves synchronously, the slow run on every engine.
    _dcpstore_save_round_trip("sync", target, state, layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ODD_LAYOUTS)
@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
@given(state=state_dicts())
@WIDER
def test_dcpstore_saves_what_stock_dcp_loads_in_odd_layouts_wider(
    target: Target, engine: str, layout: str, state: dict[str, Any]
) -> None:
    _dcpstore_save_round_trip(engine, target, state, layout)


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(SAVE_ENGINES))
@given(state=state_dicts())
@WIDER
def test_dcpstore_saves_what_stock_dcp_loads_wider(target: Target, engine: str, state: dict[str, Any]) -> None:
    _dcpstore_save_round_trip(engine, target, state)


@pytest.mark.slow
@given(state=state_dicts())
@WIDER
def test_dcpstore_loads_what_stock_dcp_saves_wider(target: Target, state: dict[str, Any]) -> None:
    _stock_save_round_trip(target, state)


def test_the_generator_covers_what_it_claims() -> None:
    """Guard against a strategy that silently stopped producing a case."""
    seen: set[str] = set()

    def note(t: torch.Tensor) -> None:
        seen.add(str(t.dtype))
        seen.update(
            name
            for name, hit in (
                ("0-d", t.dim() == 0),
                ("empty", t.numel() == 0),
                ("conj", t.is_conj()),
                ("neg", t.is_neg()),
                ("non-contiguous", not t.is_contiguous()),
                ("offset", t.storage_offset() > 0),
                ("expanded", 0 in t.stride() and t.numel() > 1),
                ("in-place", t.nbytes >= IN_PLACE),
            )
            if hit
        )

    @given(tensors())
    @settings(max_examples=500, deadline=None, database=None, derandomize=True)
    def collect(t: torch.Tensor) -> None:
        note(t)

    collect()
    wanted = {str(d) for d in DTYPES} | {
        "0-d",
        "empty",
        "conj",
        "neg",
        "non-contiguous",
        "offset",
        "expanded",
        "in-place",
    }
    assert wanted <= seen, sorted(wanted - seen)


assert set(TARGETS) == {"local", "local+direct", "s3", "s3+msc", "msc", "local+msc", "memory"}, (
    "new backend: teach _stock_uri about it"
)
assert os.sep == "/"
