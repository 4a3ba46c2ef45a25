"""Byte arithmetic for cutting one read or write into requests:
:func:`byte_ranges`, :func:`equal_ranges`, :func:`slice_buffers`, how
many pieces of a size hold a count (:func:`ceil_div`, which the layers
above use too), and where a buffer lies in memory (:func:`buffer_address`)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

#: How much larger than the asked size a piece of :func:`byte_ranges` may
#: grow (1/8): rather than a last piece of a few bytes.
PIECE_SLACK = 8


def ceil_div(n: int, d: int) -> int:
    """``n / d`` rounded up, in integers (``ceil_div(10, 4) == 3``): how many
    pieces of ``d`` hold ``n``. Exact for any size, as a float's ``ceil`` is not."""
    return -(-n // d)


def byte_ranges(offset: int, length: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of consecutive pieces covering ``length`` bytes at
    ``offset``, about ``piece`` bytes each.

    The pieces are of equal size (to a byte), at most ``piece + piece //
    PIECE_SLACK``: a read of 4 x 8 MiB and a 12 KiB record trailer is four
    ranged GETs, not five, one of them for 12 KiB (a whole round trip, and a
    connection taken from the budget the others share).
    """
    if length <= 0:
        return []
    return equal_ranges(offset, length, ceil_div(length, piece + piece // PIECE_SLACK))


def equal_ranges(offset: int, length: int, count: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``count`` consecutive pieces of equal size (to
    a byte) covering ``length`` bytes at ``offset`` (fewer if there are fewer bytes)."""
    count = max(1, min(count, length))
    size, bigger = divmod(length, count)
    ranges = []
    for i in range(count):
        n = size + (i < bigger)
        ranges.append((offset, n))
        offset += n
    return ranges


def slice_buffers(buffers: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """The views of bytes ``[start, start + length)`` of the concatenation of
    ``buffers`` (for splitting a scatter read into requests, or resuming one)."""
    out: list[memoryview] = []
    pos = 0
    end = start + length
    for buf in buffers:
        lo, hi = max(start, pos), min(end, pos + buf.nbytes)
        if lo < hi:
            out.append(buf[lo - pos : hi - pos])
        pos += buf.nbytes
        if pos >= end:
            break
    return out


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (in the stable ABI since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def buffer_address(view: memoryview) -> int:
    """Where a (non-empty) buffer's bytes start in memory; -1 if empty.
    Read-only buffers too (torch hands a tensor's bytes so), through the
    buffer protocol itself: ``ctypes.from_buffer`` wants a writable one."""
    if view.nbytes == 0:
        return -1
    buf = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buf), 0)  # PyBUF_SIMPLE
    try:
        return buf.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))
