"""CRC32C: dcpstore's checksum, where it runs on awscrt, against the
``crc32c`` package; and the combine, property-tested against an
independent reference and against the ``crc32c`` package at lengths past
2**29 and 2**32.

The reference is the GF(2) *matrix* formulation of zlib's original
``crc32_combine`` (a 32x32 bit matrix for "shift by one zero bit", squared
and multiplied). It shares no code and no shortcut with the polynomial
arithmetic in :mod:`dcpstore._impl.util.checksum`, whose zlib-derived period-32
table once broke every item of 512 MiB or more.
"""

from __future__ import annotations

import importlib.util
import mmap
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcpstore._impl.util.checksum import COMBINE_MIN, CRC32C_LIBRARY, DualCrc, crc32c_combine
from dcpstore._impl.util.checksum import crc32c as dcpstore_crc32c

_POLY = 0x82F63B78


def _matrix_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _matrix_square(mat: list[int]) -> list[int]:
    return [_matrix_times(mat, mat[n]) for n in range(32)]


def reference_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """zlib 1.2.3's crc32_combine, with the CRC32C polynomial."""
    if len_b == 0:  # zlib returns crc_a: the same for valid input (crc_b == 0)
        return crc_a ^ crc_b
    odd = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _matrix_square(odd)  # two zero bits
    odd = _matrix_square(even)  # four zero bits
    while True:
        even = _matrix_square(odd)
        if len_b & 1:
            crc_a = _matrix_times(even, crc_a)
        len_b >>= 1
        if not len_b:
            break
        odd = _matrix_square(even)
        if len_b & 1:
            crc_a = _matrix_times(odd, crc_a)
        len_b >>= 1
        if not len_b:
            break
    return crc_a ^ crc_b


def crc_of_zeros(n: int, crc: int = 0, chunk: int = 64 << 20) -> int:
    """crc32c of ``n`` zero bytes appended to a CRC, computed by the library
    in chunks (no n-byte buffer)."""
    zeros = memoryview(bytes(min(n, chunk)))
    while n:
        step = min(n, len(zeros))
        crc = crc32c.crc32c(zeros[:step], crc)
        n -= step
    return int(crc)


crcs = st.integers(min_value=0, max_value=2**32 - 1)


#: Decided by looking for the module, not by asking dcpstore (tests/support/extras.py says why).
AWSCRT = importlib.util.find_spec("awscrt") is not None
on_awscrt = pytest.mark.skipif(
    not AWSCRT,
    reason="no awscrt here (the crt extra; CI's torch-range venvs have it): dcpstore's CRC32C is the crc32c package's",
)


def test_dcpstore_runs_on_awscrt_where_it_is_installed() -> None:
    assert CRC32C_LIBRARY == ("awscrt" if AWSCRT else "crc32c")


@on_awscrt
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=9000), start=st.integers(min_value=0, max_value=63), crc=crcs)
def test_dcpstore_crc32c_is_the_crc32c_packages(data: bytes, start: int, crc: int) -> None:
    # Any length and alignment (a folded loop has head, body and tail paths), any running CRC.
    view = memoryview(data)[min(start, len(data)) :]
    assert dcpstore_crc32c(view, crc) == crc32c.crc32c(view, crc)


@on_awscrt
@pytest.mark.parametrize("kind", ["bytearray", "tensor", "mmap"])
def test_dcpstore_crc32c_reads_the_buffers_a_checkpoint_holds(kind: str, tmp_path: Path) -> None:
    data = bytes(range(256)) * 4099  # many fold blocks, odd length
    buf: Any
    if kind == "bytearray":
        buf = bytearray(data)
    elif kind == "tensor":
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch.float16).numpy()
    else:
        path = tmp_path / "f"
        path.write_bytes(data)
        with path.open("rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert dcpstore_crc32c(buf) == crc32c.crc32c(data)


@on_awscrt
@pytest.mark.slow
def test_dcpstore_crc32c_past_4_gib_is_not_truncated() -> None:
    # A length that does not fit 32 bits (a C int length would wrap), one call.
    n = (1 << 32) + 4099
    big = bytearray(n)
    big[-1] = 1
    assert dcpstore_crc32c(big) == crc32c.crc32c(b"\x01", crc_of_zeros(n - 1))


@settings(max_examples=300, deadline=None)
@given(crc_a=crcs, crc_b=crcs, len_b=st.integers(min_value=0, max_value=2**61 - 1))
def test_combine_matches_the_matrix_reference_at_any_length(crc_a: int, crc_b: int, len_b: int) -> None:
    assert crc32c_combine(crc_a, crc_b, len_b) == reference_combine(crc_a, crc_b, len_b)


@settings(max_examples=60, deadline=None)
@given(
    crc_a=crcs,
    crc_b=crcs,
    k=st.integers(min_value=20, max_value=60),
    delta=st.integers(min_value=-3, max_value=3),
)
def test_combine_around_powers_of_two(crc_a: int, crc_b: int, k: int, delta: int) -> None:
    # Lengths at and next to 2**k: where a wrapped power table goes wrong.
    n = (1 << k) + delta
    assert crc32c_combine(crc_a, crc_b, n) == reference_combine(crc_a, crc_b, n)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), cut=st.integers(min_value=0, max_value=4096))
def test_combine_of_a_random_split_is_the_crc_of_the_whole(data: bytes, cut: int) -> None:
    a, b = data[: min(cut, len(data))], data[min(cut, len(data)) :]
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(data)


def test_reference_agrees_with_the_library() -> None:
    # The reference itself is checked against real CRCs, so it cannot drift.
    head = b"dcpstore"
    for n in (0, 1, 7, 4096, COMBINE_MIN + 3):
        tail = bytes(range(256)) * (n // 256) + bytes(n % 256)
        assert reference_combine(crc32c.crc32c(head), crc32c.crc32c(tail), n) == crc32c.crc32c(head + tail)


@pytest.mark.parametrize("n", [(1 << 29) - 1, 1 << 29, (1 << 29) + 3, 600 << 20])
def test_combine_past_512_mib_against_the_library(n: int) -> None:
    head = crc32c.crc32c(b"a header before a big tensor")
    assert crc32c_combine(head, crc_of_zeros(n), n) == crc_of_zeros(n, head)


@pytest.mark.slow
@pytest.mark.parametrize("n", [(1 << 31) + 1, (1 << 32) + 7])
def test_combine_past_2_and_4_gib_against_the_library(n: int) -> None:
    head = crc32c.crc32c(b"x")
    assert crc32c_combine(head, crc_of_zeros(n), n) == crc_of_zeros(n, head)


def test_dual_crc_over_a_write_past_512_mib() -> None:
    # The writer's own path: one large write combined into item and file CRCs.
    big = memoryview(bytes((1 << 29) + 5))
    dual = DualCrc()
    dual.update(memoryview(b"zip header"))
    dual.item = 0
    dual.update(big)
    assert dual.item == crc_of_zeros(len(big))
    assert dual.file == crc32c.crc32c(big, crc32c.crc32c(b"zip header"))
